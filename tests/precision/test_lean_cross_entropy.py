"""The fallback's block-wise cross_entropy: bitwise the plain fp32 computation, a fraction of its memory."""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mptrain.precision import MasterPrecision, lean_cross_entropy
from mptrain.precision.fallback import Fp32Fallback


@pytest.fixture
def small_blocks(monkeypatch):
    """Test-sized logits take the block path, 3 rows a block."""
    monkeypatch.setattr(lean_cross_entropy, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(lean_cross_entropy, "BLOCK_ELEMENTS", 3 * 1000)


def _logits(n=64, c=1000, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c, generator=g) * 4).to(dtype)
    t = torch.randint(0, c, (n,), generator=g)
    t[::5] = -100  # ignored rows
    return x, t


def _fallback_ce(x, t, **kw):
    with Fp32Fallback("default", cpu_rnn=False).context():
        return F.cross_entropy(x, t, **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_and_grads_are_bitwise_the_plain_fp32_computation(small_blocks, reduction, dtype):
    x0, t = _logits(dtype=dtype)
    x = x0.clone().requires_grad_()
    loss = _fallback_ce(x, t, reduction=reduction)
    assert type(loss.grad_fn).__name__ == "ToCopyBackward0"
    assert type(loss.grad_fn.next_functions[0][0]).__name__ == "_BlockCrossEntropyBackward"  # the block path ran
    ref_x = x0.clone().requires_grad_()
    ref = F.cross_entropy(ref_x.float(), t, reduction=reduction).to(dtype)
    assert loss.dtype == dtype and torch.equal(loss, ref)
    g = torch.randn(ref.shape).to(dtype) if reduction == "none" else torch.tensor(1.7, dtype=dtype)
    loss.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, ref_x.grad)


def test_every_row_ignored_gives_nan_mean_and_zero_grads_as_torch(small_blocks):
    x0, t = _logits(n=6)
    t[:] = -100
    x = x0.clone().requires_grad_()
    loss = _fallback_ce(x, t)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(x0.float(), t))
    assert torch.equal(x.grad, torch.zeros_like(x0))


@pytest.mark.parametrize("call", [
    dict(weight=torch.rand(1000)), dict(label_smoothing=0.1), dict(reduction="mean", reduce=True),
])
def test_what_the_blocks_do_not_cover_runs_the_plain_path(small_blocks, call):
    x, t = _logits()
    x.requires_grad_()
    loss = _fallback_ce(x, t, **call)
    assert type(loss.grad_fn.next_functions[0][0]).__name__ != "_BlockCrossEntropyBackward"
    kw = {k: v for k, v in call.items() if k != "reduce"}
    assert torch.equal(loss, F.cross_entropy(x.detach().float(), t, **kw).to(x.dtype))


def test_small_logits_and_other_shapes_run_the_plain_path():
    x, t = _logits(n=8, c=10)
    x.requires_grad_()
    assert type(_fallback_ce(x, t).grad_fn.next_functions[0][0]).__name__ != "_BlockCrossEntropyBackward"
    images = torch.randn(2, 10, 4, 4).bfloat16().requires_grad_()  # (N, C, H, W) logits
    loss = _fallback_ce(images, torch.randint(0, 10, (2, 4, 4)))
    assert loss.dtype == torch.bfloat16 and torch.isfinite(loss)


class _LivePeak(TorchDispatchMode):
    """The peak of the bytes held by storages made inside the mode."""

    def __init__(self):
        super().__init__()
        self.live, self.bytes, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in self.live and st.nbytes():
                    self.live[st.data_ptr()] = st.nbytes()
                    self.bytes += st.nbytes()
                    weakref.finalize(st, self._free, st.data_ptr())
        self.peak = max(self.peak, self.bytes)
        return out

    def _free(self, key):
        self.bytes -= self.live.pop(key, 0)


def test_no_whole_fp32_copy_of_the_logits_exists(small_blocks):
    """Through forward and backward: the half logits' gradient and one block, where the plain fp32 computation
    holds three fp32 copies of the logits at once in backward."""
    x0, t = _logits(n=300)
    peaks = []
    for lean in (True, False):
        x = x0.clone().requires_grad_()
        with _LivePeak() as watch:
            loss = _fallback_ce(x, t) if lean else F.cross_entropy(x.float(), t).to(x.dtype)
            loss.backward()
        peaks.append(watch.peak)
    one_fp32_copy = x0.numel() * 4
    assert peaks[1] >= 3 * one_fp32_copy  # the plain path
    # the half gradient (and the copy of it a leaf's .grad accumulates), a block's fp32 tensors
    assert peaks[0] <= 2 * x0.nbytes + 4 * 3 * 1000 * 4 + 64 * 1024 < peaks[1] / 2


def test_backward_holds_one_blocks_fp32_tensors_at_a_time(monkeypatch):
    """A block's log-softmax, nll_loss's gradient and log-softmax's: three fp32 blocks live at once in backward,
    not the previous block's two beside the next one's (on a small model's logits the blocks are most of them)."""
    monkeypatch.setattr(lean_cross_entropy, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(lean_cross_entropy, "BLOCK_ELEMENTS", 30 * 1000)
    x, t = _logits(n=300)
    x.requires_grad_()
    loss = _fallback_ce(x, t)
    with _LivePeak() as watch:
        loss.backward()
    block = 30 * 1000 * 4
    # x's gradient (and the copy .grad accumulation may make), three blocks, the targets' small tensors
    assert watch.peak <= 2 * x.nbytes + 3 * block + 16 * 1024 < 2 * x.nbytes + 4 * block, watch.peak


def test_a_master_model_with_an_lm_head_takes_the_blocks(small_blocks):
    """nn.CrossEntropyLoss on a bf16-master model's logits reaches the block path; its grads are the plain
    fp32 computation's."""
    torch.manual_seed(0)
    head = nn.Linear(32, 1000)
    plugin = MasterPrecision("bf16-master")
    model = plugin.convert_module(nn.Sequential(head))
    h = torch.randn(64, 32).bfloat16()
    _, t = _logits()
    with plugin.forward_context():
        loss = nn.CrossEntropyLoss()(model(h), t)
    loss.backward()
    w = head.weight
    got = w.grad.clone()
    w.grad = None
    F.cross_entropy(model(h).float(), t).bfloat16().backward()
    assert torch.equal(got, w.grad)
