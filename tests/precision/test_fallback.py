"""fp32 fallback: exact for direct functional calls; module policy; automatic promotion."""
from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _plain_lightning import trainer
from mptrain.precision import build_precision, precision_plugin
from mptrain.precision.fallback import DEFAULT_FP32_OPS, Fp32Fallback, resolve_op_list


class Probe(L.LightningModule):
    """Calls the listed ops directly inside training_step and records what they returned."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 12)
        self.seen = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        h = self.lin(x) * 30.0  # large logits: bf16 softmax differs visibly from fp32
        self.seen.append(("softmax", h.detach(), F.softmax(h, -1).detach()))
        self.seen.append(("log_softmax", h.detach(), torch.log_softmax(h, dim=-1).detach()))
        self.seen.append(("layer_norm", h.detach(), h.layer_norm((12,)).detach() if hasattr(h, "layer_norm") else F.layer_norm(h, (12,)).detach()))
        return F.softmax(h, -1).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


REF = {
    "softmax": lambda h: torch.softmax(h.float(), -1).to(h.dtype),
    "log_softmax": lambda h: torch.log_softmax(h.float(), -1).to(h.dtype),
    "layer_norm": lambda h: F.layer_norm(h.float(), (12,)).to(h.dtype),
}


@pytest.mark.parametrize("precision", ["bf16-master", "16-master", "bf16-true", "bf16-mixed"])
def test_direct_functional_calls_are_exact(precision):
    torch.manual_seed(0)
    model = Probe()
    ds = torch.utils.data.TensorDataset(torch.randn(32, 12))
    trainer(precision_plugin(precision), max_steps=2).fit(model, torch.utils.data.DataLoader(ds, batch_size=16))
    assert len(model.seen) == 6
    for name, h, out in model.seen:
        assert h.dtype in (torch.bfloat16, torch.float16)
        assert out.dtype == h.dtype, name
        assert torch.equal(out, REF[name](h)), name


@pytest.mark.parametrize("autocast", [True, False])
def test_listed_ops_compile_fullgraph_with_the_fallback_on(autocast):
    """Dynamo traces the mode's handler (its compiling branch under autocast) in one graph, same results."""
    def f(x, w):
        return F.layer_norm(torch.softmax(x @ w, -1), (8,))

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    if not autocast:
        x, w = x.bfloat16(), w.bfloat16()
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), Fp32Fallback("default").context():
        out, ref = compiled(x, w), f(x, w)
    assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)


def test_autocast_is_back_on_after_a_listed_call():
    """The listed op runs with autocast off; the next unlisted op is autocast's again (bf16 matmul)."""
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Fallback("default").context():
        h = x @ w
        p = torch.softmax(h, -1)
        after = p @ w
    assert h.dtype == p.dtype == after.dtype == torch.bfloat16
    assert torch.equal(p, torch.softmax(h.float(), -1).bfloat16())


def test_fallback_off_is_really_off():
    prec = build_precision("bf16-true", fp32_fallback=[])
    assert prec.fallback.ops == ()
    prec.fallback = Fp32Fallback([], cpu_rnn=False)  # the CPU RNN policy (tested below) would wrap torch.lstm
    with prec.forward_context():
        assert torch.softmax is _TORCH_SOFTMAX
    on = build_precision("bf16-true")
    with on.forward_context():  # the listed ops' callables are wrapped; no TorchFunctionMode
        assert torch.softmax is not _TORCH_SOFTMAX and not torch._C._is_torch_function_mode_enabled()
    assert torch.softmax is _TORCH_SOFTMAX
    # an op not in the list is passed through untouched (same dtype, same kernel)
    h = torch.randn(8, 8).bfloat16()
    with build_precision("bf16-true", fp32_fallback=["softmax"]).forward_context():
        out = torch.tanh(h)
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.tanh(h))


_TORCH_SOFTMAX, _F_SOFTMAX, _F_CROSS_ENTROPY = torch.softmax, F.softmax, F.cross_entropy  # bound at import


def _every_spelling(h, target, ln):
    """What each spelling of a listed op returns for half ``h`` (the from-imports are bound before any forward);
    ``ln`` comes in ``h``'s dtype (cast outside: torch 2.6's dynamo cannot trace ``Module.to``)."""
    return {
        "F.softmax": F.softmax(h, -1), "torch.softmax": torch.softmax(h, -1), "Tensor.softmax": h.softmax(-1),
        "from-imported F.softmax": _F_SOFTMAX(h, -1), "F.log_softmax": F.log_softmax(h, dim=-1),
        "torch.logsumexp": torch.logsumexp(h, -1), "nn.LayerNorm": ln(h),
        "torch.layer_norm": torch.layer_norm(h, (12,)), "F.cross_entropy": F.cross_entropy(h, target),
        "from-imported F.cross_entropy": _F_CROSS_ENTROPY(h, target), "F.mse_loss": F.mse_loss(h, h.flip(0)),
    }


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_every_spelling_of_a_listed_op_computes_in_fp32(compiled):
    """Every spelling, bound before the forward or not, in eager mode and in a graph dynamo traced."""
    torch.manual_seed(0)
    h, target = (torch.randn(16, 12) * 30).bfloat16(), torch.randint(0, 12, (16,))
    ln = nn.LayerNorm(12)
    ref = {k: v.float() for k, v in _every_spelling(h.float(), target, ln).items()}
    ln.bfloat16()  # in place: the half runs below get a bf16 LayerNorm
    plain = _every_spelling(h, target, ln)
    run = torch.compile(_every_spelling, backend="aot_eager", fullgraph=True) if compiled else _every_spelling
    with Fp32Fallback("default", cpu_rnn=False).context():
        got = run(h, target, ln)
    assert not all(torch.equal(plain[k].float(), ref[k].to(plain[k].dtype).float()) for k in ref)  # bf16 visibly differs
    for k, out in got.items():
        assert out.dtype == torch.bfloat16, k
        assert torch.equal(out, ref[k].bfloat16()), k


def test_wrapped_ops_act_only_in_the_thread_inside_the_context():
    import threading

    h = (torch.randn(16, 12) * 30).bfloat16()
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def other():
        inside.wait(30)
        seen["other"] = F.log_softmax(h, -1)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with Fp32Fallback(["log_softmax"], cpu_rnn=False).context():
        inside.set()
        done.wait(30)
        seen["this"] = F.log_softmax(h, -1)
    t.join()
    assert torch.equal(seen["this"], torch.log_softmax(h.float(), -1).bfloat16())
    assert torch.equal(seen["other"], torch.log_softmax(h, -1))  # torch's own bf16 kernel
    assert not torch.equal(seen["this"], seen["other"])


def test_wrapped_callables_are_restored_after_nesting_and_errors():
    before = {(owner, name): vars(owner).get(name) for owner in (F, torch, torch.Tensor, torch._C._nn, torch._VF)
              for name in ("softmax", "layer_norm", "cross_entropy_loss", "lstm")}
    a, b = Fp32Fallback("default", cpu_rnn=True), Fp32Fallback(["softmax"], cpu_rnn=False)
    with pytest.raises(RuntimeError, match="boom"):
        with a.context():
            with b.context(), a.context():
                assert torch.softmax is not _TORCH_SOFTMAX
            assert torch.softmax is not _TORCH_SOFTMAX  # a is still open
            raise RuntimeError("boom")
    after = {key: vars(key[0]).get(key[1]) for key in before}
    assert after == before and "softmax" not in vars(torch.Tensor) and "lstm" not in vars(torch._VF)


def test_direct_torch_batch_norm_keeps_its_argument_order():
    x = (torch.randn(64, 4) * 3 + 5).bfloat16()
    w, b, rm, rv = torch.rand(4).bfloat16() + 0.5, torch.randn(4).bfloat16(), torch.zeros(4), torch.ones(4)
    with Fp32Fallback(["batch_norm"], cpu_rnn=False).context():
        y = torch.batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5, False)
    ref = torch.batch_norm(x.float(), w.float(), b.float(), torch.zeros(4), torch.ones(4), True, 0.1, 1e-5, False)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref.bfloat16())
    assert rm.abs().sum() > 0.1  # the running stats reached the caller's buffers


def test_op_list_is_configurable_and_checked():
    assert resolve_op_list("default") == DEFAULT_FP32_OPS
    assert resolve_op_list(["softmax"]) == ("softmax",)
    assert "softmax" not in resolve_op_list(["-softmax"]) and "layer_norm" in resolve_op_list(["-softmax"])
    with pytest.raises(ValueError, match="unknown op 'softmaxx'"):
        resolve_op_list(["softmaxx"])


def test_batch_norm_running_stats_update_in_half_true_mode():
    prec = build_precision("bf16-true")
    bn = prec.convert_module(nn.BatchNorm1d(4))
    x = (torch.randn(64, 4) * 3 + 5).bfloat16()
    with prec.forward_context():
        y = bn(x)
    assert y.dtype == torch.bfloat16
    assert bn.running_mean.abs().sum() > 0.1  # the in-place update reached the real buffer


def test_bf16_on_a_gpu_without_bf16_raises_before_training(monkeypatch):
    import mptrain.precision as mp

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    with pytest.raises(RuntimeError, match="bf16-master.*Tesla T4.*7.5.*16-master"):
        mp.build_precision("bf16-master", device="cuda")
    with pytest.raises(ValueError, match="Valid values: 32-true, 16-mixed"):
        mp.build_precision("fp16")
    mp.build_precision("16-master", device="cuda")  # fp16 is fine there


@pytest.mark.parametrize("precision", ["bf16-master", "bf16-true", "bf16-mixed"])
def test_lstm_runs_in_fp32_on_a_cpu_without_native_bf16(precision, monkeypatch, caplog):
    """torch's oneDNN bf16 LSTM crashes there; the policy computes it in fp32."""
    import copy

    import mptrain.precision.fallback as fb

    monkeypatch.setattr(fb, "cpu_lacks_native_bf16", lambda: True)
    fb._say_cpu_rnn_policy.cache_clear()
    torch.manual_seed(0)
    model = nn.ModuleDict({"lstm": nn.LSTM(6, 5, batch_first=True), "cell": nn.LSTMCell(6, 5)})
    plugin = precision_plugin(precision)
    assert plugin.fallback.cpu_rnn
    if precision != "bf16-mixed":
        model = plugin.convert_module(model)
    else:  # autocast would run the LSTM in bf16: the policy keeps it fp32; compare on bf16-valued weights
        model = model.bfloat16().float()
    x = torch.randn(2, 3, 6).bfloat16()
    with caplog.at_level(logging.WARNING, logger="mptrain"):
        for _ in range(2):  # said once per process, however often entered
            with plugin.forward_context():
                out, _ = model["lstm"](x)
                h, _ = model["cell"](x[:, 0])
    assert out.dtype == torch.bfloat16 and h.dtype == torch.bfloat16
    ref = copy.deepcopy(model).float()  # the same (bf16-valued) weights, computed in fp32
    assert torch.equal(out, ref["lstm"](x.float())[0].bfloat16())
    assert torch.equal(h, ref["cell"](x[:, 0].float())[0].bfloat16())
    if precision != "bf16-mixed":  # without the policy the half kernel runs and rounds differently
        plugin.fallback = Fp32Fallback(plugin.fallback.ops, cpu_rnn=False)
        with plugin.forward_context():
            assert not torch.equal(model["lstm"](x)[0], out)
    lines = [r.getMessage() for r in caplog.records if "no native bf16" in r.getMessage()]
    assert len(lines) == 1 and "LSTM" in lines[0]


def test_lstm_on_fp32_input_under_cpu_autocast_runs_in_fp32(monkeypatch):
    """bf16-mixed on the CPU: the LSTM gets fp32 activations (an embedding's output) and autocast would lower
    it to oneDNN's bf16 LSTM itself (the lstm_lm recipe crashed so on an AVX2-only CPU): the policy runs it
    in fp32, bitwise the call without autocast."""
    import mptrain.precision.fallback as fb

    monkeypatch.setattr(fb, "cpu_lacks_native_bf16", lambda: True)
    torch.manual_seed(0)
    lstm, cell = nn.LSTM(6, 5, num_layers=2, batch_first=True), nn.LSTMCell(6, 5)
    plugin = precision_plugin("bf16-mixed")
    x = torch.randn(2, 3, 6)
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu")
        out, h = lstm(x)[0], cell(x[:, 0])[0]
    assert out.dtype == torch.float32 and h.dtype == torch.float32
    assert torch.equal(out, lstm(x)[0]) and torch.equal(h, cell(x[:, 0])[0])


def test_lstm_is_left_alone_where_the_cpu_has_native_bf16():
    fallback = Fp32Fallback("default", cpu_rnn=False)
    assert "lstm" not in fallback.names and "lstm_cell" not in fallback.names
