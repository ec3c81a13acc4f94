"""The attention back-end priority: parsing, resolution per device, the context around every forward."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

import mptrain
from mptrain.precision import sdpa_backend as S
from mptrain.precision.factory import precision_plugin

ORDER = torch._C._get_sdp_priority_order  # torch's priority list (ints of SDPBackend), read-only here


def _names(order):
    by_int = {int(b): n for n, b in S.BACKENDS.items()}
    return [by_int[i] for i in order if i in by_int]


@pytest.mark.parametrize("value,want", [("auto", "auto"), ("torch", "torch"), (["flash"], ("flash",)),
                                        (("cudnn", "math"), ("cudnn", "math")), ("flash", ("flash",))])
def test_parse_accepts(value, want):
    assert S.parse_sdpa(value) == want


@pytest.mark.parametrize("value", ["fast", [], ["flash", "flash"], ["fa3"], [1], None, 3])
def test_parse_refuses_naming_the_value_and_the_valid_ones(value):
    with pytest.raises(ValueError, match=r"sdpa=.*'auto'.*'torch'.*'cudnn', 'flash', 'efficient', 'math'"):
        S.parse_sdpa(value)


def test_resolve(monkeypatch):
    assert S.resolve("auto", torch.device("cpu")) is None
    assert S.resolve(("flash",), torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert S.resolve("auto", cuda) == S.MEASURED_ORDER[9]
    assert S.resolve("torch", cuda) is None
    assert S.resolve(("efficient", "flash"), cuda) == ("efficient", "flash")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert S.resolve("auto", cuda) == S.MEASURED_ORDER.get(7)


def test_priority_context_puts_the_order_first_and_restores_everything():
    before = ORDER()
    flags = [f() for f in S._ENABLED.values()]
    with S.priority_context(("efficient", "cudnn")):
        assert _names(ORDER())[:2] == ["efficient", "cudnn"]
        assert sorted(_names(ORDER())) == sorted(S.BACKENDS)  # the rest still follow
        assert [f() for f in S._ENABLED.values()] == flags  # nothing switched on or off
    assert ORDER() == before and [f() for f in S._ENABLED.values()] == flags
    with S.priority_context(None):
        assert ORDER() == before


def test_a_back_end_the_user_switched_off_stays_off():
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        with S.priority_context(("flash", "cudnn")):
            assert not torch.backends.cuda.flash_sdp_enabled()
            assert torch.backends.cuda.cudnn_sdp_enabled() == S._ENABLED["cudnn"]()
        assert not torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cuda.enable_flash_sdp(True)


@pytest.mark.parametrize("mode", ["bf16-master", "bf16-mixed", "bf16-true", "32-true", "bf16-sr"])
def test_every_plugin_applies_the_order_around_the_forward(monkeypatch, mode):
    plugin = precision_plugin(mode, sdpa=["efficient", "cudnn"])
    plugin.convert_module(torch.nn.Linear(2, 2))
    monkeypatch.setattr(type(plugin), "_device", lambda self: torch.device("cuda", 0))
    before = ORDER()
    with plugin.forward_context():
        assert _names(ORDER())[:2] == ["efficient", "cudnn"]
    assert ORDER() == before
    off = precision_plugin(mode, sdpa="torch")
    off.convert_module(torch.nn.Linear(2, 2))
    monkeypatch.setattr(type(off), "_device", lambda self: torch.device("cuda", 0))
    with off.forward_context():
        assert ORDER() == before


def test_cpu_forward_is_untouched_and_attention_still_runs():
    plugin = precision_plugin("bf16-master")
    plugin.convert_module(torch.nn.Linear(2, 2))
    before = ORDER()
    q = torch.randn(2, 3, 8, 16, dtype=torch.bfloat16)
    with plugin.forward_context():
        assert ORDER() == before
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.shape == q.shape


def test_trainer_argument_reaches_the_plugin_and_is_checked():
    t = mptrain.Trainer(precision="bf16-master", sdpa=["flash"], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    assert t.precision_plugin.sdpa == ("flash",)
    with pytest.raises(ValueError, match="sdpa='fast'"):
        mptrain.Trainer(precision="bf16-master", sdpa="fast")
    with pytest.raises(ValueError, match="sdpa='torch' would be ignored"):
        mptrain.Trainer(plugins=[mptrain.MasterPrecision("bf16-master")], sdpa="torch")


def test_backend_names_cover_torch_backends():
    assert set(S.BACKENDS.values()) <= set(SDPBackend.__members__.values())
    assert all(set(order) == set(S.BACKENDS) for order in S.MEASURED_ORDER.values())
