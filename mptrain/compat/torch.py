"""torch's private names, each behind one small function saying which public API is missing.

Imports only torch.  Private modules (``torch._dynamo``, ``torch._inductor``) are looked up, never imported, where
importing them would cost the caller about a second for nothing.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
from torch import nn


# -- autograd and autocast ---------------------------------------------------------------------------------------
def saved_tensors_hooks_reader() -> Optional[Callable[[], Optional[tuple]]]:
    """A function returning the saved-tensor hooks in force ((pack, unpack) or None), or None on a torch that
    cannot show them (before 2.8); some versions take an ``ignore_is_tracing`` flag, others nothing.
    Missing public API: reading the hooks ``torch.autograd.graph.saved_tensors_hooks`` put in force."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    for args in ((False,), ()):
        try:
            top(*args)
        except TypeError:
            continue
        return lambda: top(*args)
    return None


_hooks_is_enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True)


def saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be pushed (``torch.autograd.graph.disable_saved_tensors_hooks`` not in force).
    Missing public API: a query for what ``disable_saved_tensors_hooks`` set."""
    return _hooks_is_enabled()


def push_saved_tensors_hooks(pack: Callable, unpack: Callable) -> None:
    """Saved-tensor hooks in force until :func:`pop_saved_tensors_hooks` (a forward pre-hook pushes, the forward hook
    pops). Missing public API: push/pop of ``torch.autograd.graph.saved_tensors_hooks`` outside a ``with`` block."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def pop_saved_tensors_hooks() -> None:
    """Undoes :func:`push_saved_tensors_hooks`. Missing public API: as there."""
    torch._C._autograd._pop_saved_tensors_default_hooks()


def disable_autocast():
    """A context with autocast off on every device, at a tenth of the host time of two ``torch.autocast(device,
    enabled=False)`` contexts. Missing public API: a cheap device-independent autocast switch."""
    return torch._C._DisableAutocast()


def tensor_version(t: torch.Tensor) -> int:
    """The in-place modification counter autograd checks saved tensors with. Missing public API: the counter."""
    return t._version


def has_autocast_cuda_kernel(op: str) -> bool:
    """Whether CUDA autocast has a kernel for ``op`` (e.g. "aten::layer_norm": then it runs the op in fp32).
    Missing public API: autocast's op lists."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutocastCUDA")


# -- where torch.nn.functional's calls end -----------------------------------------------------------------------
def nn_c_functions() -> Any:
    """The C module torch.nn.functional calls into (``cross_entropy_loss``, ``nll_loss_nd``, ...).
    Missing public API: none exposes these callables, which a name bound before a forward reaches."""
    return torch._C._nn


def rnn_functions() -> Any:
    """The module ``nn.LSTM`` / ``nn.LSTMCell`` call their ops through (``lstm``, ``lstm_cell``).
    Missing public API: as for :func:`nn_c_functions`."""
    return torch._VF


# -- aten ops without a public binding ---------------------------------------------------------------------------
def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` in one multi-tensor launch per dtype and device.
    Missing public API: torch's ``_foreach`` ops."""
    torch._foreach_copy_(dst, src)


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor, multi-tensor. Missing public API: torch's ``_foreach`` ops."""
    return torch._foreach_norm(tensors)


def amp_unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's unscale kernel: ``grads *= inv_scale``, ``found_inf`` set on inf/NaN.
    Missing public API: the kernel outside ``GradScaler.unscale_``."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def log_softmax_backward(grad: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype) -> torch.Tensor:
    """log_softmax's backward from its output. Missing public API: softmax backward formulas."""
    return torch._log_softmax_backward_data(grad, output, dim, input_dtype)


def softmax_backward(grad: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype) -> torch.Tensor:
    """softmax's backward from its output. Missing public API: softmax backward formulas."""
    return torch._softmax_backward_data(grad, output, dim, input_dtype)


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 ``a @ b`` with int32 out (cuBLASLt). Missing public API: an integer matmul."""
    return torch._int_mm(a, b)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """fp8 ``a @ b`` with scales (cuBLASLt). Missing public API: an fp8 matmul."""
    return torch._scaled_mm(a, b, **kwargs)


def thnn_fused_lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor):
    """torch's fused CUDA LSTM cell pointwise kernel: (hy, cy, workspace).
    Missing public API: the kernel (no ``torch.*`` binding in newer torch)."""
    return torch.ops.aten._thnn_fused_lstm_cell(input_gates, hidden_gates, cx)


def use_cudnn_rnn_flatten_weight() -> bool:
    """Whether ``nn.RNNBase.flatten_parameters`` would flatten with cuDNN. Missing public API: that test."""
    return torch._use_cudnn_rnn_flatten_weight()


def cudnn_rnn_flatten_weight(*args: Any) -> Any:
    """cuDNN's weight flattening that ``flatten_parameters`` calls. Missing public API: flattening for bf16."""
    return torch._cudnn_rnn_flatten_weight(*args)


# -- nn.Module and optimizer internals ---------------------------------------------------------------------------
def norm_base_class() -> type:
    """The base of torch's batch and instance norms. Missing public API: a common public base class."""
    return nn.modules.batchnorm._NormBase


def batch_norm_base_class() -> type:
    """The base of ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm``. Missing public API: a public base class."""
    return nn.modules.batchnorm._BatchNorm


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers registered with ``persistent=False``. Missing public API: that query."""
    return module._non_persistent_buffers_set


def own_parameters(module: nn.Module) -> dict:
    """``module``'s own parameters by name, without ``Module.__getattr__`` per lookup (a host-bound step reads
    them every call). Missing public API: that dict."""
    return module._parameters


def rnn_layer_weight_names(rnn: nn.RNNBase) -> list[list[str]]:
    """Per layer (and direction), the names of an RNN's weights: w_ih, w_hh[, b_ih, b_hh][, w_hr].
    Missing public API: that list."""
    return rnn._all_weights


def rnn_flat_weight_names(rnn: nn.RNNBase) -> list[str]:
    """The parameter names of an RNN's weights, in cuDNN's order. Missing public API: that list."""
    return rnn._flat_weights_names


def rnn_flat_weights(rnn: nn.RNNBase) -> list:
    """An RNN's weights in cuDNN's order, as its forward passes them. Missing public API: that list."""
    return rnn._flat_weights


def rnn_refresh_flat_weights(rnn: nn.RNNBase) -> None:
    """Rebuilds the list :func:`rnn_flat_weights` returns after its parameters were replaced.
    Missing public API: a refresh outside ``_apply``."""
    rnn._init_flat_weights()


def conv2d_forward(conv: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``conv``'s convolution with ``weight`` and ``bias`` in place of its own (its padding mode and settings
    honoured). Missing public API: the layer's forward with other weights."""
    return nn.Conv2d._conv_forward(conv, x, weight, bias)


def module_hooks(module: Optional[nn.Module] = None) -> dict[str, dict]:
    """Forward, forward-pre, backward and backward-pre hooks by kind: ``module``'s own, or torch's global ones
    (``module=None``). Missing public API: listing registered hooks."""
    from torch.nn.modules import module as torch_module

    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    if module is None:
        return {k[1:]: getattr(torch_module, f"_global{k}", {}) for k in kinds}
    return {k[1:]: getattr(module, k) for k in kinds}


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> list[Callable]:
    """The step pre- and post-hooks registered on ``optimizer``. Missing public API: listing them."""
    return [h for kind in ("pre", "post") for h in getattr(optimizer, f"_optimizer_step_{kind}_hooks", {}).values()]


def supports_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes GradScaler's ``grad_scale`` / ``found_inf`` attributes (torch's fused
    optimizers). Missing public API: that flag."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def patch_step_function(optimizer: torch.optim.Optimizer) -> None:
    """Wraps the optimizer's (new) class ``step`` with torch's profiling and hook calls, as ``Optimizer.__init__``
    does. Missing public API: re-running that after a change of class."""
    optimizer._patch_step_function()


def rewrap_scheduler_step(optimizer: torch.optim.Optimizer) -> None:
    """An LR scheduler made before ``optimizer`` changed class wrapped ``optimizer.step`` on the instance around
    the old class's function (to see that the optimizer stepped): the wrapper is made again around the new class's.
    Missing public API: LR schedulers' step tracking (``_opt_called``, ``_wrapped_by_lr_sched``)."""
    import functools
    import weakref

    old = vars(optimizer).get("step")
    if old is None:
        return
    ref = weakref.ref(optimizer)
    func = type(optimizer).step

    @functools.wraps(func)
    def step(*args, **kwargs):
        opt = ref()
        opt._opt_called = True
        return func(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = getattr(old, "_wrapped_by_lr_sched", True)
    optimizer.step = step


def is_fsdp_flattened(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one of FSDP's flat parameters. Missing public API: that test."""
    from torch.distributed.fsdp._common_utils import _is_fsdp_flattened

    return _is_fsdp_flattened(tensor)


# -- torch.compile ---------------------------------------------------------------------------------------------
def mark_compile_constant(fn: Callable) -> Callable:
    """torch.compile runs ``fn`` while tracing and bakes its result in, as ``torch.compiler.assume_constant_result``
    does, without importing dynamo (~1 s). Missing public API: that decorator without the import."""
    fn._dynamo_marked_constant = True
    return fn


#: the instance attribute ``Module.compile`` sets and ``Module.__call__`` runs (see :func:`compiled_call`)
COMPILED_CALL_ATTR = "_compiled_call_impl"


def compiled_call(module: nn.Module) -> Optional[Callable]:
    """What ``module.compile()`` set to run in place of the module's call, or None.
    Missing public API: whether a module was compiled in place."""
    return getattr(module, COMPILED_CALL_ATTR, None)


def compile_call(module: nn.Module, **compile_kwargs: Any) -> None:
    """``module.compile(**compile_kwargs)``, with the compiled frame a function outside torch.nn that calls the
    module: torch 2.6's dynamo skips a first frame in torch.nn (``_call_impl``, ``nn.Sequential.forward``).
    Missing public API: ``Module.compile`` with the frame chosen."""
    call_impl = module._call_impl

    def compiled(*args: Any, **kwargs: Any) -> Any:
        return call_impl(*args, **kwargs)

    setattr(module, COMPILED_CALL_ATTR, torch.compile(compiled, **compile_kwargs))


def is_traced(tensor: Any) -> bool:
    """Whether code runs to be traced into a graph rather than to compute: under dynamo, or on the fake tensors
    AOT autograd traces with (dynamo puts some callables in its graph as one opaque call, e.g. the
    ``F.cross_entropy`` it substitutes for ``nn.CrossEntropyLoss``, and AOT runs those outside dynamo, where
    ``torch.compiler.is_compiling()`` is False).  Missing public API: a "tracing" query covering AOT autograd."""
    if torch.compiler.is_compiling():
        return True
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(tensor, torch.Tensor) and fake.is_fake(tensor)


def is_optimized_module(module: Any) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns (never, while dynamo is not imported).
    Missing public API: the wrapper's class."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule)


def cudagraph_trees_active(device: int) -> bool:
    """Whether torch.compile's own CUDA graphs (cudagraph trees) run on ``device`` in this process.
    Missing public API: that query."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    try:
        return trees.get_manager(device, create_if_none_exists=False) is not None
    except (AttributeError, TypeError, KeyError):  # another torch's internals: nothing to see
        return False


def pytree() -> Any:
    """torch's pytree functions (``tree_flatten``, ``tree_unflatten``, ``tree_flatten_with_path``, ``keystr``,
    ``tree_leaves``, ``tree_map_only``). Missing public API: ``torch.utils.pytree`` in every torch mptrain supports."""
    from torch.utils import _pytree

    return _pytree
