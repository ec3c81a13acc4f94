"""The non-finite guard of every mode: a step with an inf/NaN loss or gradient is skipped, and
``max_consecutive_skips`` in a row raise :class:`NonFiniteError`.  The device counters are read on the CPU,
where the step synced anyway, or (CUDA) from a pinned copy made every ``check_every`` steps once it has
landed: the run never waits for the GPU and stops at most a few steps late.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from mptrain.precision.loss_scaler import NonFiniteError


class NonFiniteGuard:
    """Device counters of skipped steps and the lazy ``max_consecutive_skips`` check."""

    def __init__(self, max_consecutive_skips: int = 100):
        if int(max_consecutive_skips) < 1:
            raise ValueError(f"max_consecutive_skips={max_consecutive_skips!r} must be >= 1")
        self.max_consecutive_skips = int(max_consecutive_skips)
        # A GPU run reads the counter at most every check_every steps: it raises at most that late.
        self.check_every = max(1, min(25, self.max_consecutive_skips // 4))
        self.consecutive = torch.zeros((), dtype=torch.int32)
        self.total = torch.zeros((), dtype=torch.int64)
        self.steps = 0  # optimizer steps seen (host counter, no sync)
        self.free_reads: Optional[bool] = None  # None: reads are free on the CPU only
        self._snapshot: Optional[tuple[torch.Tensor, "torch.cuda.Event"]] = None  # (pinned copy, its event)

    def update(self, found_inf: torch.Tensor) -> None:
        """After a step: count it as skipped when ``found_inf`` is set (device ops only)."""
        self.consecutive, self.total = self.consecutive.to(found_inf.device), self.total.to(found_inf.device)
        bad = found_inf.reshape(()) != 0
        self.consecutive.copy_(torch.where(bad, self.consecutive + 1, torch.zeros_like(self.consecutive)))
        self.total.add_(bad.to(torch.int64))
        self.steps += 1

    def check(self, describe: Callable[[int], str], synced: bool = False) -> None:
        """Raise :class:`NonFiniteError` (message from ``describe(skips)``) once ``max_consecutive_skips`` is reached.
        ``synced``: the step already read the device."""
        free = self.consecutive.device.type == "cpu" if self.free_reads is None else self.free_reads
        if synced or free:
            self._raise_at(int(self.consecutive.item()), describe)
            return
        if self._snapshot is not None and self._snapshot[1].query():
            skips = int(self._snapshot[0])
            self._snapshot = None
            self._raise_at(skips, describe)
        if self.steps % self.check_every != 0:
            return
        if self.consecutive.device.type != "cuda":
            self._raise_at(int(self.consecutive.item()), describe)  # one read every check_every steps
        elif self._snapshot is None and not torch.cuda.is_current_stream_capturing():
            host = torch.empty((), dtype=self.consecutive.dtype, pin_memory=True)
            host.copy_(self.consecutive, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._snapshot = (host, event)

    def _raise_at(self, skips: int, describe: Callable[[int], str]) -> None:
        if skips >= self.max_consecutive_skips:
            raise NonFiniteError(describe(skips))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_snapshot": None}  # a CUDA event does not pickle; the next check takes another

    def __setstate__(self, state: dict) -> None:
        # Unpickled in a spawned process (ddp_spawn): torch shares pickled CPU tensors through shared
        # memory, which would make every rank count into the same counters. Each gets its own.
        self.__dict__.update(state)  # without its snapshot (see __getstate__)
        self.consecutive, self.total = self.consecutive.clone(), self.total.clone()

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive.detach().cpu().clone(), "total": self.total.detach().cpu().clone(),
                "max_consecutive_skips": self.max_consecutive_skips, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        dev = self.consecutive.device
        self.consecutive = state["consecutive"].to(dev, torch.int32).clone()
        self.total = state["total"].to(dev, torch.int64).clone()
        self.steps = int(state.get("steps", 0))
