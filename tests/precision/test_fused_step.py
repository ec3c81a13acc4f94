"""torch's fused Adam/AdamW/SGD under the ``*-master`` modes step through mptrain's master-weight kernel: no fp32
grad set, the same update as the generic path, torch's state format, LR schedulers made before still work."""
from __future__ import annotations

import warnings

import pytest
import torch

from _models import Classifier, classification_data, mlp, quiet_trainer
from mptrain.optim import FusedAdamW, FusedSGD
from mptrain.precision import MasterPrecision
from mptrain.precision.fused_step import fused_counterpart


class Model(Classifier):
    def __init__(self, make_opt, schedule=False):
        torch.manual_seed(0)
        super().__init__(mlp())
        self.make_opt, self.schedule = make_opt, schedule

    def configure_optimizers(self):
        opt = self.make_opt(self.parameters())
        if not self.schedule:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
                                                 "interval": "step"}}


def _fit(make_opt, fused="auto", steps=6, **kw):
    model = Model(make_opt, **kw)
    plugin = MasterPrecision("bf16-master", fused=fused)
    trainer = quiet_trainer(plugins=[plugin], max_steps=steps)
    loader = torch.utils.data.DataLoader(classification_data(128), batch_size=32)
    trainer.fit(model, loader)
    return model, plugin, trainer


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def test_fused_adamw_is_taken_over_and_matches_the_generic_path():
    model, plugin, trainer = _fit(adamw)
    opt = trainer.optimizers[0]
    assert type(opt) is FusedAdamW and opt.master_weights
    assert not plugin._master_of  # no swapped-in fp32 Parameters ...
    assert any(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(p.grad is None or p.grad.dtype == p.dtype for p in model.parameters())  # ... nor fp32 grads
    ref, ref_plugin, _ = _fit(adamw, fused=False)  # fused=False: the generic path with torch's own step
    assert ref_plugin._master_of
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.allclose(torch.stack(model.losses), torch.stack(ref.losses), rtol=1e-3)


def test_state_dict_loads_into_torchs_class():
    model, _, trainer = _fit(adamw, steps=2)
    sd = trainer.optimizers[0].state_dict()
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(next(iter(sd["state"].values())))
    fresh = torch.optim.AdamW(Model(adamw).parameters(), lr=1e-2, fused=True)
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["weight_decay"] == 0.1


def test_scheduler_made_before_sees_the_steps():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, trainer = _fit(adamw, steps=4, schedule=True)
    assert not [w for w in caught if "lr_scheduler" in str(w.message) or "overridden" in str(w.message)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)


def test_sgd_is_taken_over():
    _, _, trainer = _fit(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True))
    assert type(trainer.optimizers[0]) is FusedSGD


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p, lr=1e-2),  # not fused: the user chose torch's foreach step
    lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, fused=True),
    lambda p: torch.optim.RMSprop(p, lr=1e-2),
])
def test_others_keep_the_generic_path(make_opt):
    _, plugin, trainer = _fit(make_opt, steps=2)
    assert not isinstance(trainer.optimizers[0], (FusedAdamW, FusedSGD)) and plugin._master_of


def test_hooks_or_state_keep_the_generic_path():
    opt = adamw(mlp().parameters())
    opt.register_step_post_hook(lambda *a: None)
    assert fused_counterpart(opt) is None
    opt = adamw(mlp().parameters())
    assert fused_counterpart(opt) is FusedAdamW
    opt.state[opt.param_groups[0]["params"][0]]["step"] = torch.zeros(())
    assert fused_counterpart(opt) is None


def test_resume_from_a_checkpoint(tmp_path):
    model, _, trainer = _fit(adamw, steps=3)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    again = Model(adamw)
    t2 = quiet_trainer(plugins=[MasterPrecision("bf16-master")], max_steps=5)
    t2.fit(again, torch.utils.data.DataLoader(classification_data(128), batch_size=32), ckpt_path=tmp_path / "a.ckpt")
    assert t2.global_step == 5 and type(t2.optimizers[0]) is FusedAdamW


@pytest.mark.parametrize("mode", ["bf16-master", "bf16-sr"])
def test_the_consumed_grads_go_at_the_step_not_after_the_next_forward(mode):
    """Lightning zero_grads after the next training_step: the fused step's half grads are gone before it (they
    would sit through its forward's peak), while an accumulation window's first micro-batch keeps them for the next."""
    import lightning as L

    from mptrain.precision.sr import StochasticRoundingPrecision

    seen = []

    class Grads(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(sum(p.grad is not None for p in pl_module.parameters()))

    model = Model(adamw)
    plugin = MasterPrecision(mode) if mode == "bf16-master" else StochasticRoundingPrecision(mode, seed=0)
    trainer = quiet_trainer(plugins=[plugin], max_steps=3, accumulate_grad_batches=2, callbacks=[Grads()])
    trainer.fit(model, torch.utils.data.DataLoader(classification_data(256), batch_size=32))
    assert isinstance(trainer.optimizers[0], FusedAdamW)
    n = sum(1 for _ in model.parameters())
    assert seen == [0, n, 0, n, 0, n], seen  # after each step: none; inside a window: the first micro-batch's
