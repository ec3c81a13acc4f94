"""The compatibility modules in the half modes (CPU): ``mptrain.Trainer(precision=p)`` and plain
``lightning.Trainer(plugins=[mptrain.MasterPrecision("bf16-master")])`` behave as
``lightning.Trainer`` in 32-true does -- same hook order, logged keys, checkpoint files --
with a finite, decreasing loss (the values differ by precision, the behaviour must not)."""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from compat_run import run

HALF_MODES = ("bf16-mixed", "bf16-master", "16-mixed", "16-master")
#: (weight dtype, output dtype) in the training step: the mode is really on, not a silent 32-true
EXPECTED_DTYPES = {"bf16-mixed": (torch.float32, torch.bfloat16), "16-mixed": (torch.float32, torch.float16),
                   "bf16-master": (torch.bfloat16, torch.bfloat16), "16-master": (torch.float16, torch.float16)}

CASES = {
    "logging_hooks_topk_lrmonitor": (
        {"scheduler": "steplr_epoch"},
        lambda root: dict(max_epochs=3, callbacks=[ModelCheckpoint(monitor="val_epoch", mode="max", save_top_k=2),
                                                   LearningRateMonitor("step")])),
    "accumulate_clip_plateau": (
        {"scheduler": "plateau"},
        lambda root: dict(max_epochs=3, accumulate_grad_batches=2, gradient_clip_val=1.0)),
}

_REFERENCE: dict = {}


def _reference(case: str, tmp_path_factory):
    """lightning.Trainer in 32-true, once per case."""
    if case not in _REFERENCE:
        _REFERENCE[case] = run(L.Trainer, tmp_path_factory.mktemp(f"ref-{case}"), *CASES[case])
    return _REFERENCE[case]


def _assert_same_behaviour(ref, ours, what: str) -> None:
    assert ours.calls == ref.calls, f"{what}: hook order differs from lightning.Trainer's"
    assert ours.seen == ref.seen, f"{what}: current_epoch/global_step inside the module differ"
    for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
        assert sorted(getattr(ours, name)) == sorted(getattr(ref, name)), f"{what}: {name} keys differ"
    assert ours.files == ref.files, f"{what}: files differ"
    assert [sorted(r) for r in ours.csv_rows] == [sorted(r) for r in ref.csv_rows], f"{what}: CSV columns differ"
    for name, ckpt in ours.checkpoints.items():
        sd = ckpt["state_dict"]
        assert sorted(sd) == sorted(ref.checkpoints[name]["state_dict"])
        assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point()), \
            f"{what}: {name} holds non-fp32 weights"
    losses = ours.losses
    assert all(math.isfinite(x) for x in losses), f"{what}: non-finite loss {losses}"
    per_epoch = len(losses) // 3
    first, last = sum(losses[:per_epoch]) / per_epoch, sum(losses[-per_epoch:]) / per_epoch
    assert last < 0.7 * first, f"{what}: loss did not decrease (first epoch {first:.4f}, last {last:.4f})"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("precision", HALF_MODES)
def test_mptrain_trainer_half_mode_behaves_as_lightning(precision, case, tmp_path, tmp_path_factory):
    import mptrain

    ref = _reference(case, tmp_path_factory)
    ours = run(mptrain.Trainer, tmp_path, *CASES[case], precision=precision)
    _assert_same_behaviour(ref, ours, f"mptrain.Trainer(precision={precision!r})")
    assert ours.dtypes == EXPECTED_DTYPES[precision]


@pytest.mark.parametrize("case", list(CASES))
def test_lightning_trainer_takes_the_master_plugin(case, tmp_path, tmp_path_factory):
    import mptrain

    ref = _reference(case, tmp_path_factory)
    ours = run(L.Trainer, tmp_path, *CASES[case], plugins=[mptrain.MasterPrecision("bf16-master")])
    _assert_same_behaviour(ref, ours, "lightning.Trainer(plugins=[MasterPrecision('bf16-master')])")
    assert ours.dtypes == EXPECTED_DTYPES["bf16-master"]


def _weight_change(observed, initial: dict) -> float:
    """Total L2 change of the fp32 weights in the run's last checkpoint (the masters in *-master)."""
    (last,) = [c for c in observed.checkpoints.values()]
    sd = last["state_dict"]
    return sum(float((sd[k].float() - v.float()).norm()) for k, v in initial.items() if v.is_floating_point())


@pytest.mark.parametrize("precision", ["16-master", "16-mixed", "bf16-master"])
def test_clipping_acts_on_unscaled_gradients(precision, tmp_path):
    """gradient_clip_val clips the true gradients: the weights move as far as in 32-true. Clipping
    the loss-scaled gradients would shrink every step by the scale (2**8 here: low enough that no
    step overflows and is skipped, which would also shorten the distance)."""
    import mptrain
    from compat_modules import CompatModule
    from compat_run import SEED

    L.seed_everything(SEED, workers=True)
    initial = {k: v.clone() for k, v in CompatModule().state_dict().items()}
    kwargs = lambda root: dict(max_steps=8, gradient_clip_val=0.01, limit_val_batches=1)  # noqa: E731
    ref = run(L.Trainer, tmp_path / "ref", {"scheduler": "steplr_epoch"}, kwargs)
    ours = run(mptrain.Trainer, tmp_path / "ours", {"scheduler": "steplr_epoch"}, kwargs, precision=precision,
               loss_scaler={"init_scale": 2.0**8} if precision.startswith("16") else None)
    moved_ref, moved = _weight_change(ref, initial), _weight_change(ours, initial)
    assert moved_ref > 0 and 0.5 < moved / moved_ref < 2.0, (moved, moved_ref)
