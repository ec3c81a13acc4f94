"""fp32 fallback memory: what autograd keeps of an op computed in fp32 is the half input, never its fp32 upcast."""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mptrain.precision import MasterPrecision, fallback
from mptrain.precision.fallback import Fp32Fallback

#: torch before 2.8 cannot show the saved-tensor hooks in force: there the upcasts are saved as they always were
needs_hook_stack = pytest.mark.skipif(fallback._top_hooks is None, reason="torch < 2.8: no view of the hook stack")


def saved_bytes(run, exclude=()) -> tuple[int, dict, object]:
    """(bytes of the unique storages autograd saved while ``run()`` ran, {dtype: bytes}, its result); storages of
    ``exclude`` (parameters) left out."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = (st.nbytes(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    by_dtype: dict = {}
    for n, dtype in seen.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return sum(by_dtype.values()), by_dtype, out


def _half(shape, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(*shape) * 3).bfloat16().requires_grad_()


@needs_hook_stack
def test_layer_norm_keeps_the_half_input_and_its_grads_are_exact():
    """F.layer_norm under the fallback saves what a bf16 call would (the bf16 input, fp32 stats), not the fp32
    upcast; backward upcasts the input again, so the grads are those of the fp32 computation, bitwise."""
    h, w, b = _half((256, 64)), torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)
    with Fp32Fallback("default", cpu_rnn=False).context():
        total, by_dtype, y = saved_bytes(lambda: F.layer_norm(h, (64,), w, b), exclude=(w, b))
    assert by_dtype.get(torch.bfloat16) == h.nbytes  # the input, at 2 bytes an element
    assert total < h.nbytes + 2 * 256 * 4 + 1  # plus the fp32 mean and rstd: no 4-byte copy of the input
    g = torch.randn_like(y)
    y.backward(g)
    grads = [t.grad.clone() for t in (h, w, b)]
    ref_h = h.detach().clone().requires_grad_()
    w2, b2 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref = F.layer_norm(ref_h.float(), (64,), w2, b2).bfloat16()  # plain autograd of the fp32 computation
    assert torch.equal(y, ref)
    ref.backward(g)
    for got, want in zip(grads, (ref_h.grad, w2.grad, b2.grad)):
        assert torch.equal(got, want)


@needs_hook_stack
def test_norm_layers_of_a_master_model_save_less_than_autocast():
    """The same LayerNorm model: bf16-master's forward saves no more than autocast bf16-mixed's (which keeps the
    bf16 input on the CPU and an fp32 one on CUDA), and its LayerNorm input is kept in bf16."""
    torch.manual_seed(0)
    fp32 = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    x, y = torch.randn(2048, 64), torch.randint(0, 64, (2048,))
    plugin = MasterPrecision("bf16-master")
    model = plugin.convert_module(copy.deepcopy(fp32))
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16

    def master():
        with plugin.forward_context():
            return F.cross_entropy(model(plugin.convert_input(x)), y)

    def mixed():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(fp32(x), y)

    ours, ours_by_dtype, _ = saved_bytes(master, exclude=list(model.parameters()))
    theirs, _, _ = saved_bytes(mixed, exclude=list(fp32.parameters()))
    assert ours <= theirs
    act = 2048 * 64  # elements of one activation
    # saved in bf16: the two Linear inputs and the LayerNorm input; in fp32: log_softmax's output and the stats
    assert ours_by_dtype[torch.bfloat16] == 3 * act * 2
    assert ours_by_dtype[torch.float32] <= act * 4 + 2 * 2048 * 4 + 4


def test_cross_entropy_saves_no_more_than_autocast():
    h, target = _half((512, 1000)), torch.randint(0, 1000, (512,))
    with Fp32Fallback("default", cpu_rnn=False).context():
        ours, _, loss = saved_bytes(lambda: F.cross_entropy(h, target))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # cross_entropy is on CPU autocast's fp32 list too
        theirs, _, _ = saved_bytes(lambda: F.cross_entropy(h, target))
    assert loss.dtype == torch.bfloat16 and ours <= theirs


class _UpcastWatch(TorchDispatchMode):
    """Weak references to every fp32 tensor cast from a half one."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.bfloat16 \
                and out.dtype == torch.float32:
            self.refs.append(weakref.ref(out))
        return out


@needs_hook_stack
@pytest.mark.parametrize("path", ["op", "module"])
def test_no_fp32_upcast_outlives_the_forward(path):
    """Tensors saved inside the op keep a reference to the pack hook: it must not keep the upcasts alive."""
    plugin = MasterPrecision("bf16-master")
    ln = plugin.convert_module(nn.Sequential(nn.LayerNorm(64)))
    h = _half((128, 64))
    watch = _UpcastWatch()
    with watch, plugin.forward_context():
        out = ln(h) if path == "module" else F.layer_norm(h, (64,))
    assert watch.refs and out.grad_fn is not None  # the graph (and what it saved) is alive
    assert all(r() is None for r in watch.refs)
    out.float().sum().backward()
    assert h.grad is not None and h.grad.dtype == torch.bfloat16


@needs_hook_stack
def test_an_inplace_change_of_the_half_input_is_refused_in_backward():
    """As autograd refuses it when the op saved that very tensor (an fp32 run, a bf16-true run)."""
    h = _half((32, 64))
    x = h * 1.0
    with Fp32Fallback("default", cpu_rnn=False).context():
        y = F.layer_norm(x, (64,))
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()


def test_outer_hooks_see_the_half_input_and_checkpointing_still_works():
    """Activation checkpointing's hooks stay in force around the fallback (they are handed the half input where
    the op saved its upcast, so the recomputed forward matches what was saved): the grads of a recompute under
    the fallback are those without checkpointing, bitwise."""
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(64, requires_grad=True)

    def block(x):
        return F.layer_norm(torch.tanh(x), (64,), w).bfloat16().float().softmax(-1)

    grads = []
    for ckpt in (False, True):
        h = _half((64, 64))
        with Fp32Fallback("default", cpu_rnn=False).context():
            out = checkpoint(block, h, use_reentrant=False) if ckpt else block(h)
            out.pow(2).sum().backward()  # the recompute runs in backward
        grads.append((h.grad.clone(), w.grad.clone()))
        w.grad = None
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_compiled_graphs_trace_the_fallback_with_grads_in_one_graph():
    """Under compile the fallback pushes no hooks (the graph chooses what it saves): fullgraph with grads."""
    def f(x, w):
        return F.layer_norm(torch.softmax(x @ w, -1), (8,)).float().sum()

    x, w = torch.randn(4, 8).bfloat16(), torch.randn(8, 8).bfloat16().requires_grad_()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with Fp32Fallback("default", cpu_rnn=False).context():
        out = compiled(x, w)
        out.backward()
        got = w.grad.clone()
        w.grad = None
        f(x, w).backward()
    assert torch.equal(got, w.grad)
