"""fp32 fallback: listed ops compute in fp32 whatever the mode and return the input's dtype.

* **op list**: while a forward runs, the callables every spelling of a listed op ends in (``F.softmax``,
  ``torch.softmax``, ``x.softmax``, ...) are wrapped: the wrapper upcasts half inputs, runs the op with
  autocast off and casts the result back (dynamo inlines it, so compiled graphs hold the same upcasts);
  unlisted ops are not touched, where a ``TorchFunctionMode`` would cost each of a forward's hundreds of
  torch calls a Python round trip;
* **module policy**: in ``*-master`` norm layers keep fp32 parameters and take/give half tensors;
* **half saved for backward** (eager): an op that saves its input for backward (layer_norm, a norm layer's
  ops, ...) keeps the half tensor an fp32 upcast was made from, not the upcast, and backward upcasts it again
  (exact): 2 bytes an element where the upcast costs 4, the same values (compiled graphs choose what they save);
  cross_entropy on large half logits runs by blocks of rows (:mod:`.lean_cross_entropy`); under torch.compile
  cross_entropy on half logits is traced as ``logsumexp - picked logit`` (:mod:`.compiled_cross_entropy`), and
  in a run that compiles its model, large logits' cross_entropy in eager code runs that form compiled;
* **CPU RNN policy**: torch's oneDNN bf16 LSTM crashes on CPUs without native bf16, so there
  ``torch.lstm`` / ``torch.lstm_cell`` run in fp32 on CPU tensors (GPU tensors untouched);
* **automatic promotion** (``auto_fp32_fallback``): leaf modules' outputs are checked for inf/NaN on
  the device; the plugin reads the flags where it syncs anyway and promotes the culprit to fp32.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mptrain.compat import torch as compat
from mptrain.ops.dtypes import HALF_DTYPES
from mptrain.precision.compiled_cross_entropy import compiled_cross_entropy, eager_compiled_cross_entropy
from mptrain.precision.lean_cross_entropy import lean_cross_entropy
from mptrain.precision.list_grammar import ListGrammar

log = logging.getLogger("mptrain")

#: DESIGN §3 default list (torch functional names).
DEFAULT_FP32_OPS: tuple[str, ...] = ("softmax", "log_softmax", "layer_norm", "group_norm", "batch_norm", "rms_norm",
                                     "cross_entropy", "nll_loss", "binary_cross_entropy_with_logits", "mse_loss",
                                     "kl_div", "logsumexp")


def _callables_for(name: str) -> list[Callable]:
    """Every public spelling of a functional op: F.name, torch.name, Tensor.name."""
    return [fn for fn in (getattr(owner, name, None) for owner in (F, torch, torch.Tensor)) if callable(fn)]


FP32_FALLBACK = ListGrammar("fp32_fallback", DEFAULT_FP32_OPS, "op names", "['softmax', 'layer_norm']",
                            known=lambda name: bool(_callables_for(name)), noun="op",
                            vocabulary=f"names are torch functional names such as {list(DEFAULT_FP32_OPS)}")


def resolve_op_list(spec: "str | Iterable[str] | None") -> tuple[str, ...]:
    """``"default"``, a list of names (``"+name"`` / ``"-name"`` edit the default) or ``[]``: a checked tuple
    (:mod:`.list_grammar`)."""
    return FP32_FALLBACK.resolve(spec)


#: ops that run in fp32 on CPU tensors when the CPU has no native bf16 (see cpu_lacks_native_bf16).
CPU_RNN_OPS: tuple[str, ...] = ("lstm", "lstm_cell")
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=None)
def cpu_lacks_native_bf16() -> bool:
    """True when the CPU has no native bf16 instructions (Linux /proc/cpuinfo flags; unknown: True)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return True
    return not any(flag in flags for flag in _NATIVE_BF16_FLAGS)


@functools.lru_cache(maxsize=None)
def _say_cpu_rnn_policy() -> None:
    log.warning("this CPU has no native bf16 (no %s): nn.LSTM / nn.LSTMCell run in fp32 on the CPU "
                "(torch's oneDNN bf16 LSTM crashes there); GPU runs are unaffected", " / ".join(_NATIVE_BF16_FLAGS))


# Hand-written walks over (nested) tuples and lists: every listed call in a forward pays for them, and
# torch's pytree costs about three times as much per call.
def _has_cpu_half(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.dtype in HALF_DTYPES and obj.device.type == "cpu"
    return isinstance(obj, (list, tuple)) and any(_has_cpu_half(o) for o in obj)


def _cpu_rnn_in_16_bits(args) -> bool:
    """Whether a CPU LSTM call would compute in 16 bits: half CPU tensors, or fp32 ones that CPU autocast
    (bf16-mixed on the CPU) lowers itself -- both reach oneDNN's 16-bit LSTM."""
    x = args[0] if args else None  # lstm / lstm_cell: the input (or a packed sequence's data) comes first
    if not isinstance(x, torch.Tensor):
        return _has_cpu_half(args)
    # a call's tensors share the input's device: a CUDA call returns here without walking the weights
    return x.device.type == "cpu" and (torch.is_autocast_enabled("cpu") or _has_cpu_half(args))


def _upcast(obj, dtype_seen: list, pairs: Optional[list] = None):
    """``obj`` with its half tensors in fp32; their dtypes appended to ``dtype_seen`` in order, and each
    (fp32 upcast, half source) to ``pairs`` if given."""
    if isinstance(obj, torch.Tensor) and obj.dtype in HALF_DTYPES:
        dtype_seen.append(obj.dtype)
        up = obj.float()
        if pairs is not None:
            pairs.append((up, obj))
        return up
    if isinstance(obj, (list, tuple)):
        return type(obj)(_upcast(o, dtype_seen, pairs) for o in obj)
    return obj


# -- upcasts saved for backward as their half source ---------------------------------------------------------------
class _HalfSource:
    """What autograd holds for a saved fp32 upcast: the half tensor it was made from (as the hooks below it packed
    it), and that tensor's version."""
    __slots__ = ("packed", "version", "shape", "dtype")

    def __init__(self, half: torch.Tensor, packed):
        self.packed, self.version = packed, compat.tensor_version(half)
        self.shape, self.dtype = tuple(half.shape), half.dtype


def _pack_upcast(pairs: list, outer_pack, t: torch.Tensor):
    for up, half in pairs:
        if t is up:
            return _HalfSource(half, outer_pack(half) if outer_pack is not None else half)
    return outer_pack(t) if outer_pack is not None else t


def _unpack_upcast(outer_unpack, saved):
    if type(saved) is not _HalfSource:
        return outer_unpack(saved) if outer_unpack is not None else saved
    half = outer_unpack(saved.packed) if outer_unpack is not None else saved.packed
    version = compat.tensor_version(half)
    if outer_unpack is None and version != saved.version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: a "
            f"{saved.dtype} tensor of shape {saved.shape} (is at version {version}; expected version "
            f"{saved.version}), the input of an op that mptrain's fp32 fallback computed in fp32: backward upcasts "
            f"that input again, as an fp32 run would reuse it. Modify a copy instead (x = x + y rather than x += y)")
    return half.float()


_top_hooks = compat.saved_tensors_hooks_reader()  # None: this torch cannot show the hooks in force


def push_half_saving(pairs: list) -> bool:
    """While autograd records (eager, grad on), the tensors an op saves that are the fp32 upcasts in ``pairs``
    are kept as their half sources and upcast again in backward; hooks already in force (activation
    checkpointing, offloading) see the half source where the op saved its upcast, and every other tensor as
    before.  False (nothing pushed) when compiling (the graph decides what it saves), when saved-tensor hooks are
    disabled, or on a torch that cannot show the hooks in force.  A True return must be followed by
    :func:`pop_half_saving` once the op has run."""
    if not pairs or _top_hooks is None or not torch.is_grad_enabled() or compat.is_traced(pairs[0][1]) \
            or not compat.saved_tensors_hooks_enabled():
        return False
    outer = _top_hooks() or (None, None)
    compat.push_saved_tensors_hooks(functools.partial(_pack_upcast, pairs, outer[0]),
                                    functools.partial(_unpack_upcast, outer[1]))
    return True


def pop_half_saving(pairs: list) -> None:
    """Undoes :func:`push_half_saving`, and empties ``pairs``: every tensor saved meanwhile keeps a reference to
    the pack hook, which must not keep the upcasts alive."""
    compat.pop_saved_tensors_hooks()
    pairs.clear()


def _downcast(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor) and obj.dtype == torch.float32:
        return obj.to(dtype)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_downcast(o, dtype) for o in obj)
    return obj


_F_BATCH_NORM = F.batch_norm  # before any wrapping


def _batch_norm_fp32(func, args, kwargs):
    """batch_norm updates running stats in place: run on fp32 copies, write them back.  On CUDA the input
    stays half (cuDNN takes half input with fp32 weights and stats and computes in fp32); on the CPU it is upcast."""
    names = (["input", "running_mean", "running_var", "weight", "bias"] if func is _F_BATCH_NORM
             else ["input", "weight", "bias", "running_mean", "running_var"])  # torch.batch_norm's order
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    rest_kwargs = {k: v for k, v in kwargs.items() if k not in names}
    x = bound["input"]
    call = {}
    keep_half_input = isinstance(x, torch.Tensor) and x.is_cuda
    for k in names:
        v = bound.get(k)
        upcast = isinstance(v, torch.Tensor) and v.dtype in HALF_DTYPES and not (k == "input" and keep_half_input)
        call[k] = v.float() if upcast else v
    pairs = [(call["input"], x)] if call["input"] is not x and isinstance(x, torch.Tensor) else []
    pushed = push_half_saving(pairs)
    try:
        out = func(*[call[k] for k in names], *args[len(names):], **rest_kwargs)
    finally:
        if pushed:
            pop_half_saving(pairs)
    for k in ("running_mean", "running_var"):
        if isinstance(bound.get(k), torch.Tensor) and bound[k] is not call[k]:
            with torch.no_grad():
                bound[k].copy_(call[k])
    return out.to(x.dtype) if x.dtype in HALF_DTYPES else out


def _in_fp32(name: str, func, args, kwargs):
    """A listed call: autocast off, fp32 compute, the input's dtype back."""
    if name in CPU_RNN_OPS:
        _say_cpu_rnn_policy()  # once per process, when it first applies
    if not (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")):
        return _fp32_call(name, func, args, kwargs)
    if torch.compiler.is_compiling():  # what dynamo traces
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return _fp32_call(name, func, args, kwargs)
    with compat.disable_autocast():  # the same in eager mode, at a tenth of the two contexts' host time
        return _fp32_call(name, func, args, kwargs)


# -- the listed ops' callables, wrapped while a forward runs ----------------------------------------------
_MISSING = object()
_OWNERS = (F, torch, torch.Tensor, compat.nn_c_functions(), compat.rnn_functions())  # the last: nn.LSTM's
#: the C functions torch.nn.functional reaches under another name (a name bound before the forward,
#: ``from torch.nn.functional import cross_entropy``, calls these)
_INTERNAL = {"cross_entropy": ("cross_entropy_loss",), "nll_loss": ("nll_loss_nd",)}
_local = threading.local()  # .ops: op names active in this thread (None: none, or inside a listed call); .prev
_lock = threading.Lock()
_installed: dict = {}  # (id(owner), attribute) -> [what owner.__dict__ held, open contexts]
_wrappers: dict = {}  # (id(owner), attribute) -> (the callable wrapped, its wrapper): made once


@functools.lru_cache(maxsize=None)
def _spots(name: str) -> tuple:
    """(owner, attribute, op name) of every callable a spelling of op ``name`` ends in."""
    spots = [(owner, name) for owner in _OWNERS] + [(compat.nn_c_functions(), n) for n in _INTERNAL.get(name, ())]
    return tuple((owner, attr, name) for owner, attr in spots if callable(getattr(owner, attr, None)))


def _wrapper(name: str, orig):
    def fp32_fallback(*args, **kwargs):
        if name in CPU_RNN_OPS and not _cpu_rnn_in_16_bits(args):
            return orig(*args, **kwargs)
        if torch.compiler.is_compiling():  # dynamo inlines the wrapper: the graph holds the fp32 path
            return _in_fp32(name, orig, args, kwargs)
        ops = getattr(_local, "ops", None)
        if ops is None or name not in ops:
            return orig(*args, **kwargs)
        _local.ops = None  # the wrapped ops the call reaches inside run as they are
        try:
            return _in_fp32(name, orig, args, kwargs)
        finally:
            _local.ops = ops

    fp32_fallback.__wrapped__ = orig
    return fp32_fallback


class PatchedOps:
    """The op list of a forward: while open, every callable the listed ops' spellings end in (``F.softmax``,
    ``torch.softmax``, ``Tensor.softmax``, torch's C ``cross_entropy_loss``, ...) is wrapped.  In eager
    code the wrappers act in the threads inside such a context and pass straight through elsewhere; code
    dynamo traces meanwhile gets the fp32 path in its graph.  Unlisted ops cost nothing.  Not caught:
    ``torch.ops.aten`` calls and C functions bound to a name before the forward (``from torch import softmax``)."""

    def __init__(self, names: Iterable[str]):
        self.names = frozenset(names)
        self.spots = [spot for name in sorted(self.names) for spot in _spots(name)]
        #: torch.compile's arguments for large losses computed in eager code (None: the eager paths); see
        #: :meth:`Fp32Fallback.compile_losses`
        self.loss_compile: Optional[dict] = None

    def __enter__(self):
        with _lock:
            for owner, attr, name in self.spots:
                key = (id(owner), attr)
                if key not in _installed:
                    held = vars(owner).get(attr, _MISSING)
                    if _wrappers.get(key, (None,))[0] is not held:
                        _wrappers[key] = (held, _wrapper(name, getattr(owner, attr)))
                    setattr(owner, attr, _wrappers[key][1])
                    _installed[key] = [held, 0]
                _installed[key][1] += 1
        _local.prev = (getattr(_local, "ops", None), getattr(_local, "loss_compile", None),
                       getattr(_local, "prev", None))
        _local.ops, _local.loss_compile = self.names, self.loss_compile
        return self

    def __exit__(self, *exc):
        _local.ops, _local.loss_compile, _local.prev = _local.prev
        with _lock:
            for owner, attr, _ in self.spots:
                entry = _installed[(id(owner), attr)]
                entry[1] -= 1
                if entry[1] == 0:
                    del _installed[(id(owner), attr)]
                    if entry[0] is _MISSING:
                        delattr(owner, attr)
                    else:
                        setattr(owner, attr, entry[0])


def _fp32_call(name: str, func, args, kwargs):
    """``func`` on fp32 copies of its half tensors, the result in the first one's dtype."""
    if name == "batch_norm":
        return _batch_norm_fp32(func, args, kwargs)
    if name == "cross_entropy":  # traced: logsumexp - picked; eager: large logits compiled so in a compiling run,
        loss = compiled_cross_entropy(func, args, kwargs)  # else by blocks
        loss_compile = getattr(_local, "loss_compile", None)
        if loss is None and loss_compile is not None:
            loss = eager_compiled_cross_entropy(func, args, kwargs, loss_compile)
        if loss is None:
            loss = lean_cross_entropy(func, args, kwargs)
        if loss is not None:
            return loss.to((args[0] if args else kwargs["input"]).dtype)
    seen: list = []
    pairs: list = []
    up_args = _upcast(tuple(args), seen, pairs)
    up_kwargs = {k: _upcast(v, seen, pairs) for k, v in kwargs.items()}
    if not seen:
        return func(*args, **kwargs)
    pushed = push_half_saving(pairs)
    try:
        out = func(*up_args, **up_kwargs)
    finally:
        if pushed:
            pop_half_saving(pairs)
    return _downcast(out, seen[0])  # "the input's dtype": the first half tensor's


class Fp32Fallback:
    """The op list of a run: ``context()`` is entered around every forward."""

    def __init__(self, ops: "str | Iterable[str] | None" = "default", cpu_rnn: Optional[bool] = None):
        self.ops = resolve_op_list(ops)
        self.cpu_rnn = cpu_lacks_native_bf16() if cpu_rnn is None else cpu_rnn
        self.names = self.ops + (CPU_RNN_OPS if self.cpu_rnn else ())  # what the context wraps
        self._patched: Optional[PatchedOps] = None  # made at first use, then reused
        self.loss_compile: Optional[dict] = None  # compile_losses

    def __getstate__(self) -> dict:  # copies and pickles (ddp_spawn) make their own: it holds torch's modules
        return {**self.__dict__, "_patched": None}

    def context(self):
        """Around a forward: the listed ops' callables wrapped (eager and compiled code alike)."""
        if not self.names:
            return contextlib.nullcontext()
        if self._patched is None:
            self._patched = PatchedOps(self.names)
        self._patched.loss_compile = self.loss_compile
        return self._patched

    def compile_losses(self, compile_kwargs: Optional[dict]) -> None:
        """In a run that compiles its model (``compile=True``): cross_entropy on large logits called from eager code
        (a ``training_step``'s loss on the model's output) runs compiled with ``compile_kwargs``
        (:mod:`.compiled_cross_entropy`); None: the eager paths."""
        self.loss_compile = compile_kwargs if "cross_entropy" in self.names else None

    def __repr__(self) -> str:
        return f"Fp32Fallback({list(self.ops)})"


NORM_TYPES = (compat.norm_base_class(), nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm)


def is_norm_module(module: nn.Module) -> bool:
    """Normalization layers (torch's, mptrain's fused ones, and look-alikes by class name)."""
    if isinstance(module, NORM_TYPES):
        return True
    name = type(module).__name__.lower()
    return name.endswith("norm") or "layernorm" in name or "batchnorm" in name or "rmsnorm" in name


def half_params_fp32_norms(module: nn.Module, dtype: torch.dtype, before_cast=None) -> list:
    """The half modes' module policy, in place: norm layers keep fp32 weights and compute in fp32 (their hooks are
    returned); every other floating parameter and persistent buffer becomes ``dtype``.  Non-persistent buffers are
    constants derived from the config (RoPE's inv_freq): a bf16 copy would move a rotary angle near position 2048
    by radians, so they keep their dtype.  ``before_cast(p)`` sees each parameter before it is cast."""
    hooks: list = []
    for m in module.modules():
        if is_norm_module(m):
            m.float()
            hooks += run_module_in_fp32(m)
            continue
        for p in m.parameters(recurse=False):
            if p.is_floating_point() and p.dtype not in HALF_DTYPES:
                if before_cast is not None:
                    before_cast(p)
                p.data = p.data.to(dtype)
        for name, b in m.named_buffers(recurse=False):
            if b.is_floating_point() and name not in compat.non_persistent_buffer_names(m):
                setattr(m, name, b.to(dtype))
    return hooks


def run_module_in_fp32(module: nn.Module) -> list:
    """Hooks (returned) that make ``module`` compute in fp32 and return the input's dtype; modules with
    ``accepts_mixed_dtypes = True`` (e.g. mptrain's fused LayerNorm) take half input natively: left alone."""
    if getattr(module, "accepts_mixed_dtypes", False):
        return []

    cudnn_mixed = isinstance(module, compat.batch_norm_base_class())

    def pre(mod, args, kwargs):
        dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        mod._mpt_in_dtype = dtypes[0] if dtypes else None
        mod._mpt_saving = None
        if cudnn_mixed and args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
            # cuDNN batch norm: half in, fp32 weights/stats, fp32 math, half out; no upcast copy.
            mod._mpt_in_dtype = None
            return None
        seen: list = []
        pairs: list = []
        up = _upcast(tuple(args), seen, pairs), {k: _upcast(v, seen, pairs) for k, v in kwargs.items()}
        if push_half_saving(pairs):  # what the module's ops save of its input: the half tensor
            mod._mpt_saving = pairs
        return up

    def post(mod, args, kwargs, out):
        pairs = getattr(mod, "_mpt_saving", None)
        if pairs is not None:
            mod._mpt_saving = None
            pop_half_saving(pairs)
        dt = getattr(mod, "_mpt_in_dtype", None)
        return _downcast(out, dt) if dt in HALF_DTYPES else out

    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True, always_call=True),  # pops after an error too
    ]


class AutoFallback:
    """Watches leaf modules' outputs for inf/NaN on the device; ``poll()`` names the first offender.

    ``first_bad`` holds, per module, the call number of its first non-finite output since the last poll
    (updated with a device ``minimum``, no sync).  Modules downstream of an overflow see inf too, so only
    the earliest in execution order is promoted: the culprit, not its victims."""

    _NONE = 2**30

    def __init__(self, module: nn.Module):
        leaves = [(name, m) for name, m in module.named_modules() if name and not list(m.children())]
        self.names: list[str] = [name for name, _ in leaves]
        self.modules: list[nn.Module] = [m for _, m in leaves]
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self.first_bad = torch.full((len(self.modules),), self._NONE, dtype=torch.int32, device=device)
        self._calls = 0
        self.promoted: set[str] = set()
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.modules)]

    def _hook(self, idx: int):
        def hook(mod, args, out):
            if getattr(mod, "_mpt_promoted", False):
                return
            t = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(t, torch.Tensor) and t.dtype in HALF_DTYPES:
                self._calls += 1
                bad = (~torch.isfinite(t.detach())).any()
                seq = torch.where(bad, self._calls, self._NONE).to(torch.int32).reshape(1)
                torch.minimum(self.first_bad[idx : idx + 1], seq, out=self.first_bad[idx : idx + 1])

        return hook

    def poll(self) -> list[tuple[str, nn.Module]]:
        """The earliest module with a non-finite output since the last poll (one host sync)."""
        first = int(self.first_bad.argmin().item())
        hit = int(self.first_bad[first].item()) < self._NONE
        self.first_bad.fill_(self._NONE)
        self._calls = 0
        if not hit or self.names[first] in self.promoted:
            return []
        self.promoted.add(self.names[first])
        return [(self.names[first], self.modules[first])]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
