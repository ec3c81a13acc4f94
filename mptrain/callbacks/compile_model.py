"""CompileModel: ``torch.compile`` the LightningModule's ``model`` attribute at setup."""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback

from mptrain.compat import torch as compat


class CompileModel(Callback):
    """Compile ``pl_module.model`` in place (as ``nn.Module.compile(**compile_kwargs)`` does) at ``setup``.

    Compiling the submodule (not the LightningModule) keeps ``self.log`` and hooks eager; compiling
    it in place (not ``torch.compile(model)``, whose wrapper would register as the child and prefix
    every state-dict key with ``_orig_mod.``) keeps checkpoints identical to an eager run's.

    The precision's fp32 fallback: dynamo inlines the wrapped ops of the forward context, so the graph holds
    their upcasts and the compiled code runs without Python in between.  A loss the ``training_step`` computes
    on the model's output stays outside the graph; the fallback is told to compile large cross-entropies there
    (``Fp32Fallback.compile_losses``).  The ``training_step`` itself is not compiled: dynamo would recompile it,
    the model inlined, for each value of a Python int it reads (``self.global_step``, ``batch_idx``).
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
        if compat.compiled_call(model) is None and not compat.is_optimized_module(model):
            compile_in_place(model, **self.compile_kwargs)
        fallback = _fallback(trainer)
        if fallback is not None:  # a loss the training_step computes on the model's output: compiled too
            fallback.compile_losses(loss_compile_kwargs(self.compile_kwargs))

    def teardown(self, trainer, pl_module, stage: str) -> None:
        fallback = _fallback(trainer)  # a plugin reused by a run that does not compile computes losses eagerly
        if fallback is not None:
            fallback.compile_losses(None)


def _fallback(trainer):
    """The fp32 fallback of the run's precision plugin (mptrain's half modes), or None."""
    return getattr(getattr(getattr(trainer, "strategy", None), "precision_plugin", None), "fallback", None)


#: the ``torch.compile`` arguments a loss outside the model shares with the model's compile: the back end and its
#: options; not ``mode`` (its CUDA graphs belong to the model) nor ``fullgraph`` (the loss is one graph anyway)
_LOSS_COMPILE_KEYS = ("backend", "options", "dynamic")


def loss_compile_kwargs(compile_kwargs: dict) -> dict:
    return {k: v for k, v in compile_kwargs.items() if k in _LOSS_COMPILE_KEYS}


def compile_in_place(model: torch.nn.Module, **compile_kwargs: Any) -> None:
    """``model.compile(**compile_kwargs)``, with the compiled frame a function of ours that calls the module.

    ``Module.compile`` compiles the module's call itself; torch 2.6's dynamo skips a first frame in torch.nn
    (``Module._call_impl``, ``nn.Sequential.forward``), so a torch.nn container was never traced whole: only the
    user functions it reached (hooks, the fallback's wrappers) were compiled, each as a graph of its own.
    A frame outside torch.nn is traced on every version, and dynamo inlines the module's call from it.
    """
    compat.compile_call(model, **compile_kwargs)
