"""Progress on rank 0: a rich progress bar (loss, loss scale, throughput, ETA) on a terminal,
plain periodic lines when stdout is a file or a pipe (CI logs, Slurm, torchrun).

Reading the loss or the scale is a host-device sync, so values are read only when the display
refreshes (at most every ``refresh_s`` seconds on a terminal, every ``every_n_steps`` steps
otherwise), never per step.

For language batches the bar also logs ``tokens_per_sec`` next to the Trainer's
``samples_per_sec`` (same window, times the tokens per sample) at the Trainer's logging steps.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Optional

import torch

from mptrain.callbacks import Callback


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


def _tokens(batch: Any) -> Optional[int]:
    """Tokens in a language batch (a dict with input_ids, or an integer (B, T) tensor first)."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel()
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return first.numel()
    return None


def _samples(batch: Any) -> int:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()), None)
    if isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    return batch.shape[0] if isinstance(batch, torch.Tensor) and batch.dim() else 1


class ProgressBar(Callback):
    """Args:
        every_n_steps: plain-mode line interval in optimizer steps (default: the trainer's log_every_n_steps).
        refresh_s: terminal refresh interval.
        stream: where to write (default sys.stdout); its ``isatty()`` picks the mode.
        force_plain: plain lines even on a terminal.
    """

    def __init__(self, every_n_steps: Optional[int] = None, refresh_s: float = 0.5, stream=None,
                 force_plain: bool = False):
        self.every_n_steps, self.refresh_s, self.force_plain = every_n_steps, refresh_s, force_plain
        self._stream = stream
        self._progress = None
        self._enabled = False

    @property
    def stream(self):
        return self._stream if self._stream is not None else sys.stdout

    # -- lifecycle -----------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        self._enabled = bool(getattr(trainer, "is_global_zero", True))
        if not self._enabled:
            return
        self.total = self._total_steps(trainer)
        self.interval = self.every_n_steps or getattr(trainer, "log_every_n_steps", 50)
        self._t0 = self._last_t = time.perf_counter()
        self._step0 = self._last_step = trainer.global_step
        self._samples = self._tokens = 0
        self._last_samples = self._last_tokens = 0
        self._loss = None
        self._progress = self._start_rich(trainer) if self._rich_wanted() else None

    def _rich_wanted(self) -> bool:
        if self.force_plain or not hasattr(self.stream, "isatty") or not self.stream.isatty():
            return False
        try:
            import rich  # noqa: F401
        except ImportError:
            return False
        return True

    def _start_rich(self, trainer):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[stats]}"),
            console=Console(file=self.stream), transient=False,
        )
        progress.start()
        self._task = progress.add_task("train", total=self.total or None, completed=trainer.global_step,
                                       epoch=trainer.current_epoch, stats="")
        self._last_refresh = 0.0
        return progress

    @staticmethod
    def _total_steps(trainer) -> Optional[int]:
        try:
            total = int(trainer.estimated_stepping_batches)
        except (AttributeError, TypeError, ValueError, OverflowError):
            return None
        return total if total > 0 else None

    # -- per batch -----------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._enabled:
            return
        samples = _samples(batch)
        self._samples += samples
        tokens = _tokens(batch)
        step = trainer.global_step
        if tokens is not None:
            self._tokens += tokens
            self._log_tokens(trainer, step, tokens / max(samples, 1))
        if isinstance(outputs, dict):
            self._loss = outputs.get("loss")
        if self._progress is not None:
            now = time.perf_counter()
            if now - self._last_refresh >= self.refresh_s or (self.total and step >= self.total):
                self._last_refresh = now
                self._progress.update(self._task, completed=step, epoch=trainer.current_epoch,
                                      stats=self._stats(trainer, now))
        elif step != self._last_step and (step % self.interval == 0 or (self.total and step >= self.total)):
            self._print_line(trainer)

    def _log_tokens(self, trainer, step: int, tokens_per_sample: float) -> None:
        every = getattr(trainer, "log_every_n_steps", None)
        if not every or step == 0 or step % every or step == getattr(self, "_tokens_logged_at", None):
            return
        self._tokens_logged_at = step
        sps = trainer.callback_metrics.get("samples_per_sec")  # the Trainer just logged it (host value)
        if sps is not None and hasattr(trainer, "log_metrics"):
            trainer.log_metrics({"tokens_per_sec": float(sps) * tokens_per_sample}, step=step)

    def _rates(self, now: float) -> tuple[float, Optional[float]]:
        dt = max(now - self._last_t, 1e-9)
        samples = (self._samples - self._last_samples) / dt
        tokens = (self._tokens - self._last_tokens) / dt if self._tokens else None
        self._last_t, self._last_samples, self._last_tokens = now, self._samples, self._tokens
        return samples, tokens

    def _stats(self, trainer, now: float) -> str:
        world = getattr(trainer, "world_size", 1)
        samples, tokens = self._rates(now)
        parts = []
        if self._loss is not None:
            parts.append(f"loss {float(self._loss):.4f}")
        scaler = getattr(trainer, "loss_scaler", None)
        if scaler is not None:
            parts.append(f"scale {scaler.scale:g}")
        parts.append(f"{samples * world:,.0f} samples/s")
        if tokens is not None:
            parts.append(f"{tokens * world:,.0f} tok/s")
        return "  ".join(parts)

    def _print_line(self, trainer) -> None:
        now = time.perf_counter()
        step = trainer.global_step
        done = step - self._step0
        elapsed = now - self._t0
        eta = (self.total - step) * elapsed / done if self.total and done > 0 else float("nan")
        total = f"/{self.total}" if self.total else ""
        print(f"epoch {trainer.current_epoch} step {step}{total}  {self._stats(trainer, now)}  "
              f"elapsed {_fmt_time(elapsed)} eta {_fmt_time(eta)}", file=self.stream, flush=True)
        self._last_step = step

    # -- epoch ends -------------------------------------------------------------
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not self._enabled:
            return
        metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val")}
        if not metrics:
            return
        line = f"epoch {trainer.current_epoch} validation: " + "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.stream, flush=True)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
