"""Launched by tests/test_distributed.py: 2-rank gloo DDP, resumed runs against the uninterrupted one.

One launch, five Trainers in the same ranks: 12 steps (two epochs) straight; 7 steps with a
checkpoint (mid-epoch, in the second epoch) and a new model resumed from it to step 12; one
epoch, a checkpoint written after ``fit`` returned, and a new model continuing it to two epochs.
Each rank dumps its losses and final weights of every run.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _models import Classifier, classification_data, mlp  # noqa: E402

from mptrain import Trainer  # noqa: E402

out, precision = Path(sys.argv[1]), sys.argv[2]


def fit(root, ckpt_path=None, **limits):
    torch.manual_seed(0)
    model = Classifier(mlp(dropout=0.2), lr=0.05, optimizer="sgd")
    loader = torch.utils.data.DataLoader(classification_data(n=96), batch_size=4, shuffle=True)
    trainer = Trainer(precision=precision, accumulate_grad_batches=2, accelerator="cpu", devices=2, strategy="ddp",
                      logger=False, enable_progress_bar=False, enable_model_summary=False, seed=0,
                      default_root_dir=str(root), checkpoint_every_n_steps=7, **limits)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    weights = trainer._checkpoint_connector.dump_checkpoint()["state_dict"]
    return trainer, torch.stack(model.losses), weights


# 12 batches a rank an epoch: 6 steps
trainer, straight, straight_weights = fit(out / "straight", max_steps=12)
fit(out / "cut", max_steps=7)
_, rest, resumed_weights = fit(out / "cut", ckpt_path="last", max_steps=12)
first, _, _ = fit(out / "after_fit", max_epochs=1)
first.save_checkpoint(out / "after_fit" / "epoch1.ckpt")
_, continued, continued_weights = fit(out / "after_fit", ckpt_path=str(out / "after_fit" / "epoch1.ckpt"),
                                      max_epochs=2)
torch.save({"straight": straight, "rest": rest, "continued": continued, "straight_weights": straight_weights,
            "resumed_weights": resumed_weights, "continued_weights": continued_weights},
           out / f"resume.rank{trainer.global_rank}.pt")
# gloo threads left to the interpreter's teardown can abort the process at exit
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
