"""Dynamic loss scaling with hysteresis, kept on the device.

Every decision (skip, back off, grow) is a handful of tensor ops on the device that
holds the gradients, so a training step never waits for the host: ``.item()`` is
only called when someone asks for ``.scale`` (logging) or when the caller checks
``consecutive_skips`` at a point where it syncs anyway.
"""
from __future__ import annotations


import torch


class NonFiniteError(RuntimeError):
    """Raised when training cannot make progress: too many non-finite steps in a row."""


_DEFAULTS = dict(
    init_scale=2.0**16,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2000,
    hysteresis=2,
    min_scale=1.0,
    max_scale=2.0**24,
    max_consecutive_skips=100,
)


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

    def __init__(
        self,
        init_scale: float = _DEFAULTS["init_scale"],
        growth_factor: float = _DEFAULTS["growth_factor"],
        backoff_factor: float = _DEFAULTS["backoff_factor"],
        growth_interval: int = _DEFAULTS["growth_interval"],
        hysteresis: int = _DEFAULTS["hysteresis"],
        min_scale: float = _DEFAULTS["min_scale"],
        max_scale: float = _DEFAULTS["max_scale"],
        max_consecutive_skips: int = _DEFAULTS["max_consecutive_skips"],
        device: torch.device | str = "cpu",
    ):
        checks = [
            ("init_scale", init_scale > 0, "> 0"),
            ("growth_factor", growth_factor >= 1.0, ">= 1.0"),
            ("backoff_factor", 0.0 < backoff_factor <= 1.0, "in (0, 1]"),
            ("growth_interval", int(growth_interval) >= 1, ">= 1"),
            ("hysteresis", int(hysteresis) >= 1, ">= 1"),
            ("min_scale", min_scale > 0, "> 0"),
            ("max_scale", max_scale >= min_scale, ">= min_scale"),
            ("max_consecutive_skips", int(max_consecutive_skips) >= 1, ">= 1"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"DynamicLossScaler: {name}={locals().get(name, '?')!r} must be {want}")
        if not (min_scale <= init_scale <= max_scale):
            raise ValueError(
                f"DynamicLossScaler: init_scale={init_scale} must lie in [min_scale={min_scale}, max_scale={max_scale}]"
            )
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.max_consecutive_skips = int(max_consecutive_skips)
        self._init_scale = float(init_scale)
        self._alloc(torch.device(device))

    def _alloc(self, device: torch.device) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self._scale = torch.full((), self._init_scale, **f32)
        self._growth_tracker = torch.zeros((), **i32)
        self._hysteresis_tracker = torch.full((), self.hysteresis, **i32)
        self._consecutive_skips = torch.zeros((), **i32)
        self._total_skips = torch.zeros((), dtype=torch.int64, device=device)

    @classmethod
    def from_spec(cls, spec: "DynamicLossScaler | dict | None", device: torch.device | str = "cpu") -> "DynamicLossScaler":
        """Build from a DynamicLossScaler, a dict of its arguments, or None (defaults)."""
        if isinstance(spec, DynamicLossScaler):
            spec.to(device)
            return spec
        if spec is None or spec is True:
            return cls(device=device)
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - set(_DEFAULTS))
            if unknown:
                raise ValueError(f"loss_scaler: unknown key(s) {unknown}; valid keys: {sorted(_DEFAULTS)}")
            return cls(**spec, device=device)
        raise TypeError(f"loss_scaler must be None, a DynamicLossScaler or a dict of its arguments, got {type(spec).__name__}")

    # -- device state ----------------------------------------------------
    _STATE = ("_scale", "_growth_tracker", "_hysteresis_tracker", "_consecutive_skips", "_total_skips")

    def __setstate__(self, state: dict) -> None:
        # Unpickled in a spawned process (ddp_spawn): torch shares pickled CPU tensors through shared
        # memory, which would make every rank update the same scale. Each rank gets its own copy.
        self.__dict__.update(state)
        for name in self._STATE:
            setattr(self, name, getattr(self, name).clone())

    def to(self, device: torch.device | str) -> "DynamicLossScaler":
        device = torch.device(device)
        for name in self._STATE:
            setattr(self, name, getattr(self, name).to(device))
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
    def consecutive_skips_tensor(self) -> torch.Tensor:
        return self._consecutive_skips

    @property
    def hysteresis_left(self) -> int:
        return int(self._hysteresis_tracker.item())

    @property
    def growth_tracker(self) -> int:
        return int(self._growth_tracker.item())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale.to(loss.dtype) if loss.dtype == torch.float32 else loss.float() * self._scale

    def inv_scale(self) -> torch.Tensor:
        return (1.0 / self._scale).to(torch.float32)

    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the state after a step; ``found_inf`` is a device tensor (nonzero = overflow).

        All branches are computed with ``torch.where`` so nothing leaves the device.
        """
        inf = found_inf.reshape(()).to(device=self.device) != 0
        one = torch.ones((), dtype=torch.int32, device=self.device)
        # Overflow: hysteresis counts down, growth restarts, the scale backs off at zero.
        hyst_after_inf = self._hysteresis_tracker - one
        backoff = inf & (hyst_after_inf <= 0)
        # Clean step: growth counts up; at the interval the scale grows and hysteresis resets.
        growth_after_clean = self._growth_tracker + one
        grow = (~inf) & (growth_after_clean >= self.growth_interval)

        new_scale = torch.where(backoff, torch.clamp(self._scale * self.backoff_factor, min=self.min_scale), self._scale)
        new_scale = torch.where(grow, torch.clamp(new_scale * self.growth_factor, max=self.max_scale), new_scale)
        new_hyst = torch.where(inf, torch.clamp(hyst_after_inf, min=0), self._hysteresis_tracker)
        new_hyst = torch.where(grow, torch.full_like(new_hyst, self.hysteresis), new_hyst)
        new_growth = torch.where(inf | grow, torch.zeros_like(growth_after_clean), growth_after_clean)

        self._scale.copy_(new_scale)
        self._hysteresis_tracker.copy_(new_hyst)
        self._growth_tracker.copy_(new_growth)
        self._consecutive_skips.copy_(torch.where(inf, self._consecutive_skips + one, torch.zeros_like(one)))
        self._total_skips.add_(inf.to(torch.int64))

    # -- persistence -----------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "scale": self._scale.detach().cpu().clone(),
            "growth_tracker": self._growth_tracker.detach().cpu().clone(),
            "hysteresis_tracker": self._hysteresis_tracker.detach().cpu().clone(),
            "consecutive_skips": self._consecutive_skips.detach().cpu().clone(),
            "total_skips": self._total_skips.detach().cpu().clone(),
            "config": {k: getattr(self, k) for k in _DEFAULTS if k != "init_scale"} | {"init_scale": self._init_scale},
        }

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in ("scale", "growth_tracker", "hysteresis_tracker") if k not in state]
        if missing:
            raise KeyError(f"DynamicLossScaler.load_state_dict: missing key(s) {missing}")
        config = state.get("config")
        if config is not None:  # the configuration the state was saved with (issue 12 item 6)
            unknown = sorted(set(config) - set(_DEFAULTS))
            if unknown:
                raise KeyError(f"DynamicLossScaler.load_state_dict: unknown config key(s) {unknown}")
            for k, v in config.items():
                if k == "init_scale":
                    self._init_scale = float(v)
                else:
                    setattr(self, k, type(_DEFAULTS[k])(v))
        dev = self.device
        self._scale = state["scale"].to(dev, torch.float32).clone()
        self._growth_tracker = state["growth_tracker"].to(dev, torch.int32).clone()
        self._hysteresis_tracker = state["hysteresis_tracker"].to(dev, torch.int32).clone()
        self._consecutive_skips = state.get("consecutive_skips", torch.zeros((), dtype=torch.int32)).to(dev, torch.int32).clone()
        self._total_skips = state.get("total_skips", torch.zeros((), dtype=torch.int64)).to(dev, torch.int64).clone()

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self._scale.item():g}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis}, min_scale={self.min_scale:g}, max_scale={self.max_scale:g})"
        )
