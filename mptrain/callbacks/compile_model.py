"""CompileModel: ``torch.compile`` the LightningModule's ``model`` attribute at setup."""
from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch import Callback
from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

from mptrain.precision.fallback import Fp32OpsMode


class CompileModel(Callback):
    """Compile ``pl_module.model`` in place (``nn.Module.compile(**compile_kwargs)``) at ``setup``.

    Compiling the submodule (not the LightningModule) keeps ``self.log`` and hooks eager; compiling
    it in place (not ``torch.compile(model)``, whose wrapper would register as the child and prefix
    every state-dict key with ``_orig_mod.``) keeps checkpoints identical to an eager run's.

    The precision's fp32-fallback mode is entered inside the compiled region, not around it: a call
    made under the mode (the forward context of the half modes) leaves it for the call and the
    compiled function enters an equal mode itself.  The graph is the same (dynamo inlines the mode's
    upcasts either way), but at run time the compiled code's own tensor calls (every extern kernel,
    and every ``data_ptr()`` of a Triton launch) no longer pass through the mode's Python handler.
    """

    def __init__(self, **compile_kwargs: Any) -> None:
        self.compile_kwargs = compile_kwargs

    def setup(self, trainer, pl_module, stage: str) -> None:
        model = getattr(pl_module, "model", None)
        if not isinstance(model, torch.nn.Module):
            found = "missing" if model is None else f"a {type(model).__name__}"
            raise ValueError(
                f"compile=True compiles the LightningModule's `model` attribute (an nn.Module), but "
                f"{type(pl_module).__name__}.model is {found}. Store the network as `self.model`, or leave "
                f"compile=False and call torch.compile yourself in configure_model()."
            )
        if getattr(model, "_compiled_call_impl", None) is None and not isinstance(
                model, torch._dynamo.eval_frame.OptimizedModule):
            model.compile(**self.compile_kwargs)
            model._compiled_call_impl = _FallbackInside(model._call_impl, model._compiled_call_impl,
                                                        self.compile_kwargs)


class _FallbackInside:
    """``nn.Module._compiled_call_impl`` that moves an active fp32-fallback mode inside the compiled region."""

    def __init__(self, call_impl: Callable, compiled: Callable, compile_kwargs: dict) -> None:
        self.call_impl, self.compiled, self.compile_kwargs = call_impl, compiled, compile_kwargs
        self._in_mode: dict[int, tuple[dict, Callable]] = {}  # id(op table) -> (op table, compiled function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stack = _get_current_function_mode_stack()
        if not stack or not isinstance(stack[-1], Fp32OpsMode):  # no mode, or another mode above ours: as compiled
            return self.compiled(*args, **kwargs)
        with _pop_mode_temporarily() as mode:
            return self._compiled_in_mode(mode.funcs)(*args, **kwargs)

    def _compiled_in_mode(self, funcs: dict) -> Callable:
        hit = self._in_mode.get(id(funcs))
        if hit is None:  # one mode object per op table: dynamo guards on it, a new one would recompile
            mode, call_impl = Fp32OpsMode(funcs), self.call_impl

            def call_in_mode(*args: Any, **kwargs: Any) -> Any:
                with mode:
                    return call_impl(*args, **kwargs)

            hit = self._in_mode[id(funcs)] = (funcs, torch.compile(call_in_mode, **self.compile_kwargs))
        return hit[1]
