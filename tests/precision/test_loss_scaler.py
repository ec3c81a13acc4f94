"""DynamicLossScaler: the state machine of DESIGN §3, alone and inside plain lightning.Trainer."""
from __future__ import annotations

import pytest
import torch

from _models import Classifier, mlp
from _plain_lightning import StepRecorder, loader, trainer
from mptrain.precision import DynamicLossScaler, NonFiniteError, precision_plugin


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
        got.append((s.scale, s.hysteresis_left))
    assert got == [w[:2] for w in want]
    assert max(g[0] for g in got) == 4096.0 and min(g[0] for g in got) == 64.0


def test_nan_counts_as_overflow_and_state_round_trips_with_its_configuration():
    s = DynamicLossScaler(init_scale=8.0, hysteresis=1, growth_interval=7, backoff_factor=0.25, min_scale=0.5,
                          max_scale=2.0**10, growth_factor=4.0, max_consecutive_skips=9)
    s.update(torch.tensor([float("nan")]))
    assert s.scale == 2.0
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.scale == 2.0 and t.hysteresis_left == s.hysteresis_left == 0
    for key in ("growth_interval", "hysteresis", "backoff_factor", "min_scale", "max_scale", "growth_factor",
                "max_consecutive_skips"):
        assert getattr(t, key) == getattr(s, key), key
    assert t._init_scale == 8.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=2.0)
    with pytest.raises(ValueError, match="init_scale"):
        DynamicLossScaler(init_scale=1.0, min_scale=2.0)
    with pytest.raises(ValueError, match="unknown key"):
        DynamicLossScaler.from_spec({"init": 3})


@pytest.mark.parametrize("name", ["16-mixed", "16-master"])
def test_inf_injection_skips_bit_exactly_and_scaler_follows_design(name):
    cfg = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2,
               min_scale=1.0, max_scale=2.0**24)
    inf_steps = {2, 3, 9}
    torch.manual_seed(0)
    model = Classifier(mlp(), inf_at_steps=inf_steps)
    rec = StepRecorder()
    plugin = precision_plugin(name, loss_scaler=cfg)
    t = trainer(plugin, max_steps=14, callbacks=[rec])
    t.fit(model, loader(n=256, bs=16))
    for k in inf_steps:
        assert rec.unchanged(k), f"step {k} was not skipped bit-exactly"
    assert not rec.unchanged(0) and not rec.unchanged(4)
    flags = [int(i in inf_steps) for i in range(14)]
    want = expected_trace(flags, cfg["init_scale"], cfg["growth_factor"], cfg["backoff_factor"],
                          cfg["growth_interval"], cfg["hysteresis"], cfg["min_scale"], cfg["max_scale"])
    assert rec.trace == want
    assert plugin.skipped_steps == 3 and t.global_step == 14


@pytest.mark.parametrize("name", ["16-mixed", "16-master"])
def test_persistent_overflow_ends_in_nonfinite_error(name):
    torch.manual_seed(0)
    model = Classifier(mlp(), inf_at_steps=set(range(1000)))
    cfg = dict(init_scale=16.0, hysteresis=1, min_scale=2.0, max_consecutive_skips=6)
    rec = StepRecorder()
    plugin = precision_plugin(name, loss_scaler=cfg)
    with pytest.raises(NonFiniteError) as err:
        trainer(plugin, max_steps=50, callbacks=[rec]).fit(model, loader(n=256, bs=16))
    msg = str(err.value)
    assert "6 optimizer steps in a row" in msg and "step 5" in msg and "loss scale 2" in msg
    assert "'net.0.weight'" in msg
    assert [t[0] for t in rec.trace] == [8.0, 4.0, 2.0, 2.0, 2.0]  # never below min_scale


def test_bf16_has_no_scaler_unless_asked():
    t = trainer(precision_plugin("bf16-master"), max_steps=1)
    t.fit(Classifier(mlp()), loader())
    assert t.precision_plugin.loss_scaler is None
    t2 = trainer(precision_plugin("bf16-master", loss_scaler={"init_scale": 256.0}), max_steps=1)
    t2.fit(Classifier(mlp()), loader())
    assert t2.precision_plugin.loss_scaler.scale == 256.0
