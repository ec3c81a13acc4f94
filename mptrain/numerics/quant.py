"""int8 quantization for inference-time evaluation (the ``int8-dynamic`` precision).

Weights are quantized once, activations on every call from their own range (no calibration
data, so ``evaluate_precisions`` can try it on any model).  The int8 product accumulates in
int32 (``torch._int_mm`` on CUDA, an integer matmul on the CPU) and is rescaled to float32 at
the end.  Zero points are folded into the int32 result with row and column sums, so both
operands stay int8, which is what the tensor cores take.
"""
from __future__ import annotations

import copy
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from mptrain.compat import torch as compat
from mptrain.numerics.layerwise import _call

QMIN, QMAX = -128, 127

SCHEMES = ("symmetric", "asymmetric")
WEIGHT_GRANULARITIES = ("per_channel", "per_tensor")
ACT_GRANULARITIES = ("per_token", "per_tensor")


@dataclass(frozen=True)
class QuantConfig:
    """How weights and activations are mapped to int8.

    weight / activation: "symmetric" (zero point 0, range [-127, 127]) or "asymmetric"
    (a zero point, range [-128, 127] covering [min, max]).
    weight_granularity: "per_channel" (one scale per output feature) or "per_tensor".
    activation_granularity: "per_token" (one scale per row of the flattened input) or "per_tensor".
    """

    weight: str = "symmetric"
    weight_granularity: str = "per_channel"
    activation: str = "symmetric"
    activation_granularity: str = "per_token"

    def __post_init__(self):
        _check_choice("weight", self.weight, SCHEMES)
        _check_choice("activation", self.activation, SCHEMES)
        _check_choice("weight_granularity", self.weight_granularity, WEIGHT_GRANULARITIES)
        _check_choice("activation_granularity", self.activation_granularity, ACT_GRANULARITIES)


def _check_choice(name: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"QuantConfig.{name}={value!r} is not one of {choices}")


def quantize(x: torch.Tensor, scheme: str = "symmetric", dim: Optional[int] = None):
    """Quantize ``x`` to int8 with one scale per slice along ``dim`` (None: one for all).

    Returns ``(q, scale, zero_point)`` with ``x ~= scale * (q - zero_point)``; ``scale``
    and ``zero_point`` keep ``dim`` as a size-1 axis so they broadcast against ``x``.
    ``zero_point`` is an int32 tensor of zeros for the symmetric scheme.
    """
    _check_choice("scheme", scheme, SCHEMES)
    xf = x.detach().float()
    reduce_dims = [d for d in range(xf.dim()) if dim is None or d != dim % xf.dim()]
    if scheme == "symmetric":
        amax = xf.abs().amax(dim=reduce_dims, keepdim=True) if reduce_dims else xf.abs()
        # An all-zero slice gets scale 1: its codes are 0 whatever the scale.
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.clamp(torch.round(xf / scale), -127, 127).to(torch.int8)
        return q, scale, torch.zeros_like(scale, dtype=torch.int32)
    lo = xf.amin(dim=reduce_dims, keepdim=True) if reduce_dims else xf
    hi = xf.amax(dim=reduce_dims, keepdim=True) if reduce_dims else xf
    # The range must contain 0 so that 0 (padding, ReLU output) is exact.
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    span = hi - lo
    scale = torch.where(span > 0, span / float(QMAX - QMIN), torch.ones_like(span))
    zero = torch.clamp(torch.round(QMIN - lo / scale), QMIN, QMAX)
    q = torch.clamp(torch.round(xf / scale) + zero, QMIN, QMAX).to(torch.int8)
    return q, scale, zero.to(torch.int32)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """float32 values of int8 codes: ``scale * (q - zero_point)``."""
    return scale * (q.to(torch.int32) - zero_point).float()


def quantize_weight(weight: torch.Tensor, scheme: str = "symmetric", granularity: str = "per_channel"):
    """Quantize a Linear weight ``[out, in]``: one scale per output row or one for all."""
    _check_choice("granularity", granularity, WEIGHT_GRANULARITIES)
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight: expected a 2-D Linear weight [out, in], got shape {tuple(weight.shape)}")
    return quantize(weight, scheme, dim=0 if granularity == "per_channel" else None)


def quantize_activation(x2d: torch.Tensor, scheme: str = "symmetric", granularity: str = "per_token"):
    """Quantize a 2-D activation ``[tokens, features]``: one scale per token (row) or one for all."""
    _check_choice("granularity", granularity, ACT_GRANULARITIES)
    if x2d.dim() != 2:
        raise ValueError(f"quantize_activation: expected [tokens, features], got shape {tuple(x2d.shape)}")
    return quantize(x2d, scheme, dim=0 if granularity == "per_token" else None)


def int_mm_supported(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """None when ``torch._int_mm(a, b)`` (cuBLASLt's int8 GEMM) can run as is; otherwise why not."""
    if not (a.is_cuda and b.is_cuda):
        return "operands are not on CUDA"
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        return f"operands must be int8, got {a.dtype} and {b.dtype}"
    m, k = a.shape
    n = b.shape[1]
    if m <= 16:
        return f"M={m} rows (torch._int_mm needs M > 16)"
    if k % 8 or n % 8:
        return f"K={k}, N={n} (torch._int_mm needs multiples of 8)"
    return None


def int8_matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int8 ``[M,K] @ [K,N]`` with int32 result, on any device, without tensor cores; a result
    outside int32 raises instead of wrapping silently."""
    _check_mm_operands(a, b)
    # int64 holds every sum exactly; CUDA has no integer matmul, but float64 is exact too (|sum| < 2**53).
    out = (a.double() @ b.double()).round() if a.is_cuda else a.to(torch.int64) @ b.to(torch.int64)
    if out.numel() and out.abs().max() > 2**31 - 1:
        raise OverflowError(f"int8_matmul_reference: K={a.shape[1]} products overflow int32")
    return out.to(torch.int32)


def int8_matmul(a: torch.Tensor, b: torch.Tensor, pad: bool = True) -> torch.Tensor:
    """int8 ``[M,K] @ [K,N]`` -> int32: ``torch._int_mm`` on CUDA, the reference elsewhere.

    On CUDA, shapes that ``_int_mm`` refuses are zero-padded when ``pad`` (zeros add nothing to
    the integer sums: still exact), else computed by the reference.
    """
    _check_mm_operands(a, b)
    if not a.is_cuda:
        return int8_matmul_reference(a, b)
    if int_mm_supported(a, b) is None:
        # A row-major, B column-major: the layout cuBLASLt's IMMA kernels take without a
        # transpose pass (a Linear's weight.t() already is; a row-major B costs one copy).
        return _int_mm_checked(a.contiguous(), b if b.stride(0) == 1 else b.t().contiguous().t())
    return _int_mm_padded(a, b) if pad else int8_matmul_reference(a, b)


def _int_mm_padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` through ``torch._int_mm`` on operands zero-padded to shapes it accepts."""
    m, k = a.shape
    n = b.shape[1]
    mp, kp, np_ = 32 if m <= 16 else m, _round_up(k, 8), _round_up(n, 8)
    ap = torch.zeros((mp, kp), dtype=torch.int8, device=a.device)
    ap[:m, :k] = a
    bp = torch.zeros((np_, kp), dtype=torch.int8, device=b.device)  # B^T rows: B column-major
    bp[:n, :k] = b.t()
    return _int_mm_checked(ap, bp.t())[:m, :n]


_warned_int_mm = False


def _int_mm_checked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm, or (once warned) the exact reference where this cuBLAS refuses the call."""
    global _warned_int_mm
    try:
        return compat.int_mm(a, b)
    except RuntimeError as e:
        if not _warned_int_mm:
            warnings.warn(f"torch._int_mm failed ({str(e).splitlines()[0][:200]}); int8 matmuls fall back to the "
                          f"exact but slow reference", RuntimeWarning, stacklevel=3)
            _warned_int_mm = True
        return int8_matmul_reference(a, b)


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def _check_mm_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8 matmul: operands must be int8, got a={a.dtype}, b={b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"int8 matmul: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not multiply")


class Int8DynamicLinear(nn.Module):
    """A Linear with int8 weights and dynamically quantized int8 activations.

    y = (sx * sw) * (sum_k qx qw  -  zw * sum_k qx  -  zx * sum_k qw  +  K zx zw) + bias
    with the sums in int32; the output is float32 cast back to the input's dtype.
    """

    def __init__(self, linear: nn.Linear, config: QuantConfig = QuantConfig()):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.config = config
        q, scale, zero = quantize_weight(linear.weight, config.weight, config.weight_granularity)
        # Stored [out, in] contiguous; the matmul takes its transpose as a column-major view.
        self.register_buffer("weight_q", q.contiguous())
        self.register_buffer("weight_scale", scale.reshape(-1).float())  # [out] or [1]
        self.register_buffer("weight_zero", zero.reshape(-1))
        # Column sums of the weight codes, needed only when activations carry a zero point.
        self.register_buffer("weight_colsum", q.to(torch.int32).sum(dim=1))  # [out]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Int8DynamicLinear: input has {x.shape[-1]} features, expected {self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        cfg = self.config
        qx, sx, zx = quantize_activation(x2, cfg.activation, cfg.activation_granularity)
        acc = int8_matmul(qx, self.weight_q.t())  # [M, N] int32
        if cfg.weight == "asymmetric":
            acc = acc - self.weight_zero[None, :] * qx.to(torch.int32).sum(dim=1, keepdim=True)
        if cfg.activation == "asymmetric":
            acc = acc - zx.reshape(-1, 1) * self.weight_colsum[None, :]
            if cfg.weight == "asymmetric":
                acc = acc + self.in_features * zx.reshape(-1, 1) * self.weight_zero[None, :]
        y = acc.float() * sx.reshape(-1, 1) * self.weight_scale[None, :]
        if self.bias is not None:
            y = y + self.bias
        out_dtype = x.dtype if x.is_floating_point() else torch.float32
        return y.reshape(*lead, self.out_features).to(out_dtype)

    def extra_repr(self) -> str:
        c = self.config
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight={c.weight}/{c.weight_granularity}, activation={c.activation}/{c.activation_granularity}")


def _linears(model: nn.Module, skip: Iterable[str], caller: str) -> list[tuple[str, nn.Linear]]:
    skip = set(skip)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in skip]
    if not linears:
        raise ValueError(f"{caller}: the model has no nn.Linear to quantize (skip={sorted(skip)})")
    return linears


def quantize_dynamic(model: nn.Module, config: QuantConfig = QuantConfig(), inplace: bool = False,
                     skip: Iterable[str] = ()) -> nn.Module:
    """Replace every ``nn.Linear`` (except names in ``skip``) by an :class:`Int8DynamicLinear`, scales
    computed from fp32 weights; returns the quantized model (a deep copy unless ``inplace``)."""
    model = (model if inplace else copy.deepcopy(model)).float()
    targets = _linears(model, skip, "quantize_dynamic")
    if targets[0][0] == "":
        raise ValueError("quantize_dynamic: the model itself is an nn.Linear; wrap it in a container")
    for name, lin in targets:
        model.set_submodule(name, Int8DynamicLinear(lin, config))
    return model


@dataclass
class QuantReport:
    """Per-Linear quantization error; ``rows`` in module order, printable as a table."""

    config: QuantConfig
    rows: list

    def __str__(self) -> str:
        head = f"{'module':<40} {'shape':>12} {'w rel err':>10} {'w SQNR dB':>10} {'out rel err':>11} {'out SQNR dB':>11}"
        lines = [f"int8 quantization error ({self.config})", head, "-" * len(head)]
        for r in self.rows:
            shape = "x".join(str(s) for s in r["shape"])
            orel = "—" if r["out_rel_err"] is None else f"{r['out_rel_err']:.3e}"
            osq = "—" if r["out_sqnr_db"] is None else f"{r['out_sqnr_db']:.1f}"
            lines.append(f"{r['module'][:40]:<40} {shape:>12} {r['weight_rel_err']:10.3e} "
                         f"{r['weight_sqnr_db']:10.1f} {orel:>11} {osq:>11}")
        return "\n".join(lines)

    def worst(self) -> Optional[dict]:
        """The row with the largest output (else weight) relative error."""
        return max(self.rows, key=lambda r: r["weight_rel_err"] if r["out_rel_err"] is None else r["out_rel_err"],
                   default=None)


def _rel_err(ref: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    ref, approx = ref.double(), approx.double()
    noise = (approx - ref).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    rel = math.sqrt(noise / signal) if signal > 0 else (0.0 if noise == 0 else math.inf)
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    return rel, sqnr


def quantization_report(model: nn.Module, example_input=None, config: QuantConfig = QuantConfig(),
                        skip: Iterable[str] = ()) -> QuantReport:
    """Quantization error of each Linear: of its weight, and (with ``example_input``) of its output,
    the int8 layer fed the fp32 input its original saw (so the number belongs to that layer alone)."""
    ref = copy.deepcopy(model).float().eval()
    linears = _linears(ref, skip, "quantization_report")
    out_err: dict[str, tuple[float, float]] = {}
    if example_input is not None:
        quantized = {n: Int8DynamicLinear(m, config) for n, m in linears}

        def record(mod, args, out, name):
            out_err[name] = _rel_err(out, quantized[name](args[0].float()))

        for n, m in linears:  # hooks on the private copy: nothing to remove afterwards
            m.register_forward_hook(functools.partial(record, name=n))
        with torch.no_grad():
            _call(ref, example_input)
    rows = []
    for n, m in linears:
        q, s, z = quantize_weight(m.weight, config.weight, config.weight_granularity)
        w_rel, w_sqnr = _rel_err(m.weight, dequantize(q, s, z))
        o_rel, o_sqnr = out_err.get(n, (None, None))
        rows.append({"module": n, "shape": [m.out_features, m.in_features], "weight_rel_err": w_rel,
                     "weight_sqnr_db": w_sqnr, "out_rel_err": o_rel, "out_sqnr_db": o_sqnr})
    return QuantReport(config, rows)

