"""CompileModel: ``torch.compile`` the LightningModule's ``model`` attribute at setup."""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback


class CompileModel(Callback):
    """Replace ``pl_module.model`` by ``torch.compile(pl_module.model, **compile_kwargs)`` at ``setup``.

    Compiling the submodule (not the LightningModule) keeps ``self.log``, hooks and checkpoints
    exactly as in eager mode; the compiled wrapper shares its parameters with the original.
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
        if not isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            pl_module.model = torch.compile(model, **self.compile_kwargs)
