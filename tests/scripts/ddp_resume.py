"""Launched by tests/test_distributed.py: 2-rank gloo DDP, a mid-epoch resume against the uninterrupted run.

One launch, three Trainers in the same ranks: 8 steps straight; 3 steps with a checkpoint; a new
model resumed from it to step 8.  Each rank dumps its losses and final weights of both runs.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _models import Classifier, classification_data, mlp  # noqa: E402

from mptrain import Trainer  # noqa: E402

out, precision = Path(sys.argv[1]), sys.argv[2]


def fit(root, max_steps, ckpt_path=None):
    torch.manual_seed(0)
    model = Classifier(mlp(dropout=0.2), lr=0.05, optimizer="sgd")
    loader = torch.utils.data.DataLoader(classification_data(n=96), batch_size=4, shuffle=True)
    trainer = Trainer(precision=precision, max_steps=max_steps, accumulate_grad_batches=2, accelerator="cpu",
                      devices=2, strategy="ddp", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      seed=0, default_root_dir=str(root), checkpoint_every_n_steps=3)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    weights = trainer._checkpoint_connector.dump_checkpoint()["state_dict"]
    return trainer.global_rank, torch.stack(model.losses), weights


rank, straight, straight_weights = fit(out / "straight", 8)  # 12 batches a rank an epoch: 6 steps
fit(out / "cut", 3)
_, rest, resumed_weights = fit(out / "cut", 8, ckpt_path="last")
torch.save({"straight": straight, "rest": rest, "straight_weights": straight_weights,
            "resumed_weights": resumed_weights}, out / f"resume.rank{rank}.pt")
# gloo threads left to the interpreter's teardown can abort the process at exit
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
