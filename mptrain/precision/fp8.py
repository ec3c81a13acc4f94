"""``fp8-master``: fp8 GEMMs in the linear layers, bf16 elsewhere, fp32 masters (Hopper, Ada and newer).

``bf16-master`` (bf16 parameters, norms fp32, fp32 masters updated in the optimizer step, the fp32 fallback,
the skip machinery) plus, at setup, the model's linear layers chosen by :mod:`.fp8_policy` swapped in place
for torchao's float8 training linears: each forward and backward GEMM quantizes its operands with the
recipe's scales (e4m3 for inputs and weights, e5m2 for output gradients with ``tensorwise``; e4m3 with
power-of-2 row scales with ``rowwise``) and runs on the fp8 tensor cores.  The swap keeps every Parameter
object and state-dict key, so optimizers, checkpoints and ``load_from_checkpoint`` see the model's own
linears.  A switch to ``32-true`` (``fp32_finetune_*``) or an automatic fp32 promotion turns the layers back
into ``nn.Linear``.

Without an fp8 GPU (CPU, or compute capability below 8.9) the plugin refuses at setup, naming the device:
an fp8 mode never trains in bf16 silently.  torchao's float8 machinery is the implementation (its casts
compile into fused amax/scale/cast kernels under ``torch.compile``, which is how fp8 pays off: run
``fp8-master`` with ``compile=True``).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from mptrain.precision.fp8_delayed import DelayedScaling, drop_delayed_state, use_delayed_scaling
from mptrain.precision.fp8_linear import use_single_casts
from mptrain.precision.fp8_mlp import unfuse_mlps, use_fused_mlps
from mptrain.precision.fp8_policy import plan_fp8_layers, resolve_keep_list
from mptrain.precision.master import MasterPrecision
from mptrain.precision.plugin import check_device_supports

log = logging.getLogger("mptrain")

#: ``recipe=`` -> torchao's recipe name (``delayed``: tensorwise casts at scales from the amax history,
#: :mod:`.fp8_delayed`)
RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise", "delayed": "tensorwise"}


class Fp8Precision(MasterPrecision):
    """fp8 GEMMs for linear layers with fp32 masters; see the module docstring.

    Args:
        precision: ``"fp8-master"``.
        recipe: ``"tensorwise"`` (one current scale per tensor), ``"delayed"`` (one scale per tensor from the
            last steps' amaxes: the casts fuse into the kernels that produce the tensors; :mod:`.fp8_delayed`)
            or ``"rowwise"`` (power-of-2 scales per row, more accurate for activations with outlier rows).
        keep_bf16: which linear layers stay in bf16: ``"default"``, a list of name patterns and rules
            (``"+x"`` / ``"-x"`` edit the default list) or ``[]``; see :mod:`mptrain.precision.fp8_policy`.
        fuse_mlps: with ``recipe="delayed"``, run each transformers gated MLP (Llama, Mistral, Qwen2, Qwen3) as one
            fused function whose SiLU x mul writes fp8 (:mod:`.fp8_mlp`); False keeps the layers unfused (another
            recipe with True is refused).
        **kwargs: as :class:`~mptrain.precision.master.MasterPrecision` (``loss_scaler``, ``fp32_fallback``,
            ``fused``, ``max_consecutive_skips``).
    """

    MODES = {"fp8-master": torch.bfloat16}
    SCALER_BY_DEFAULT = ()

    def __init__(self, precision: str = "fp8-master", *, recipe: str = "tensorwise",
                 keep_bf16: Union[str, Iterable[str], None] = "default", fuse_mlps: Optional[bool] = None,
                 **kwargs: Any):
        if recipe not in RECIPES:
            raise ValueError(f"Fp8Precision(recipe={recipe!r}) is not supported. Valid values: "
                             f"{', '.join(map(repr, RECIPES))}")
        if fuse_mlps and recipe != "delayed":
            raise ValueError(f"Fp8Precision(fuse_mlps=True) needs recipe='delayed' (its scales are known before the "
                             f"SiLU x mul runs), got recipe={recipe!r}")
        self.fuse_mlps = recipe == "delayed" if fuse_mlps is None else bool(fuse_mlps)
        self.keep_bf16 = resolve_keep_list(keep_bf16)
        super().__init__(precision, **kwargs)
        self.recipe = recipe
        self.fp8_layers: list[str] = []  # qualified names of the layers running in fp8
        self.kept_layers: dict[str, str] = {}  # qualified name of each linear kept in bf16 -> why
        self.fused_mlps: list[str] = []  # recipe="delayed": the gated MLPs run as one fused fp8 function
        self._delayed: Optional[DelayedScaling] = None  # recipe="delayed": the layers' amax histories and scales
        self._delayed_saved: Optional[dict] = None  # a checkpoint's, until the layers are on their device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision!r}, recipe={self.recipe!r})"

    def _convert(self, module: nn.Module) -> nn.Module:
        if module not in self._converted and self.phase == "low":
            # Lightning converts the module before moving it to its device: refuse now when no fp8 GPU is
            # in sight at all (connect() checks the run's own device again).
            p = next(module.parameters(), None)
            on_gpu = p is not None and p.device.type == "cuda"
            check_device_supports(self.initial_precision, p.device if on_gpu else torch.device(
                "cuda" if torch.cuda.is_available() else "cpu"))
            self._swap_linears(module)
        return super()._convert(module)

    def _swap_linears(self, module: nn.Module) -> None:
        convert, kept = plan_fp8_layers(module, self.keep_bf16)
        if not convert:
            why = "; ".join(f"{n}: {r}" for n, r in list(kept.items())[:8]) or "the model has no nn.Linear"
            raise ValueError(f"precision='fp8-master' found no linear layer to run in fp8 ({why}). Train with "
                             f"'bf16-master', or edit keep_bf16 (e.g. keep_bf16=['-<small>'])")
        float8 = _torchao_float8()
        config = float8.Float8LinearConfig.from_recipe_name(RECIPES[self.recipe])
        chosen = set(convert)
        float8.convert_to_float8_training(module, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
        single = use_single_casts(module)  # tensorwise: each operand cast once (the same bits as torchao's)
        self.fp8_layers, self.kept_layers = convert, kept
        log.info("fp8-master (%s): %d linear layers in fp8 (%d casting each operand once), %d kept in bf16%s",
                 self.recipe, len(convert), len(single), len(kept),
                 "".join(f"\n  {n}: {r}" for n, r in kept.items()))

    def _setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        super()._setup_optimizer(optimizer)
        if self.recipe == "delayed" and self._delayed is None and self.phase == "low" and self._module is not None:
            # the layers are on their device now: their scales and amaxes are made there
            self._delayed = use_delayed_scaling(self._module, self._device())
            self.fused_mlps = use_fused_mlps(self._module) if self.fuse_mlps else []
            if self.fused_mlps:
                log.info("fp8-master (delayed): %d gated MLPs run fused (fp8 SiLU x mul)", len(self.fused_mlps))
            if self._delayed_saved is not None:
                self._delayed.load_state_dict(self._delayed_saved)
                self._delayed_saved = None

    def cuda_graphs_refusal(self) -> Optional[tuple[str, str]]:
        if self.recipe == "delayed":
            return ("fp8-master's delayed recipe records each output gradient's amax as the gradient of a tensor "
                    "that is not a parameter, and the captured backward computes the parameters' gradients only",
                    "Use Fp8Precision(recipe='tensorwise')")
        return None

    def forward_context(self) -> contextlib.AbstractContextManager:
        stack = super().forward_context()
        if self._delayed is not None and self._delayed.steps == 0 and self.phase == "low":
            # The first step has no amax history and runs at current scales: eagerly, so that torch.compile traces
            # only the delayed graph (a compiled first step would cost the model a second compile).
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        return stack

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if self._delayed is not None and self.phase == "low":
            self._delayed.fold_grad_amaxes()  # a window's micro-batches: the largest output-gradient amax
        return super().post_backward(tensor, module)

    def fp8_saturated_steps(self) -> dict[str, dict[str, int]]:
        """``recipe="delayed"``: per layer, in how many steps its input or output-gradient cast saturated (the
        tensor outgrew its history's scale); empty otherwise.  One host read."""
        return {} if self._delayed is None else self._delayed.saturated_steps()

    def end_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().end_step(optimizer)
        # the step's amaxes into the history, the next step's scales out of it: once a training step, however
        # many optimizers it steps
        if self._delayed is not None and self.phase == "low" and optimizer is self._optimizers[0]:
            self._delayed.update()

    def switch_to_fp32(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        if self.phase != "fp32":
            if self._delayed is not None:
                drop_delayed_state(self._delayed.layers)
                self._delayed = None
            unfuse_mlps(self._module or model)
            unswap_fp8_linears(self._module or model)
        super().switch_to_fp32(model, optimizers)

    def promote_module(self, module: nn.Module) -> None:
        # fused MLPs inside the module become transformers' classes again; one above it (the module is a
        # projection) runs its layers unfused from now on, as its forward finds a projection that left fp8
        unfuse_mlps(module)
        unswap_fp8_linears(module)
        super().promote_module(module)

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "fp8_recipe": self.recipe, "fp8_layers": list(self.fp8_layers)}
        if self._delayed is not None:
            state["fp8_delayed"] = self._delayed.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        saved = state_dict.get("fp8_delayed")
        if saved is None or self.recipe != "delayed":
            return
        if self._delayed is None:
            self._delayed_saved = saved
        else:
            self._delayed.load_state_dict(saved)


def unswap_fp8_linears(module: nn.Module) -> list[str]:
    """Turn torchao's float8 linears inside ``module`` back into ``nn.Linear`` in place (same Parameters)."""
    names = []
    for name, m in module.named_modules():
        if is_float8_linear(m):
            m.__class__ = nn.Linear
            names.append(name)
    return names


def is_float8_linear(module: nn.Module) -> bool:
    """torchao's ``Float8Linear`` or mptrain's :class:`~mptrain.precision.fp8_linear.Fp8Linear` built on it."""
    return isinstance(module, nn.Linear) and any(c.__name__ == "Float8Linear" for c in type(module).__mro__)


def _torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ImportError("precision='fp8-master' runs on torchao's float8 training linears: "
                          "pip install 'mptrain[fp8]' (or pip install torchao)") from e
    return float8
