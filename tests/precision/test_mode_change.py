"""One rule for resuming in another precision mode: allowed (with a warning naming both) unless it would round a
saved value (into 16-true, bf16-true, or bf16-sr from a mode with fp32 weights)."""
from __future__ import annotations

import warnings

import pytest
import torch
from _models import Classifier, classification_data, mlp
from lightning.pytorch.callbacks import Callback

from mptrain import PRECISIONS, Trainer

CPU_MODES = [p for p in PRECISIONS if p != "fp8-master"]  # fp8-master is refused on the CPU at setup


@pytest.mark.parametrize("saved", CPU_MODES)
@pytest.mark.parametrize("now", CPU_MODES)
def test_the_rule_for_every_pair_of_modes(saved, now):
    from mptrain.precision.mode_change import check_mode_change

    rounds = now in ("16-true", "bf16-true") or (now == "bf16-sr" and saved != "bf16-true")
    if saved == now:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_mode_change(saved, now)
    elif rounds:
        with pytest.raises(ValueError, match=f"cannot resume a '{saved}' checkpoint in '{now}'.*except into 16-true, "
                                             f"bf16-true or bf16-sr.*Resume in '{saved}'"):
            check_mode_change(saved, now)
    else:
        with pytest.warns(UserWarning, match=f"resuming a '{saved}' checkpoint in '{now}'.*carry over exactly"):
            check_mode_change(saved, now)


class _WeightsAtStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.weights = {k: v.float().clone() for k, v in trainer.lightning_module.state_dict().items()}


def _fit(root, precision, max_epochs, ckpt_path=None):
    torch.manual_seed(0)
    model = Classifier(mlp(d=8, dropout=0.2), lr=1e-2, optimizer="sgd")  # AdamW's eps underflows in fp16
    seen = _WeightsAtStart()
    trainer = Trainer(precision=precision, accelerator="cpu", max_epochs=max_epochs, logger=False, seed=0,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
                      enable_checkpointing=False, callbacks=[seen])
    trainer.fit(model, torch.utils.data.DataLoader(classification_data(n=32, d=8), batch_size=8, shuffle=True),
                ckpt_path=ckpt_path)
    return trainer, seen


@pytest.mark.parametrize("saved, now", [("bf16-master", "16-master"), ("bf16-master", "32-true"),
                                        ("bf16-master", "bf16-mixed"), ("32-true", "bf16-master"),
                                        ("bf16-true", "32-true"), ("bf16-true", "bf16-sr")])
def test_precision_change_rule_allowed_changes_warn_and_carry_the_state(tmp_path, saved, now):
    """The same rule whichever plugin class each mode has: the fp32 weights load exactly, training goes on."""
    first, _ = _fit(tmp_path, saved, max_epochs=1)
    first.save_checkpoint(tmp_path / "saved.ckpt")
    ckpt = torch.load(tmp_path / "saved.ckpt", weights_only=True)
    with pytest.warns(UserWarning, match=f"resuming a '{saved}' checkpoint in '{now}'"):
        trainer, seen = _fit(tmp_path, now, max_epochs=2, ckpt_path=str(tmp_path / "saved.ckpt"))
    assert trainer.global_step == 8
    for name, t in ckpt["state_dict"].items():
        assert torch.equal(seen.weights[name], t.float()), name


@pytest.mark.parametrize("saved, now", [("bf16-master", "bf16-true"), ("32-true", "16-true"),
                                        ("16-true", "bf16-true"), ("bf16-master", "bf16-sr")])
def test_precision_change_rule_refuses_a_change_into_half_weights(tmp_path, saved, now):
    first, _ = _fit(tmp_path, saved, max_epochs=1)
    first.save_checkpoint(tmp_path / "saved.ckpt")
    with pytest.raises(ValueError, match=f"cannot resume a '{saved}' checkpoint in '{now}'.*16-true, bf16-true or bf16-sr"):
        _fit(tmp_path, now, max_epochs=2, ckpt_path=str(tmp_path / "saved.ckpt"))
