"""DynamicLossScaler: the state machine of DESIGN §3, alone and inside the Trainer."""
from __future__ import annotations

import pytest
import torch

from _models import Classifier, classification_data, mlp, quiet_trainer
from mptrain import DynamicLossScaler, NonFiniteError


def expected_trace(flags, init, growth, backoff, interval, hysteresis, min_scale, max_scale):
    """DESIGN §3 written out plainly, as an independent oracle."""
    scale, hyst, clean, skipped, out = init, hysteresis, 0, 0, []
    for inf in flags:
        if inf:
            skipped += 1
            clean = 0
            hyst -= 1
            if hyst <= 0:
                hyst = 0
                scale = max(scale * backoff, min_scale)
        else:
            clean += 1
            if clean == interval:
                scale = min(scale * growth, max_scale)
                clean = 0
                hyst = hysteresis
        out.append((scale, hyst, skipped))
    return out


def test_unit_state_machine_matches_design():
    cfg = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2,
               min_scale=64.0, max_scale=4096.0)
    s = DynamicLossScaler(**cfg)
    flags = [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0]
    want = expected_trace(flags, cfg["init_scale"], cfg["growth_factor"], cfg["backoff_factor"],
                          cfg["growth_interval"], cfg["hysteresis"], cfg["min_scale"], cfg["max_scale"])
    got = []
    for f in flags:
        s.update(torch.tensor([float(f)]))
        got.append((s.scale, s.hysteresis_left, int(s._total_skips)))
    assert got == want
    assert max(g[0] for g in got) == 4096.0 and min(g[0] for g in got) == 64.0


def test_nan_counts_as_overflow_and_state_round_trips():
    s = DynamicLossScaler(init_scale=8.0, hysteresis=1)
    s.update(torch.tensor([1.0]))
    assert s.scale == 4.0
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.scale == 4.0 and int(t._total_skips) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=2.0)
    with pytest.raises(ValueError, match="init_scale"):
        DynamicLossScaler(init_scale=1.0, min_scale=2.0)
    with pytest.raises(ValueError, match="unknown key"):
        DynamicLossScaler.from_spec({"init": 3})


def _loader(n=256, bs=16):
    return torch.utils.data.DataLoader(classification_data(n=n), batch_size=bs, shuffle=False)


class Recorder:
    """Params (and masters) before / after every step, and the scaler state after it."""

    def __init__(self):
        self.before, self.after, self.trace = {}, {}, []

    def _snap(self, trainer, module):
        snap = [p.detach().clone() for p in module.parameters()]
        prec = trainer._precision
        if getattr(prec, "masters", None):
            snap += [m.detach().clone() for m in prec.masters]
        return snap

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before[trainer.global_step] = self._snap(trainer, module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        s = trainer.loss_scaler
        self.after[trainer.global_step - 1] = self._snap(trainer, module)
        self.trace.append((s.scale, s.hysteresis_left, trainer.skipped_steps))


@pytest.mark.parametrize("precision", ["16-mixed", "16-master"])
def test_inf_injection_skips_bit_exactly_and_scaler_follows_design(precision):
    cfg = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2,
               min_scale=1.0, max_scale=2.0**24)
    inf_steps = {2, 3, 9}
    torch.manual_seed(0)
    model = Classifier(mlp(), inf_at_steps=inf_steps)
    rec = Recorder()
    trainer = quiet_trainer(precision=precision, max_steps=14, loss_scaler=cfg, callbacks=[rec])
    trainer.fit(model, _loader())
    for k in inf_steps:
        for a, b in zip(rec.before[k], rec.after[k]):
            assert torch.equal(a, b), f"step {k} was not skipped bit-exactly"
    for k in (0, 4):  # clean steps do change the weights
        assert any(not torch.equal(a, b) for a, b in zip(rec.before[k], rec.after[k]))
    flags = [int(i in inf_steps) for i in range(14)]
    want = expected_trace(flags, cfg["init_scale"], cfg["growth_factor"], cfg["backoff_factor"], cfg["growth_interval"],
                          cfg["hysteresis"], cfg["min_scale"], cfg["max_scale"])
    assert rec.trace == want
    assert trainer.skipped_steps == 3 and trainer.global_step == 14


@pytest.mark.parametrize("precision", ["16-mixed", "16-master"])
def test_persistent_overflow_ends_in_nonfinite_error(precision):
    torch.manual_seed(0)
    model = Classifier(mlp(), inf_at_steps=set(range(1000)))
    cfg = dict(init_scale=16.0, hysteresis=1, min_scale=2.0, max_consecutive_skips=6)
    rec = Recorder()
    trainer = quiet_trainer(precision=precision, max_steps=50, loss_scaler=cfg, callbacks=[rec])
    with pytest.raises(NonFiniteError) as err:
        trainer.fit(model, _loader())
    msg = str(err.value)
    assert "step 6" in msg and "loss scale 2" in msg and "net." in msg
    assert trainer.global_step == 6
    assert [t[0] for t in rec.trace] == [8.0, 4.0, 2.0, 2.0, 2.0]  # never below min_scale


def test_bf16_has_no_scaler_unless_asked():
    model = Classifier(mlp())
    t = quiet_trainer(precision="bf16-master", max_steps=1)
    t.fit(model, _loader())
    assert t.loss_scaler is None
    t2 = quiet_trainer(precision="bf16-master", max_steps=1, loss_scaler={"init_scale": 256.0})
    t2.fit(Classifier(mlp()), _loader())
    assert t2.loss_scaler is not None and t2.loss_scaler.scale == 256.0
