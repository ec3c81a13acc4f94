"""Launched by tests/test_distributed.py: a checkpoint written mid-epoch by ONE
process, resumed by TWO gloo ranks. The epoch layout changed (half the batches per rank), so the
resume must be refused naming the saved and current world size, never crash or remap silently.

``save``: one process, 3 steps, checkpoint.  ``resume``: 2 ranks (Lightning's launcher) from it;
exit 3 with the refusal printed once the Trainer refuses.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _models import Classifier, classification_data, mlp  # noqa: E402

from mptrain import Trainer  # noqa: E402

out, mode = Path(sys.argv[1]), sys.argv[2]
devices = 1 if mode == "save" else 2
torch.manual_seed(0)
trainer = Trainer(precision="32-true", max_steps=3 if mode == "save" else 8, accelerator="cpu", devices=devices,
                  strategy="ddp" if devices > 1 else "auto", logger=False, enable_progress_bar=False,
                  enable_model_summary=False, seed=0, default_root_dir=str(out), checkpoint_every_n_steps=3)
loader = torch.utils.data.DataLoader(classification_data(n=96), batch_size=4, shuffle=True)
try:
    trainer.fit(Classifier(mlp(), lr=0.05, optimizer="sgd"), loader, ckpt_path=None if mode == "save" else "last")
except ValueError as e:
    print(f"REFUSED: {e}", flush=True)
    code = 3
else:
    code = 0
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
sys.exit(code)
