"""fuse_modules(model): swap nn.LayerNorm, nn.RMSNorm, nn.LSTMCell, nn.LSTM (unidirectional, no
projections) and nn.MaxPool2d (dilation 1, floor mode, no indices) for their fused drop-ins, and a large
nn.Linear with a ragged output width (a vocabulary projection) for PaddedLinear, in place.

The norms, the pool and the linear layer keep their object: only their class changes (``retype``), so
parameters, buffers, hooks, weight tying and settings stay as they are.  The LSTM modules are rebuilt around
the old ones' Parameter objects.  Either way an optimizer built before keeps working, state-dict keys do not
change, and the output is unchanged (up to the rounding of the CUDA kernels).  Only exact torch classes are
swapped: subclasses may override forward.

``kinds`` picks what is swapped (:data:`KINDS`); :data:`MEASURED_FASTER` is which kinds the Trainer's
``fuse_modules="auto"`` (:class:`mptrain.callbacks.FuseModules`) swaps in, eager or compiled, and why.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, NamedTuple, Optional

from torch import nn

from mptrain.nn.linear import PaddedLinear
from mptrain.nn.lstm import FusedLSTM, FusedLSTMCell
from mptrain.nn.norm import FusedLayerNorm, FusedRMSNorm
from mptrain.nn.pool import FusedMaxPool2d
from mptrain.nn.retype import retype


def _retyped(base: type, cls: type) -> Callable[[nn.Module], nn.Module]:
    return lambda m: retype(m, base, cls, "fuse_modules")


def _max_pool(m: nn.MaxPool2d) -> Optional[nn.Module]:
    if FusedMaxPool2d.unsupported(m):  # what the kernel cannot take stays torch's
        return None
    m = retype(m, nn.MaxPool2d, FusedMaxPool2d, "fuse_modules")
    m.fused = "auto"
    return m


def _linear(m: nn.Linear) -> Optional[nn.Module]:
    return PaddedLinear.from_module(m) if PaddedLinear.worth_padding(m) else None


def _lstm(m: nn.LSTM) -> Optional[nn.Module]:
    return FusedLSTM.from_module(m) if not m.bidirectional and m.proj_size == 0 else None


#: kind -> (the exact torch class, the factory of its drop-in: None leaves the module as it is)
_REPLACEMENTS: dict[str, tuple[type, Callable[[nn.Module], Optional[nn.Module]]]] = {
    "layer_norm": (nn.LayerNorm, _retyped(nn.LayerNorm, FusedLayerNorm)),
    "rms_norm": (nn.RMSNorm, _retyped(nn.RMSNorm, FusedRMSNorm)),
    "max_pool": (nn.MaxPool2d, _max_pool),
    "linear": (nn.Linear, _linear),
    "lstm_cell": (nn.LSTMCell, FusedLSTMCell.from_module),
    "lstm": (nn.LSTM, _lstm),
}
KINDS = tuple(_REPLACEMENTS)
#: mptrain's drop-in classes (what a swap leaves, or what a recipe built itself)
FUSED_CLASSES = (FusedLayerNorm, FusedRMSNorm, FusedMaxPool2d, PaddedLinear, FusedLSTMCell, FusedLSTM)

#: The kinds the Trainer swaps in by default, by how the module runs: each only where the H200 measured the
#: drop-in faster than what it replaces, in that setting (bf16 / fp16; docs/PERFORMANCE.md, docs/kernels/).
MEASURED_FASTER = {
    # layer_norm / rms_norm: forward + backward 1.6-3.8x torch's eager kernels (16384x1024 to 65536x768), and
    # 0.52-0.90x torch's host time per eager call.  max_pool: the channels_last kernels 5.2x ATen's forward +
    # backward (ResNet-50's stem pool); other layouts run torch's pool.  linear (ragged vocabulary): the BERT
    # decoder 1.49x, the GPT-2 head 3.09x, a GPT-2 step 1.32x.  Not lstm_cell / lstm: FusedLSTM's default path
    # is nn.LSTM's cuDNN call (nothing to gain), and the cell wins only in a host-bound eager loop, ties under
    # CUDA graphs, and its CPU path is not torch's cell (a CPU run's numbers would change).
    "eager": ("layer_norm", "rms_norm", "max_pool", "linear"),
    # Under torch.compile inductor generates its own norm kernels and fuses them with the residual add and
    # dropout around them; the compiled BERT-base step took the same GPU time with our LayerNorm as an opaque
    # op or inductor's (23.63 vs 23.57 ms of kernels), so norms are left to inductor.  The pool as our op beat
    # inductor's lowering (stem fwd + bwd 2.36 vs 2.98 ms; the ResNet-50 step -0.58 ms), and the padded GEMM
    # beat inductor's own mm padding (BERT decoder 1.30x, GPT-2 head 3.32x).
    "compiled": ("max_pool", "linear"),
}
# Attention is left alone.  Stock transformers models use attn_implementation="sdpa": flash / cuDNN
# attention, which never writes the scores out, while our fused softmax (6-7x eager's scale + mask + softmax,
# docs/kernels/softmax.md) speeds up eager attention's three passes over materialized scores; nothing measured
# it faster than SDPA's kernels (cuDNN attention was 2.5 of the 23.6 ms compiled BERT step), and switching a
# model's attention implementation changes more than one module.  A model built with
# attn_implementation="mptrain_fused_softmax" (mptrain.nn.attention) uses it by choice.


class Swap(NamedTuple):
    """One module swapped by :func:`fuse_and_list`: its qualified name, the torch class, the drop-in class."""
    name: str
    old: str
    new: str


def fuse_and_list(model: nn.Module, kinds: Iterable[str] = KINDS, skip: Iterable[nn.Module] = (),
                  prefix: str = "") -> tuple[nn.Module, list[Swap]]:
    """Swap the submodules of ``kinds`` in ``model`` in place (not inside the modules in ``skip``); returns
    (``model``, or its drop-in when ``model`` itself was swapped; the swaps, named with ``prefix``)."""
    table = {cls: make for kind, (cls, make) in _REPLACEMENTS.items() if kind in _check_kinds(kinds)}
    skipped = {id(m) for m in skip}
    if id(model) in skipped:
        return model, []
    # id of a module seen -> (it, what it became): a module shared by two parents is swapped once (and kept
    # alive here, so that no new module can reuse its id during the walk)
    done: dict[int, tuple[nn.Module, nn.Module]] = {}
    swaps: list[Swap] = []

    def replace(module: nn.Module, name: str) -> nn.Module:
        if id(module) not in done:
            make = table.get(type(module))
            old = type(module).__name__
            new = make(module) if make is not None else None
            done[id(module)] = (module, module if new is None else new)
            if new is not None:
                swaps.append(Swap(name, old, type(new).__name__))
        return done[id(module)][1]

    def visit(parent: nn.Module, path: str) -> None:  # in module order (pre-order, as named_modules)
        for name, child in list(parent.named_children()):
            if id(child) in skipped:
                continue
            qualified = f"{path}.{name}" if path else name
            seen = id(child) in done
            new = replace(child, qualified)
            if new is not child:
                setattr(parent, name, new)
            if not seen:
                visit(new, qualified)

    visit(model, prefix)
    top = replace(model, prefix or "<root>")
    return top, swaps


def fuse_modules(model: nn.Module, kinds: Optional[Iterable[str]] = None) -> nn.Module:
    """Swap supported submodules of ``model`` for fused ones in place (``kinds``: a subset of :data:`KINDS`,
    default all); returns ``model``, or the fused replacement when ``model`` itself is a supported module that
    is rebuilt (an LSTM), so always use the return value."""
    return fuse_and_list(model, KINDS if kinds is None else kinds)[0]


def describe_swaps(swaps: list[Swap]) -> str:
    """``"25 LayerNorm -> FusedLayerNorm (model.bert...), 1 Linear -> PaddedLinear (model.cls.predictions.decoder)"``:
    one group per (torch class, drop-in), with the common prefix of its modules' names."""
    groups: dict[tuple[str, str], list[str]] = {}
    for s in swaps:
        groups.setdefault((s.old, s.new), []).append(s.name)
    return ", ".join(f"{len(names)} {old} -> {new} ({_where(names)})" for (old, new), names in groups.items())


def kernels_available() -> bool:
    """Whether mptrain's CUDA extension loads (built on first use; a failed build warns once, with the reason)."""
    from mptrain import ops

    return ops.get_extension(required=False) is not None


def count_fused(model: nn.Module) -> Counter:
    """How many of mptrain's drop-ins ``model`` holds, by class name."""
    return Counter(type(m).__name__ for m in model.modules() if type(m) in FUSED_CLASSES)


def _where(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) + "..." if common else f"{names[0]}, ..."


def _check_kinds(kinds: Iterable[str]) -> frozenset:
    kinds = frozenset(kinds)
    unknown = sorted(kinds - set(KINDS))
    if unknown:
        raise ValueError(f"fuse_modules: unknown kinds {unknown}; valid: {', '.join(KINDS)}")
    return kinds
