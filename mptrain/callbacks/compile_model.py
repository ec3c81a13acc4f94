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

    The precision's fp32 fallback needs nothing here: dynamo inlines the wrapped ops of the forward
    context, so the graph holds their upcasts and the compiled code runs without Python in between.
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


def compile_in_place(model: torch.nn.Module, **compile_kwargs: Any) -> None:
    """``model.compile(**compile_kwargs)``, with the compiled frame a function of ours that calls the module.

    ``Module.compile`` compiles the module's call itself; torch 2.6's dynamo skips a first frame in torch.nn
    (``Module._call_impl``, ``nn.Sequential.forward``), so a torch.nn container was never traced whole: only the
    user functions it reached (hooks, the fallback's wrappers) were compiled, each as a graph of its own.
    A frame outside torch.nn is traced on every version, and dynamo inlines the module's call from it.
    """
    compat.compile_call(model, **compile_kwargs)
