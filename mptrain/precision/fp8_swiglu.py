"""The SiLU x mul of a gated MLP writing its fp8 operands and their amaxes in one pass, forward and backward.

Ops ``torch.ops.mptrain.fp8_swiglu`` and ``fp8_swiglu_backward`` for the delayed recipe's fused MLP
(:mod:`.fp8_mlp`), whose casts have scales known before the step:

- ``fp8_swiglu(g, u, scale) -> (h, amax)``: ``h = silu(g) * u`` cast to e4m3 at ``scale`` (saturated), and
  ``amax(|silu(g) * u|)`` for the next steps' scales;
- ``fp8_swiglu_backward(dh, g, u, scale_g, scale_u) -> (dg, du, dg_t, du_t, amax_g, amax_u)``: the gradients of
  ``silu(g) * u`` with respect to g and u, each cast to e5m2 at its scale, row-major (the input-gradient GEMM's
  operand) and transposed (the weight-gradient GEMM's), and their amaxes.

Compiled, inductor fuses the delayed casts into the SiLU x mul and its backward but computes the amaxes in
reductions of their own that recompute the SiLU x mul, and writes the transposed copies in further kernels
(docs/fp8.md): these kernels read each bf16 operand once.  Math in fp32 (inductor's too; eager rounds the
intermediates to bf16).

On CUDA the kernels are Triton's (a tile of 64 x 64 elements per program; an amax is an atomic max over the
tiles' maxima).  They are Triton rather than ``csrc/`` CUDA because inductor, which runs the rest of the compiled
step, already depends on Triton, and the same source runs on the CPU under ``TRITON_INTERPRET=1`` in the tests.
Any other device, and CUDA without Triton, runs the reference below: the same values from torch ops.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Optional

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_TILE = 64


def _saturated(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    top = torch.finfo(dtype).max
    return (x * scale).clamp(-top, top).to(dtype)


def swiglu_reference(g: torch.Tensor, u: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.nn.functional.silu(g.float()) * u.float()
    return _saturated(h, scale, E4M3), h.abs().amax()


def swiglu_backward_reference(dh, g, u, scale_g, scale_u) -> tuple[torch.Tensor, ...]:
    g32, u32, dh32 = g.float(), u.float(), dh.float()
    sig = torch.sigmoid(g32)
    dg = dh32 * u32 * sig * (1 + g32 * (1 - sig))
    du = dh32 * g32 * sig
    dg8, du8 = _saturated(dg, scale_g, E5M2), _saturated(du, scale_u, E5M2)
    return dg8, du8, dg8.t().contiguous(), du8.t().contiguous(), dg.abs().amax(), du.abs().amax()


@functools.lru_cache(maxsize=None)
def triton_kernels() -> Optional[tuple[Any, Any]]:
    """The two Triton kernels (forward, backward, :mod:`.fp8_swiglu_kernels`), imported on first use; None without
    Triton."""
    try:
        from mptrain.precision import fp8_swiglu_kernels as K
    except ImportError:
        return None
    return K.forward, K.backward


def _kernels_for(t: torch.Tensor) -> Optional[tuple[Any, Any]]:
    """The Triton kernels for ``t``'s device: CUDA, or the CPU under ``TRITON_INTERPRET=1`` (the tests run them
    so); None: the reference."""
    run = t.device.type == "cuda" or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return triton_kernels() if run else None


def _grid(m: int, n: int) -> tuple[int, int]:
    return (m + _TILE - 1) // _TILE, (n + _TILE - 1) // _TILE


def _check(name: str, g: torch.Tensor, u: torch.Tensor, *others: torch.Tensor) -> None:
    if g.dim() != 2 or g.shape != u.shape or any(t.shape != g.shape for t in others):
        raise ValueError(f"mptrain.{name}: g, u{', dh' if others else ''} must be 2-D of one shape, got "
                         f"{[tuple(t.shape) for t in (g, u, *others)]}")


@torch.library.custom_op("mptrain::fp8_swiglu", mutates_args=())
def fp8_swiglu(g: torch.Tensor, u: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check("fp8_swiglu", g, u)
    kernels = _kernels_for(g)
    if kernels is None:
        return swiglu_reference(g, u, scale)
    g, u = g.contiguous(), u.contiguous()
    m, n = g.shape
    h = torch.empty((m, n), device=g.device, dtype=E4M3)
    amax = torch.zeros((), device=g.device, dtype=torch.float32)
    kernels[0][_grid(m, n)](g, u, h, scale.float(), amax, m, n, FP8_MAX=torch.finfo(E4M3).max, B=_TILE)
    return h, amax


@fp8_swiglu.register_fake
def _(g, u, scale):
    return g.new_empty(g.shape, dtype=E4M3), g.new_empty((), dtype=torch.float32)


@torch.library.custom_op("mptrain::fp8_swiglu_backward", mutates_args=())
def fp8_swiglu_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, scale_g: torch.Tensor,
                        scale_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                        torch.Tensor, torch.Tensor]:
    _check("fp8_swiglu_backward", g, u, dh)
    kernels = _kernels_for(g)
    if kernels is None:
        return swiglu_backward_reference(dh, g, u, scale_g, scale_u)
    dh, g, u = dh.contiguous(), g.contiguous(), u.contiguous()
    m, n = g.shape
    dg, du = (torch.empty((m, n), device=g.device, dtype=E5M2) for _ in range(2))
    dg_t, du_t = (torch.empty((n, m), device=g.device, dtype=E5M2) for _ in range(2))
    amax_g, amax_u = (torch.zeros((), device=g.device, dtype=torch.float32) for _ in range(2))
    kernels[1][_grid(m, n)](dh, g, u, dg, du, dg_t, du_t, scale_g.float(), scale_u.float(), amax_g, amax_u, m, n,
                            FP8_MAX=torch.finfo(E5M2).max, B=_TILE)
    return dg, du, dg_t, du_t, amax_g, amax_u


@fp8_swiglu_backward.register_fake
def _(dh, g, u, scale_g, scale_u):
    m, n = g.shape
    return (g.new_empty((m, n), dtype=E5M2), g.new_empty((m, n), dtype=E5M2), g.new_empty((n, m), dtype=E5M2),
            g.new_empty((n, m), dtype=E5M2), g.new_empty((), dtype=torch.float32),
            g.new_empty((), dtype=torch.float32))

