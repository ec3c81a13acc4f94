"""The Trainer: mptrain's own fit / validate loop on top of Lightning Fabric.

Fabric owns devices, the strategy (DDP under torchrun), launching and loggers; this
file owns the order of things in a step, which is where mixed precision is won or
lost.  Read ``_train_epoch`` top to bottom: forward under the precision's context,
scaled backward (no DDP sync until the window's last micro-batch), then
``_optimizer_step``: unscale + inf check + clip + step, all decided on the device.
"""
from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from torch import nn

from mptrain import distributed as mdist
from mptrain.callbacks import Callback
from mptrain.checkpoint import (
    FORMAT_VERSION,
    link_or_copy_atomic,
    load_checkpoint,
    resolve_ckpt_path,
    save_checkpoint,
)
from mptrain.metrics_store import MetricsStore, ModuleBridge
from mptrain.optimizer_config import SchedulerConfig, parse_optimizers
from mptrain.precision import build_precision, normalize_precision
from mptrain.precision.base import Precision, accepts_device_found_inf
from mptrain.precision.loss_scaler import DynamicLossScaler, NonFiniteError
from mptrain.precision.schedule import finetune_start_epoch, switch_to_fp32

log = logging.getLogger("mptrain")

_FUSED = ("auto", True, False)


class Trainer:
    """Train a ``LightningModule`` in fp32, fp16 or bf16 (see DESIGN §3 for every argument)."""

    def __init__(
        self,
        precision: str = "32-true",
        max_epochs: Optional[int] = 10,
        max_steps: int = -1,
        accumulate_grad_batches: int = 1,
        fp32_finetune_epochs: int = 0,
        loss_scaler: Any = None,
        fp32_fallback: Any = "default",
        auto_fp32_fallback: bool = False,
        gradient_clip_val: Optional[float] = None,
        fused: Any = "auto",
        accelerator: str = "auto",
        devices: Any = "auto",
        strategy: Any = "auto",
        num_nodes: int = 1,
        logger: Any = None,
        callbacks: Optional[Iterable[Callback]] = None,
        default_root_dir: str | os.PathLike = ".",
        checkpoint_every_n_steps: Optional[int] = None,
        seed: Optional[int] = None,
        deterministic: bool = False,
        cuda_graphs: bool = False,
        channels_last: bool = False,
        float32_matmul_precision: Optional[str] = None,
        log_every_n_steps: int = 50,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        limit_train_batches: Optional[int] = None,
        limit_val_batches: Optional[int] = None,
        check_val_every_n_epoch: int = 1,
        benchmark: Optional[bool] = None,
    ):
        self._initial_precision = normalize_precision(precision)
        _check_int("max_steps", max_steps, minimum=-1)
        if max_epochs is None:
            max_epochs = -1 if max_steps > 0 else 1000
        _check_int("max_epochs", max_epochs, minimum=-1)
        if max_epochs == -1 and max_steps <= 0:
            raise ValueError("max_epochs=-1 needs max_steps > 0, or training never ends")
        _check_int("accumulate_grad_batches", accumulate_grad_batches, minimum=1)
        _check_int("fp32_finetune_epochs", fp32_finetune_epochs, minimum=0)
        if fp32_finetune_epochs and max_epochs > 0 and fp32_finetune_epochs > max_epochs:
            raise ValueError(f"fp32_finetune_epochs={fp32_finetune_epochs} exceeds max_epochs={max_epochs}")
        if fused not in _FUSED:
            raise ValueError(f"fused={fused!r}; valid values: 'auto', True, False")
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ValueError(f"gradient_clip_val={gradient_clip_val!r} must be > 0 or None")
        if checkpoint_every_n_steps is not None:
            _check_int("checkpoint_every_n_steps", checkpoint_every_n_steps, minimum=1)
        _check_int("log_every_n_steps", log_every_n_steps, minimum=1)
        if cuda_graphs:
            raise NotImplementedError(
                "cuda_graphs=True is not implemented yet (whole-step capture comes with the end-to-end "
                "performance work); use cuda_graphs=False"
            )
        if float32_matmul_precision not in (None, "highest", "high", "medium"):
            raise ValueError(
                f"float32_matmul_precision={float32_matmul_precision!r}; valid: None, 'highest', 'high', 'medium'"
            )
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.accumulate_grad_batches = accumulate_grad_batches
        self.fp32_finetune_epochs = fp32_finetune_epochs
        self._loss_scaler_spec = loss_scaler
        self._fp32_fallback = fp32_fallback
        self.auto_fp32_fallback = auto_fp32_fallback
        self.gradient_clip_val = gradient_clip_val
        self.fused = fused
        self.default_root_dir = str(default_root_dir)
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        self.seed = seed
        self.deterministic = deterministic
        self.channels_last = channels_last
        self.float32_matmul_precision = float32_matmul_precision
        self.log_every_n_steps = log_every_n_steps
        self.enable_checkpointing = enable_checkpointing
        self.limit_train_batches = limit_train_batches
        self.limit_val_batches = limit_val_batches
        self.check_val_every_n_epoch = check_val_every_n_epoch
        # cuDNN autotuning: on by default (fixed-shape training is the common case), off when
        # deterministic=True; benchmark=False keeps cuDNN's heuristics.
        self.benchmark = (not deterministic) if benchmark is None else bool(benchmark)
        if deterministic and self.benchmark:
            raise ValueError("benchmark=True contradicts deterministic=True (autotuning picks kernels by timing)")
        self.callbacks: list = list(callbacks or [])
        if enable_progress_bar:
            from mptrain.progress import ProgressBar

            if not any(isinstance(c, ProgressBar) for c in self.callbacks):
                self.callbacks.append(ProgressBar())

        from lightning.fabric import Fabric

        if logger is False or logger == "none":
            self.loggers = []
        else:
            from mptrain.loggers import build_loggers

            self.loggers = build_loggers(logger, self.default_root_dir)
        self._strategy_arg = strategy
        self._sync_found_inf = None  # set with the module (_setup_model): all-reduce of found_inf or None
        self.fabric = Fabric(
            accelerator=accelerator,
            devices=devices,
            strategy=strategy,
            num_nodes=num_nodes,
            precision="32-true",  # the precision is ours: Fabric must not cast or autocast
            loggers=self.loggers,
        )

        # Public state (DESIGN §3); the rest is set up by fit / validate.
        self.global_step = 0
        self.current_epoch = 0
        self.precision = self._initial_precision
        self.loss_scaler: Optional[DynamicLossScaler] = None
        self.found_inf: Optional[torch.Tensor] = None
        self.metrics = MetricsStore()
        self.should_stop = False
        self.num_training_batches = 0
        self.num_val_batches = 0
        self._precision: Optional[Precision] = None
        self._module: Optional[nn.Module] = None
        self._wrapped = None
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._schedulers: list[SchedulerConfig] = []
        self._launched = False
        self._setup_done = False
        self._resume_batch_idx = 0
        self._epoch_start_rng: list = []
        self._position = (0, 0)  # (epoch, batches of it trained): where a resume starts

    # ------------------------------------------------------------------ properties
    @property
    def is_global_zero(self) -> bool:
        return self.fabric.is_global_zero

    @property
    def world_size(self) -> int:
        return self.fabric.world_size

    @property
    def global_rank(self) -> int:
        return self.fabric.global_rank

    @property
    def skipped_steps(self) -> int:
        return 0 if self.loss_scaler is None else int(self.loss_scaler._total_skips.item())

    @property
    def callback_metrics(self) -> dict:
        return self.metrics.callback_metrics

    @property
    def logged_metrics(self) -> dict:
        return self.metrics.logged

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.default_root_dir) / "checkpoints"

    @property
    def log_dir(self) -> str:
        for lg in self.loggers:
            d = getattr(lg, "log_dir", None)
            if d:
                return str(d)
        return self.default_root_dir

    @property
    def estimated_stepping_batches(self) -> int:
        if self.max_steps > 0:
            return self.max_steps
        per_epoch = math.ceil(self.num_training_batches / self.accumulate_grad_batches)
        return per_epoch * max(self.max_epochs, 0)

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        return self._optimizer

    @property
    def lr_scheduler_configs(self) -> list[SchedulerConfig]:
        return self._schedulers

    def unscaled_grads(self) -> dict[str, torch.Tensor]:
        """Unscaled grads by parameter name (valid in on_before_optimizer_step)."""
        return self._precision.unscaled_grads(self._module) if self._precision else {}

    def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
        """Send ``metrics`` to every logger (rank 0 only; values may be tensors)."""
        self.metrics.update_logged(metrics)
        if self.loggers and self.is_global_zero:
            clean = {k: (float(v.item()) if isinstance(v, torch.Tensor) else float(v)) for k, v in metrics.items()}
            self.fabric.log_dict(clean, step=self.global_step if step is None else step)

    # ------------------------------------------------------------------ setup
    def _launch(self) -> None:
        if not self._launched:
            if not self.fabric._launched:
                self.fabric.launch()
            self._launched = True
            if self.seed is not None:
                self.fabric.seed_everything(self.seed, workers=True)
            torch.backends.cudnn.benchmark = self.benchmark
            if self.deterministic:
                torch.use_deterministic_algorithms(True, warn_only=False)
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            if self.float32_matmul_precision is not None:
                torch.set_float32_matmul_precision(self.float32_matmul_precision)

    def _setup_model(self, model: nn.Module, need_optimizer: bool) -> None:
        """Precision conversion, optimizer, scaler, DDP wrapping: once per Trainer."""
        if self._setup_done:
            if model is not self._module:
                raise RuntimeError("this Trainer is already set up with another model; create a new Trainer")
            return
        _check_module(model)
        device = self.fabric.device
        precision = build_precision(self._initial_precision, device, self._fp32_fallback)
        if self.fused is True and device.type == "cuda":
            from mptrain.precision.base import require_fused_ops

            require_fused_ops()
        precision.use_fused_ops = self.fused is not False
        model.to(device)
        if self.channels_last and device.type == "cuda":
            model.to(memory_format=torch.channels_last)
        precision.convert_module(model)
        self._precision = precision
        self._module = model
        ModuleBridge.attach(model, self)
        if need_optimizer:
            opt, scheds = parse_optimizers(model.configure_optimizers())
            self._optimizer = precision.setup_optimizer(opt, model)
            self._schedulers = scheds
            self.loss_scaler = self._build_scaler(precision, device)
        precision.discard_fp32_init()
        if self.auto_fp32_fallback:
            precision.enable_auto_fallback(model)
        mdist.tune_ddp(self.fabric.strategy, model, self._strategy_arg)
        # found_inf must agree across ranks; under DDP the grads it is computed from already do.
        sharded = self.world_size > 1 and not mdist.grads_all_reduced(self.fabric.strategy)
        self._sync_found_inf = mdist.all_reduce_max_ if sharded else None
        self._wrapped = self.fabric.setup_module(model)
        ModuleBridge.attach(model, self)  # Fabric sets module._fabric; ours must win
        self._setup_done = True

    def _build_scaler(self, precision: Precision, device: torch.device) -> Optional[DynamicLossScaler]:
        spec = self._loss_scaler_spec
        if spec is False:
            return None
        if spec is None:
            return DynamicLossScaler(device=device) if precision.default_scaler else None
        return DynamicLossScaler.from_spec(spec, device)

    def _setup_loader(self, loader, what: str):
        if loader is None:
            return None
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise TypeError(f"{what} must be a torch DataLoader (or come from a LightningDataModule), got {type(loader).__name__}")
        # DistributedSampler under DDP; batches are moved to the device by the loop.
        return self.fabric.setup_dataloaders(loader, move_to_device=False)

    def _resolve_data(self, model, train_dataloaders, val_dataloaders, datamodule, stage: str):
        if datamodule is not None:
            if train_dataloaders is not None or val_dataloaders is not None:
                raise ValueError("pass either dataloaders or a datamodule, not both")
            if hasattr(datamodule, "trainer"):
                try:
                    datamodule.trainer = self
                except Exception:  # noqa: BLE001 - a read-only property on some datamodules
                    pass
            if self.is_global_zero:
                datamodule.prepare_data()
            self.fabric.barrier()
            datamodule.setup(stage)
            train = datamodule.train_dataloader() if stage == "fit" else None
            val = datamodule.val_dataloader() if _overrides(datamodule, "val_dataloader") else None
            return train, val
        if stage == "fit" and train_dataloaders is None and _overrides(model, "train_dataloader"):
            train_dataloaders = model.train_dataloader()
        if val_dataloaders is None and _overrides(model, "val_dataloader"):
            val_dataloaders = model.val_dataloader()
        return train_dataloaders, val_dataloaders

    # ------------------------------------------------------------------ fit
    def fit(self, model, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None) -> None:
        """Train ``model``; ``ckpt_path`` (a path or ``"last"``) resumes a run exactly where it stopped."""
        self._launch()
        train, val = self._resolve_data(model, train_dataloaders, val_dataloaders, datamodule, "fit")
        if train is None:
            raise ValueError("fit needs training data: pass train_dataloaders, a datamodule, or define train_dataloader()")
        # Loaders first: configure_optimizers may read trainer.estimated_stepping_batches.
        self._train_loader = self._setup_loader(train, "train_dataloaders")
        self._val_loader = self._setup_loader(val, "val_dataloaders")
        self.num_training_batches = _num_batches(self._train_loader, self.limit_train_batches)
        self._setup_model(model, need_optimizer=True)
        path = resolve_ckpt_path(ckpt_path, self.checkpoint_dir)
        if path is not None:
            self._restore(path)
        self._fit_loop()

    def _fit_loop(self) -> None:
        model = self._module
        self._call("on_fit_start")
        switch_epoch = finetune_start_epoch(self.max_epochs, self.fp32_finetune_epochs)
        try:
            while not self._done():
                if switch_epoch is not None and self.current_epoch >= switch_epoch and self.precision != "32-true":
                    self._switch_to_fp32()
                if not self._train_epoch():
                    break  # max_steps (or should_stop) mid-epoch: no epoch end, position stays inside it
                self.current_epoch += 1
                self._position = (self.current_epoch, 0)
                self._resume_batch_idx = 0
                if self.should_stop:  # set by a callback (e.g. early stopping) during the epoch
                    break
            if self.enable_checkpointing and self.global_step > 0:
                self.save_checkpoint(self.checkpoint_dir / "last.ckpt")
        except BaseException as exc:  # noqa: BLE001 - callbacks see every failure, then it propagates
            for cb in self.callbacks:
                hook = getattr(cb, "on_exception", None)
                if hook is not None:
                    hook(self, model, exc)
            raise
        finally:
            self._finalize_loggers()
        self._call("on_fit_end")

    def _done(self) -> bool:
        if self.max_steps > 0 and self.global_step >= self.max_steps:
            return True
        return self.max_epochs >= 0 and self.current_epoch >= self.max_epochs

    def _switch_to_fp32(self) -> None:
        self._precision = switch_to_fp32(self._precision, self._module, self._optimizer)
        self.precision = self._precision.name
        self.loss_scaler = None
        if self.world_size > 1:
            # DDP's gradient buckets were built for the old dtypes: wrap the module again.
            self._wrapped = self.fabric.setup_module(self._module)
            ModuleBridge.attach(self._module, self)
        log.info("epoch %d: switched to 32-true for the last %d epoch(s)", self.current_epoch, self.fp32_finetune_epochs)
        self.log_metrics({"precision_is_fp32": 1.0})

    def _train_epoch(self) -> bool:
        """One epoch (or its rest, after a resume); False if max_steps stopped it part-way."""
        model, wrapped, precision = self._module, self._wrapped, self._precision
        model.train()
        resume_at = self._resume_batch_idx
        it = self._epoch_iterator(resume_at)
        n, accum = self.num_training_batches, self.accumulate_grad_batches
        window_loss, window_start, window_samples = None, time.perf_counter(), 0
        for batch_idx in range(resume_at, n):
            try:
                batch = next(it)
            except StopIteration:
                break
            window_len = min(accum, n - (batch_idx - batch_idx % accum))  # a partial window at epoch end
            is_last = (batch_idx % accum == accum - 1) or batch_idx == n - 1
            if batch_idx % accum == 0:
                window_loss, window_start, window_samples = None, time.perf_counter(), 0
            batch = self._prepare_batch(batch)
            window_samples += _batch_size(batch)
            self._call("on_train_batch_start", batch, batch_idx)
            self.metrics.stage = "train"
            # DDP all-reduces gradients only on the window's last micro-batch.
            with self.fabric.no_backward_sync(wrapped, enabled=not is_last):
                with precision.forward_context():
                    out = wrapped.training_step(batch, batch_idx)
                loss = _extract_loss(out, batch_idx)
                precision.backward(loss / window_len, self.loss_scaler)
            detached = loss.detach().float()
            window_loss = detached / window_len if window_loss is None else window_loss + detached / window_len
            if is_last:
                self._finish_window(batch_idx, window_loss, window_samples, window_start)
            self._call("on_train_batch_end", {"loss": detached}, batch, batch_idx)
            hit_max = is_last and self.max_steps > 0 and self.global_step >= self.max_steps
            if (hit_max or (is_last and self.should_stop)) and batch_idx + 1 < n:
                self.should_stop = True
                self._check_nonfinite(force=True)
                return False
        self._check_nonfinite(force=True)
        if self._val_loader is not None and (self.current_epoch + 1) % self.check_val_every_n_epoch == 0:
            self._run_validation(self._val_loader)
            model.train()
        self._call("on_train_epoch_end")
        self._step_schedulers("epoch")
        return True

    def _epoch_iterator(self, resume_at: int):
        """The epoch's batch iterator, advanced past ``resume_at`` batches after a resume."""
        loader = self._train_loader
        for s in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
            if hasattr(s, "set_epoch"):
                s.set_epoch(self.current_epoch)
        if resume_at == 0:
            # The shuffle order is drawn from these states when the iterator starts: keep
            # them so a resume can rebuild the same order (checkpoint "epoch_start_rng").
            self._epoch_start_rng = [mdist.rng_state()]
        else:
            mdist.set_rng_state(self._epoch_start_rng[0])
        self._call("on_train_epoch_start")
        it = iter(loader)
        if resume_at:
            for _ in range(resume_at):  # replay the order up to the checkpoint, without training
                next(it)
            mdist.set_rng_state(self._rng_at_save)  # dropout etc. continue exactly where they stopped
        return it

    def _prepare_batch(self, batch):
        batch = self._precision.convert_input(self.fabric.to_device(batch))
        if self.channels_last and isinstance(batch, (list, tuple)) and batch and getattr(batch[0], "dim", lambda: 0)() == 4:
            batch = type(batch)([batch[0].contiguous(memory_format=torch.channels_last), *batch[1:]])
        return batch

    def _finish_window(self, batch_idx: int, window_loss, window_samples: int, window_start: float) -> None:
        """The window's optimizer step and everything that follows it."""
        grad_norm, found_inf = self._optimizer_step()
        self.global_step += 1
        self._check_nonfinite()  # before zero_grad: the error names the non-finite parameter
        self._step_schedulers("step")
        self._after_step(window_loss, grad_norm, found_inf, window_samples, window_start)
        self._precision.zero_grad(self._optimizer, self._module)
        self._position = (self.current_epoch, batch_idx + 1)
        if self.checkpoint_every_n_steps and self.global_step % self.checkpoint_every_n_steps == 0:
            self._save_periodic(batch_idx + 1)

    def _optimizer_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, inf check, clip, step (or skip), scaler update: no host sync on fused paths."""
        def before_step(found_inf):
            self.found_inf = found_inf
            self._call("on_before_optimizer_step", self._optimizer)

        grad_norm, found_inf = self._precision.optimizer_step(
            self._optimizer, self.loss_scaler, self.gradient_clip_val, before_step, self._sync_found_inf
        )
        self.found_inf = found_inf
        auto = self._precision.auto
        if auto is not None and self._syncs_now():
            for name, module in auto.poll():
                self._precision.promote_module(module, self._optimizer)
                log.warning("auto_fp32_fallback: module %r produced inf/NaN; it runs in fp32 from step %d on", name, self.global_step + 1)
        return grad_norm, found_inf

    def _syncs_now(self) -> bool:
        """Host reads are free on the CPU and already paid by optimizers that sync each step."""
        if self.fabric.device.type == "cpu":
            return True
        if self.loss_scaler is not None and not accepts_device_found_inf(self._optimizer):
            return True
        return self.global_step % self.log_every_n_steps == 0

    def _check_nonfinite(self, force: bool = False) -> None:
        scaler = self.loss_scaler
        if scaler is None or not (force or self._syncs_now()):
            return
        skips = int(scaler.consecutive_skips_tensor.item())
        if skips < scaler.max_consecutive_skips:
            return
        culprit = next(
            (n for n, g in self._precision.unscaled_grads(self._module).items() if not bool(torch.isfinite(g).all())),
            "none found in the last step's grads (the loss itself may be non-finite)",
        )
        raise NonFiniteError(
            f"{skips} optimizer steps in a row had non-finite gradients (max_consecutive_skips="
            f"{scaler.max_consecutive_skips}); training stopped at step {self.global_step} with loss scale "
            f"{scaler.scale:g} (min_scale={scaler.min_scale:g}). First non-finite parameter: {culprit}. "
            f"Check the data and the learning rate, or run with precision='bf16-master' / fp32_fallback for the "
            f"offending op (mptrain.numerics.compare_layerwise shows where precision is lost)."
        )

    def _after_step(self, window_loss, grad_norm, found_inf, samples, start) -> None:
        self.metrics.record_step({"train/loss": window_loss, "grad_norm": grad_norm})
        if self.global_step % self.log_every_n_steps != 0:
            return
        elapsed = max(time.perf_counter() - start, 1e-9)
        metrics = dict(self.metrics.pending_train())
        metrics["train/loss"] = window_loss
        metrics["grad_norm"] = grad_norm
        metrics["lr"] = self._optimizer.param_groups[0]["lr"]
        metrics["samples_per_sec"] = samples * self.world_size / elapsed
        metrics["epoch"] = self.current_epoch
        metrics["precision_is_fp32"] = float(self.precision == "32-true")
        if self.loss_scaler is not None:
            metrics["loss_scale"] = self.loss_scaler.scale_tensor
            metrics["skipped_steps"] = self.loss_scaler._total_skips
        if self.fabric.device.type == "cuda":
            metrics["cuda_mem_gb"] = torch.cuda.max_memory_allocated(self.fabric.device) / 2**30
        self.log_metrics(metrics)

    def _step_schedulers(self, interval: str) -> None:
        for cfg in self._schedulers:
            if cfg.interval != interval:
                continue
            count = self.global_step if interval == "step" else self.current_epoch + 1
            if count % cfg.frequency:
                continue
            if cfg.monitor is not None:
                if cfg.monitor not in self.callback_metrics:
                    raise KeyError(
                        f"lr_scheduler monitors {cfg.monitor!r}, which was not logged; logged: {sorted(self.callback_metrics)}"
                    )
                cfg.scheduler.step(self.callback_metrics[cfg.monitor])
            else:
                cfg.scheduler.step()

    # ------------------------------------------------------------------ validation
    def validate(self, model, dataloaders=None, datamodule=None) -> list[dict]:
        """Run the validation loop once; returns ``[{metric: value}]`` averaged over the data."""
        self._launch()
        _, val = self._resolve_data(model, None, dataloaders, datamodule, "validate")
        if val is None:
            raise ValueError("validate needs data: pass dataloaders, a datamodule, or define val_dataloader()")
        self._setup_model(model, need_optimizer=False)
        results = self._run_validation(self._setup_loader(val, "dataloaders"))
        self._finalize_loggers()
        return [results]

    @torch.no_grad()
    def _run_validation(self, loader) -> dict:
        model, wrapped, precision = self._module, self._wrapped, self._precision
        if not _overrides(model, "validation_step"):
            return {}
        was_training = model.training
        model.eval()
        self._call("on_validation_epoch_start")
        self.metrics.start_validation()
        n = _num_batches(loader, self.limit_val_batches)
        self.num_val_batches = n
        for batch_idx, batch in enumerate(loader):
            if batch_idx >= n:
                break
            batch = precision.convert_input(self.fabric.to_device(batch))
            self.metrics.current_batch_size = _batch_size(batch)  # weights the epoch mean, as Lightning
            with precision.forward_context():
                wrapped.validation_step(batch, batch_idx)
        results = self.metrics.end_validation(self.fabric)
        # Values logged in on_validation_epoch_end belong to this validation, not the next train step.
        self.metrics.stage = "val_end"
        self._call("on_validation_epoch_end")
        results.update(self.metrics.take_epoch_end())
        self.metrics.stage = "train"
        if results:
            self.log_metrics(results)
        model.train(was_training)
        return results

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_state(self, batch_idx: int, epoch: int) -> dict:
        precision = self._precision
        opt = self._optimizer
        weights = (
            precision.fp32_state_dict(self._module, opt)
            if precision.has_master_weights
            else precision.fp32_state_dict(self._module)
        )
        state = {
            "format": FORMAT_VERSION,
            "mptrain_version": _version(),
            "state_dict": weights,
            "optimizer": opt.state_dict() if opt is not None else {},
            "lr_schedulers": [c.scheduler.state_dict() for c in self._schedulers],
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "rng": mdist.gather_objects(mdist.rng_state()),
            "epoch_start_rng": mdist.gather_objects(self._epoch_start_rng[0] if self._epoch_start_rng else mdist.rng_state()),
            "epoch": epoch,
            "global_step": self.global_step,
            "batch_idx": batch_idx,
            "precision": self.precision,
            "initial_precision": self._initial_precision,
            "precision_state": precision.state_dict(),
            "world_size": self.world_size,
            "callbacks": {},
        }
        for cb in self.callbacks:
            if hasattr(cb, "state_dict") and cb.state_dict():
                state["callbacks"][getattr(cb, "state_key", type(cb).__qualname__)] = cb.state_dict()
        self._call("on_save_checkpoint", state)
        return state

    def save_checkpoint(self, path: str | os.PathLike, batch_idx: Optional[int] = None) -> None:
        """Write a full-resume checkpoint (rank 0 writes; every rank contributes its RNG state).

        The position saved is where training resumes: (epoch, batches of it already trained).
        """
        epoch, done = self._position if batch_idx is None else (self.current_epoch, batch_idx)
        state = self._checkpoint_state(done, epoch)
        if self.is_global_zero:
            save_checkpoint(state, path)
        self.fabric.barrier()

    def _save_periodic(self, batch_idx: int) -> None:
        if not self.enable_checkpointing:
            return
        path = self.checkpoint_dir / f"step-{self.global_step}.ckpt"
        self.save_checkpoint(path, batch_idx=batch_idx)
        if self.is_global_zero:
            link_or_copy_atomic(path, self.checkpoint_dir / "last.ckpt")

    def _restore(self, path: Path) -> None:
        state = load_checkpoint(path)
        if state["initial_precision"] != self._initial_precision:
            raise ValueError(
                f"checkpoint {str(path)!r} was trained with precision={state['initial_precision']!r}, "
                f"this Trainer has {self._initial_precision!r}; resume with the same precision"
            )
        if state["precision"] == "32-true" and self.precision != "32-true":
            self._switch_to_fp32()
        promoted = state.get("precision_state", {}).get("promoted", [])
        if promoted and self._precision.auto is not None:
            modules = dict(self._module.named_modules())
            for name in promoted:
                if name in modules and name not in self._precision.auto.promoted:
                    self._precision.auto.promoted.add(name)
                    self._precision.promote_module(modules[name], self._optimizer)
        try:
            self._precision.load_fp32_state_dict(self._module, state["state_dict"], self._optimizer)
        except RuntimeError as e:
            raise RuntimeError(f"checkpoint {str(path)!r} does not fit this model: {e}") from None
        if self._optimizer is not None and state["optimizer"]:
            self._optimizer.load_state_dict(state["optimizer"])
        for cfg, s in zip(self._schedulers, state.get("lr_schedulers", [])):
            cfg.scheduler.load_state_dict(s)
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.global_step = int(state["global_step"])
        self.current_epoch = int(state["epoch"])
        self._resume_batch_idx = int(state["batch_idx"])
        self._position = (self.current_epoch, self._resume_batch_idx)
        rank = self.global_rank
        rngs, starts = state["rng"], state["epoch_start_rng"]
        self._rng_at_save = rngs[rank] if rank < len(rngs) else rngs[0]
        self._epoch_start_rng = [starts[rank] if rank < len(starts) else starts[0]]
        if self._resume_batch_idx == 0:
            mdist.set_rng_state(self._rng_at_save)
        for cb in self.callbacks:
            key = getattr(cb, "state_key", type(cb).__qualname__)
            if key in state.get("callbacks", {}) and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(state["callbacks"][key])
        self._call("on_load_checkpoint", state)

    # ------------------------------------------------------------------ helpers
    def _call(self, hook: str, *args) -> None:
        """The LightningModule's own hook first (as Lightning does), then every callback's."""
        module_hook = getattr(self._module, hook, None) if self._module is not None else None
        if callable(module_hook):
            module_hook(*args)
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, self._module, *args)

    def _finalize_loggers(self) -> None:
        if self.is_global_zero:
            for lg in self.loggers:
                try:
                    lg.save()
                except Exception:  # noqa: BLE001 - a logger failing to flush must not hide the real error
                    log.exception("logger %s failed to save", type(lg).__name__)


# ---------------------------------------------------------------------- module-level helpers
def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def _check_module(model: Any) -> None:
    missing = [m for m in ("training_step", "configure_optimizers") if not callable(getattr(model, m, None))]
    if not isinstance(model, nn.Module) or missing:
        raise TypeError(
            f"Trainer expects a lightning.LightningModule (an nn.Module with training_step and "
            f"configure_optimizers); got {type(model).__name__}" + (f" missing {missing}" if missing else "")
        )


def _overrides(obj: Any, name: str) -> bool:
    """True if ``obj`` defines ``name`` itself rather than inheriting Lightning's placeholder."""
    fn = getattr(type(obj), name, None)
    if fn is None:
        return False
    for base in type(obj).__mro__:
        if name in base.__dict__:
            return not base.__module__.startswith(("lightning.", "pytorch_lightning."))
    return False


def _num_batches(loader, limit: Optional[int]) -> int:
    try:
        n = len(loader)
    except TypeError:
        if limit is None:
            raise ValueError("the dataloader has no length (an IterableDataset): set limit_train_batches / limit_val_batches") from None
        n = limit
    return n if limit is None else min(n, int(limit))


def _extract_loss(out: Any, batch_idx: int) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(
            f"training_step (batch {batch_idx}) must return a scalar loss tensor or a dict with 'loss'; got "
            f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}"
        )
    if not loss.requires_grad:
        raise RuntimeError(f"training_step (batch {batch_idx}) returned a loss that does not require grad")
    return loss


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    return 1


def _version() -> str:
    from mptrain import __version__

    return __version__
