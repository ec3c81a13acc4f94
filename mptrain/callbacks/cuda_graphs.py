"""CudaGraphs (``Trainer(cuda_graphs=True)``): the train step captured in CUDA graphs and replayed.

``torch.cuda.graph`` captures the step's network call and its backward (:mod:`.graphed_forward`) and the precision
plugin's optimizer side (:mod:`mptrain.precision.graphed_step`).  ``torch.compile(mode="reduce-overhead")`` graphs
only what dynamo compiles (a graph break splits the step, a skipped graph is a log line); a direct capture graphs
every kernel, fused ones included, writes each ``.grad`` inside the backward graph and fails loudly, naming the
line.  ``compile=True`` (default mode) composes with it: the compiled kernels are captured.

The model's contract: ``training_step`` makes one network call -- ``self(...)``, or a direct submodule holding
trainable parameters, whatever its attribute name (``self.model(...)``, ``self.net(...)``) -- once per step, the
same module every step (the first eager step finds which; two different ones, the same one twice, or none is
refused, naming them); that call is a function of its tensor inputs and the parameters (no host reads, no
``self.log``), and every batch has one shape.  After ``warmup_steps`` eager steps one step captures and every later
step replays the call, its backward, the unscale and inf/NaN check and the optimizer step (skipped on the device)
with the scaler update.  Lightning's loop, every hook, logging, the rest of ``training_step`` (the loss computed
from the outputs, parameterless modules such as a loss or a metric), ``zero_grad``, clipping, LR schedulers and
checkpoints stay eager.

transformers builds an all-true ``attention_mask`` while a graph captures (SDPA then takes its fp32 math path): see
``mptrain.models.bert.MaskedLMNet``.  What the graphs cannot follow is refused before the first step (the checks
below) or at capture (:mod:`.graph_safety`, input changes), each error naming the reason and the fix.
The whole design, step by step, and the list of refusals: docs/cuda_graphs.md.
"""
from __future__ import annotations

from collections.abc import Sized

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import SingleDeviceStrategy

from mptrain.callbacks._plugin import require_mptrain_plugin
from mptrain.callbacks.auto_fp32_fallback import AutoFp32Fallback
from mptrain.callbacks.compile_model import CompileModel
from mptrain.callbacks.fp32_finetune import Fp32Finetune
from mptrain.callbacks.graphed_forward import GraphedForward
from mptrain.compat import torch as compat
from mptrain.precision.graph_capture import CudaGraphError
from mptrain.precision.graphed_step import GraphedStep
from mptrain.precision.grads import accepts_device_found_inf, is_mptrain_fused

_GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune")


class CudaGraphs(Callback):
    """Capture the train step after ``warmup_steps`` eager steps and replay it; see the module docstring."""

    def __init__(self, warmup_steps: int = 3) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"CudaGraphs(warmup_steps={warmup_steps!r}) is not valid; valid values: an integer >= 1 "
                             "(the optimizer state must exist before its step is captured)")
        self.warmup_steps = warmup_steps
        self.forward: GraphedForward | None = None
        self.step: GraphedStep | None = None
        self.replayed_steps = 0  # optimizer steps of the last fit run from the graphs

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            check_trainer(trainer, pl_module, require_mptrain_plugin(trainer, self))

    def on_fit_start(self, trainer, pl_module) -> None:
        check_optimizers(trainer.optimizers)
        self.forward = GraphedForward(pl_module)
        self.step = GraphedStep(require_mptrain_plugin(trainer, self), self.warmup_steps)
        self.step.around_closure = self.forward.training_step
        self.forward.install()
        self.step.install()

    def on_train_start(self, trainer, pl_module) -> None:
        check_last_batch(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._uninstall()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._uninstall()

    def _uninstall(self) -> None:
        if self.step is not None:  # set after self.forward; both are installed after that
            self.forward.uninstall()
            self.step.uninstall()
            self.replayed_steps = self.step.replays
        self.forward = self.step = None  # the graphs and their memory go with them


def _refuse(reason: str, fix: str) -> CudaGraphError:
    return CudaGraphError(f"cuda_graphs=True: {reason}. {fix}, or train with cuda_graphs=False.")


def check_trainer(trainer, pl_module, plugin) -> None:
    """What the captured step cannot follow, refused before any step (the device is checked last)."""
    name = type(pl_module).__name__
    if not pl_module.automatic_optimization:
        raise _refuse(f"{name} uses manual optimization (automatic_optimization=False); the captured step is "
                      "Lightning's automatic optimization step", "Use automatic optimization")
    accumulation = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]
    if trainer.accumulate_grad_batches != 1 or accumulation:
        raise _refuse(f"gradient accumulation (accumulate_grad_batches={trainer.accumulate_grad_batches}"
                      f"{', a GradientAccumulationScheduler' if accumulation else ''}) is not supported: the captured "
                      "backward writes the gradients of one batch", "Use a larger batch instead")
    for cls, arg in ((Fp32Finetune, "fp32_finetune_epochs/fp32_finetune_steps"),
                     (AutoFp32Fallback, "auto_fp32_fallback")):
        if any(isinstance(c, cls) for c in trainer.callbacks):
            raise _refuse(f"{arg} ({cls.__name__}) changes parameter dtypes during the run, which the captured "
                          "graphs cannot follow", f"Leave {arg} unset")
    refusal = plugin.cuda_graphs_refusal()
    if refusal is not None:
        raise _refuse(*refusal)
    if plugin.auto is not None or plugin.precision != plugin.initial_precision:
        raise _refuse(f"the precision plugin has switched or promotes modules ({plugin!r})", "Start a fresh plugin")
    for c in trainer.callbacks:
        kw = c.compile_kwargs if isinstance(c, CompileModel) else {}
        if kw.get("mode") in _GRAPHING_COMPILE_MODES or (kw.get("options") or {}).get("triton.cudagraphs"):
            raise _refuse(f"compile={kw!r} captures CUDA graphs itself (cudagraph trees), and a graph cannot be "
                          "captured inside another", "Use compile=True (default mode) with it")
    if getattr(trainer, "_detect_anomaly", False):
        raise _refuse("detect_anomaly=True checks every backward op on the host", "Set detect_anomaly=False")
    if trainer.world_size != 1 or trainer.num_devices != 1 or not isinstance(trainer.strategy, SingleDeviceStrategy):
        raise _refuse(f"it graphs the step of one device, but this run uses {type(trainer.strategy).__name__} on "
                      f"{trainer.num_devices} device(s) x {trainer.num_nodes} node(s)", "Train on devices=1")
    device = trainer.strategy.root_device
    if device.type != "cuda":
        raise _refuse(f"it captures CUDA work, but this run trains on {device}", "Use accelerator='cuda'")


def check_optimizers(optimizers: list) -> None:
    """The captured step must skip on the device: mptrain's fused optimizers, or torch's fused and capturable."""
    if len(optimizers) != 1:
        raise _refuse(f"it graphs the step of one optimizer, got {len(optimizers)}", "Return one optimizer")
    opt = optimizers[0]
    hooks = [getattr(h, "__qualname__", repr(h)) for h in compat.optimizer_step_hooks(opt)]
    if hooks:
        raise _refuse(f"{type(opt).__name__} has step hooks ({', '.join(hooks)}), which would run once, at capture",
                      "Remove the optimizer's step hooks")
    if is_mptrain_fused(opt):
        return
    fused = accepts_device_found_inf(opt)
    capturable = all(g.get("capturable", False) for g in opt.param_groups)
    if not (fused and capturable):
        cls = f"{type(opt).__module__}.{type(opt).__qualname__}"
        raise _refuse(f"the optimizer step is captured, and {cls} (fused={fused}, capturable={capturable}) cannot "
                      "skip a non-finite step on the device or be captured", "Use mptrain.optim.FusedAdamW/FusedAdam/"
                      "FusedSGD/FusedLAMB, or torch's optimizer with fused=True, capturable=True")


def check_last_batch(trainer) -> None:
    """A short last batch would change the captured input shape at the end of the first epoch: refused now."""
    loader = trainer.train_dataloader
    if not isinstance(loader, torch.utils.data.DataLoader) or not loader.batch_size or loader.drop_last:
        return
    if not isinstance(loader.dataset, Sized) or isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return
    n, b = len(loader.dataset), loader.batch_size
    full, rest = divmod(n, b)
    reached = trainer.num_training_batches > full and (trainer.max_steps < 0 or trainer.max_steps > full)
    if rest and reached:
        raise _refuse(f"the train loader's last batch holds {rest} samples ({n} samples, batch_size={b}) and a "
                      "captured step has one shape", "Use DataLoader(..., drop_last=True)")
