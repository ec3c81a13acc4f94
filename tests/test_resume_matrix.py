"""Resume is bitwise from every checkpoint position of a 3-epoch run, on the CPU.

The uninterrupted run (dropout, shuffle, AdamW) writes a checkpoint at every optimizer step (mid-epoch, and on each
epoch's last batch) and Lightning's default one at each epoch's end; short runs write one after ``fit`` returned.  A
new Trainer resumed from each must end at the same global step with the same losses, batch for batch, and the same
fp32 weights and optimizer state.  ``bf16-master`` accumulates 2 batches over 5-batch epochs: the window does not
divide the epoch.
"""
from __future__ import annotations

import pytest
import torch
from _models import Classifier, classification_data, mlp
from lightning.pytorch.callbacks import ModelCheckpoint

from mptrain import Trainer

BATCHES, EPOCHS = 5, 3
CONFIGS = {"32-true": 1, "bf16-master": 2}  # precision -> accumulate_grad_batches


def _step_batches(accumulate: int) -> list[int]:
    """For each optimizer step, how many batches the run had trained when it stepped."""
    return [epoch * BATCHES + b for epoch in range(EPOCHS) for b in range(1, BATCHES + 1)
            if b % accumulate == 0 or b == BATCHES]


def _positions(precision: str) -> list[tuple[str, int]]:
    """(checkpoint file stem, batches trained before it) for every position."""
    steps = [(f"step={s}", b) for s, b in enumerate(_step_batches(CONFIGS[precision]), 1)]
    epoch_ends = [(f"epoch={e}", (e + 1) * BATCHES) for e in range(EPOCHS)]
    return steps + epoch_ends + [(f"after_fit={e}", e * BATCHES) for e in range(1, EPOCHS)]


def _fit(root, precision, ckpt_path=None, callbacks=(), max_epochs=EPOCHS):
    torch.manual_seed(0)
    model = Classifier(mlp(d=8, dropout=0.2), lr=1e-2)
    loader = torch.utils.data.DataLoader(classification_data(n=8 * BATCHES, d=8), batch_size=8, shuffle=True)
    trainer = Trainer(precision=precision, accumulate_grad_batches=CONFIGS[precision], accelerator="cpu", devices=1,
                      max_epochs=max_epochs, seed=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(root), callbacks=list(callbacks),
                      enable_checkpointing=bool(callbacks))
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    trainer.save_checkpoint(root / "end.ckpt")
    return trainer, torch.stack(model.losses) if model.losses else torch.empty(0), torch.load(root / "end.ckpt",
                                                                                                weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """precision -> (the uninterrupted run's losses and end checkpoint, the folder of every position's checkpoint),
    each run once per module."""
    runs = {}

    def get(precision):
        if precision not in runs:
            root = tmp_path_factory.mktemp(f"straight-{precision}")
            every_step = ModelCheckpoint(dirpath=root / "positions", filename="{step}", every_n_train_steps=1,
                                         save_top_k=-1)
            epoch_end = ModelCheckpoint(dirpath=root / "positions", filename="{epoch}", save_top_k=-1)
            trainer, losses, end = _fit(root, precision, callbacks=[every_step, epoch_end])
            assert trainer.global_step == len(_step_batches(CONFIGS[precision])) and len(losses) == EPOCHS * BATCHES
            for epochs in range(1, EPOCHS):
                short = tmp_path_factory.mktemp(f"after-fit-{precision}")
                _fit(short, precision, max_epochs=epochs)[0].save_checkpoint(root / "positions" /
                                                                             f"after_fit={epochs}.ckpt")
            runs[precision] = (losses, end, root / "positions")
        return runs[precision]

    return get


@pytest.mark.parametrize("precision, position, trained", [(p, *pos) for p in CONFIGS for pos in _positions(p)])
def test_resume_from_every_position_is_bitwise(tmp_path, reference, precision, position, trained):
    losses, end, folder = reference(precision)
    trainer, rest, resumed = _fit(tmp_path, precision, ckpt_path=str(folder / f"{position}.ckpt"))
    assert trainer.global_step == end["global_step"], f"ended at step {trainer.global_step}, not {end['global_step']}"
    assert len(rest) == len(losses) - trained, f"trained {len(rest)} batches, not {len(losses) - trained}"
    assert torch.equal(rest, losses[trained:]), "other losses than the uninterrupted run"
    for name, t in end["state_dict"].items():
        assert t.dtype == torch.float32 and torch.equal(t, resumed["state_dict"][name]), name
    for a, b in zip(end["optimizer_states"][0]["state"].values(), resumed["optimizer_states"][0]["state"].values()):
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key
