"""Launched by tests/test_distributed.py: 2-rank gloo DDP, runs resumed from several positions against the
uninterrupted one.

One launch, every Trainer in the same ranks, per precision given (comma-separated): two epochs straight (10 batches a rank an epoch, accumulation 3: optimizer
steps at batches 3, 6, 9 and 10, so the window does not divide the epoch), a checkpoint at every step and Lightning's
default one at each epoch's end; one epoch alone with a checkpoint written after ``fit`` returned; then a new model
resumed to two epochs from each position of POSITIONS.  Each rank dumps its losses and final weights of every run.
"""
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _models import Classifier, classification_data, mlp  # noqa: E402

from mptrain import Trainer  # noqa: E402

out, precisions = Path(sys.argv[1]), sys.argv[2].split(",")
# mid-epoch, the last batch of epoch 0, Lightning's end-of-epoch checkpoint, mid-epoch 1, after a finished fit
POSITIONS = ("step=2", "step=4", "epoch=0", "step=6", "after_fit")


def fit(root, precision, ckpt_path=None, callbacks=(), max_epochs=2):
    torch.manual_seed(0)
    model = Classifier(mlp(dropout=0.2), lr=0.05, optimizer="sgd")
    loader = torch.utils.data.DataLoader(classification_data(n=80), batch_size=4, shuffle=True)
    trainer = Trainer(precision=precision, accumulate_grad_batches=3, accelerator="cpu", devices=2, strategy="ddp",
                      logger=False, enable_progress_bar=False, enable_model_summary=False, seed=0,
                      default_root_dir=str(root), max_epochs=max_epochs, callbacks=list(callbacks))
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    weights = trainer._checkpoint_connector.dump_checkpoint()["state_dict"]
    return trainer, torch.stack(model.losses) if model.losses else torch.empty(0), weights


for precision in precisions:  # one launch, one pair of imports, for all of them
    ckpt = out / precision / "ckpt"
    every_step = ModelCheckpoint(dirpath=ckpt, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    epoch_end = ModelCheckpoint(dirpath=ckpt, filename="{epoch}", save_top_k=-1)  # Lightning's default trigger
    trainer, straight, straight_weights = fit(out / precision / "straight", precision,
                                              callbacks=[every_step, epoch_end])
    first, _, _ = fit(out / precision / "one_epoch", precision, max_epochs=1)
    first.save_checkpoint(ckpt / "after_fit.ckpt")
    dump = {"straight": straight, "straight_weights": straight_weights, "steps": trainer.global_step}
    for position in POSITIONS:
        resumed, losses, weights = fit(out / precision / "resumed", precision, ckpt_path=str(ckpt / f"{position}.ckpt"))
        dump[position] = {"losses": losses, "weights": weights, "steps": resumed.global_step}
    torch.save(dump, out / f"resume-{precision}.rank{trainer.global_rank}.pt")
# gloo threads left to the interpreter's teardown can abort the process at exit
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
