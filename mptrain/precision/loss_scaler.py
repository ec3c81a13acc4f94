"""Dynamic loss scaling with hysteresis, kept on the device: ``.item()`` runs only when ``.scale`` is read."""
from __future__ import annotations

import inspect

import torch


class NonFiniteError(RuntimeError):
    """Raised when training cannot make progress: too many non-finite steps in a row."""


class DynamicLossScaler:
    """Scale the loss so fp16 gradients stay representable; back off on overflow.

    Args:
        init_scale: the first scale.
        growth_factor: the scale is multiplied by this after ``growth_interval`` clean steps.
        backoff_factor: the scale is multiplied by this when the hysteresis counter reaches 0.
        growth_interval: clean steps in a row before the scale grows.
        hysteresis: overflowing steps tolerated before the scale backs off; reset when the scale grows.
        min_scale: the scale never goes below this.
        max_scale: the scale never goes above this.
        max_consecutive_skips: after this many skipped steps in a row the Trainer raises
            :class:`NonFiniteError` (checked where the loop syncs with the host).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 2, min_scale: float = 1.0, max_scale: float = 2.0**24,
                 max_consecutive_skips: int = 100):
        config = {k: v for k, v in locals().items() if k != "self"}  # the arguments by name
        checks = [
            ("init_scale", init_scale > 0, "> 0"),
            ("growth_factor", growth_factor >= 1.0, ">= 1.0"),
            ("backoff_factor", 0.0 < backoff_factor <= 1.0, "in (0, 1]"),
            ("growth_interval", int(growth_interval) >= 1, ">= 1"),
            ("hysteresis", int(hysteresis) >= 1, ">= 1"),
            ("min_scale", min_scale > 0, "> 0"),
            ("max_scale", max_scale >= min_scale, ">= min_scale"),
            ("max_consecutive_skips", int(max_consecutive_skips) >= 1, ">= 1"),
            ("init_scale", min_scale <= init_scale <= max_scale, f"in [min_scale={min_scale}, max_scale={max_scale}]"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"DynamicLossScaler: {name}={config[name]!r} must be {want}")
        self._configure(config)
        self._scale = torch.full((), self._init_scale, dtype=torch.float32)
        self._growth_tracker = torch.zeros((), dtype=torch.int32)
        self._hysteresis_tracker = torch.full((), self.hysteresis, dtype=torch.int32)

    def _configure(self, config: dict) -> None:
        for k, v in config.items():
            value = type(_DEFAULTS[k])(v)
            if k == "init_scale":
                self._init_scale = value  # the configured start; ``scale`` is the live value
            else:
                setattr(self, k, value)

    @classmethod
    def from_spec(cls, spec: "DynamicLossScaler | dict | None") -> "DynamicLossScaler":
        """Build from a DynamicLossScaler, a dict of its arguments, or None (defaults)."""
        if isinstance(spec, DynamicLossScaler):
            return spec
        if spec is None or spec is True:
            return cls()
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - set(_DEFAULTS))
            if unknown:
                raise ValueError(f"loss_scaler: unknown key(s) {unknown}; valid keys: {sorted(_DEFAULTS)}")
            return cls(**spec)
        raise TypeError(f"loss_scaler must be None, a DynamicLossScaler or a dict of its arguments, "
                        f"got {type(spec).__name__}")

    # -- device state: name in the state dict -> attribute ----------
    _STATE = {"scale": "_scale", "growth_tracker": "_growth_tracker", "hysteresis_tracker": "_hysteresis_tracker"}

    def __setstate__(self, state: dict) -> None:
        # Unpickled in a spawned process (ddp_spawn): torch shares pickled CPU tensors through shared
        # memory, which would make every rank update the same scale. Each rank gets its own copy.
        self.__dict__.update(state)
        for attr in self._STATE.values():
            setattr(self, attr, getattr(self, attr).clone())

    def to(self, device: torch.device | str) -> "DynamicLossScaler":
        for attr in self._STATE.values():
            setattr(self, attr, getattr(self, attr).to(device))
        return self

    @property
    def device(self) -> torch.device:
        return self._scale.device

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The scale as a 0-dim fp32 device tensor (no sync)."""
        return self._scale

    @property
    def scale(self) -> float:
        """The current scale (syncs with the device)."""
        return float(self._scale.item())

    @property
    def hysteresis_left(self) -> int:
        return int(self._hysteresis_tracker.item())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self._scale

    def inv_scale(self) -> torch.Tensor:
        return (1.0 / self._scale).to(torch.float32)

    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the state after a step (``found_inf`` nonzero = overflow) with ``torch.where``: no host sync."""
        inf = found_inf.reshape(()).to(device=self.device) != 0
        # Overflow: hysteresis counts down, growth restarts, the scale backs off at zero.
        hyst_after_inf = self._hysteresis_tracker - 1
        backoff = inf & (hyst_after_inf <= 0)
        # Clean step: growth counts up; at the interval the scale grows and hysteresis resets.
        growth_after_clean = self._growth_tracker + 1
        grow = (~inf) & (growth_after_clean >= self.growth_interval)

        backed_off = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
        new_scale = torch.where(backoff, backed_off, self._scale)
        new_scale = torch.where(grow, torch.clamp(new_scale * self.growth_factor, max=self.max_scale), new_scale)
        new_hyst = torch.where(inf, torch.clamp(hyst_after_inf, min=0), self._hysteresis_tracker)
        new_hyst = torch.where(grow, torch.full_like(new_hyst, self.hysteresis), new_hyst)
        self._scale.copy_(new_scale)
        self._hysteresis_tracker.copy_(new_hyst)
        self._growth_tracker.copy_(torch.where(inf | grow, torch.zeros_like(growth_after_clean), growth_after_clean))

    def state_dict(self) -> dict:
        state = {key: getattr(self, attr).detach().cpu().clone() for key, attr in self._STATE.items()}
        config = {k: getattr(self, k) for k in _DEFAULTS if k != "init_scale"} | {"init_scale": self._init_scale}
        return state | {"config": config}

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in self._STATE if k not in state]
        if missing:
            raise KeyError(f"DynamicLossScaler.load_state_dict: missing key(s) {missing}")
        config = state.get("config")
        if config is not None:  # the configuration the state was saved with
            unknown = sorted(set(config) - set(_DEFAULTS))
            if unknown:
                raise KeyError(f"DynamicLossScaler.load_state_dict: unknown config key(s) {unknown}")
            self._configure(config)
        for key, attr in self._STATE.items():
            setattr(self, attr, state[key].to(self.device, getattr(self, attr).dtype).clone())

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self._scale.item():g}, growth_interval={self.growth_interval}, "
                f"hysteresis={self.hysteresis}, min_scale={self.min_scale:g}, max_scale={self.max_scale:g})")


#: the constructor's arguments and defaults (the keys a loss_scaler dict and a saved config may hold)
_DEFAULTS = {k: p.default for k, p in inspect.signature(DynamicLossScaler).parameters.items()}
