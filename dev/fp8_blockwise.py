"""DeepSeek-V3's blockwise fp8 scales for a linear layer, on torch's scaled GEMM (lab: not shipped).

Activations and output gradients are cast in 1x128 tiles along the GEMM's contraction dimension, weights in 128x128
blocks (``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` / ``BlockWise128x128``: cuBLAS on
Hopper, CUDA 12.9 or newer).  Each tile's scale is a reduction over 128 neighbouring elements, so no cast waits for
the amax of a whole tensor, as every cast of the tensorwise recipe does.  A tile's scales follow the contraction
dimension, so the input and the output gradient are cast twice: along the features for the forward and
input-gradient GEMMs, along the tokens (stored transposed) for the weight-gradient GEMM; the weight once, its
128x128 blocks transposed for the input gradient.

Used by ``dev/fp8_mlp_fusion.py`` (one MLP block) and ``dev/fp8_llama_profile.py`` (the 1.2B step), which run
:func:`check_blockwise` first: each GEMM against the same GEMM on its decoded operands, so a scale layout cuBLAS
reads otherwise fails before anything is timed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import ScalingType as S

_E4M3 = torch.float8_e4m3fn
_E5M2 = torch.float8_e5m2


def _tiles(x: torch.Tensor, dtype: torch.dtype, along: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D) cast to fp8 in 1x128 tiles ``along`` dimension 1 (the features) or 0 (the tokens; then the data
    comes back transposed, row-major): the fp8 rows, each contracted along its length, and their decode scales
    (rows x length/128), outer-dimension-major as cuBLAS takes them."""
    if along == 0:
        x = x.t()
    rows, cols = x.shape
    t = x.float().reshape(rows, cols // 128, 128)
    amax = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    data = (t * (torch.finfo(dtype).max / amax)).to(dtype).reshape(rows, cols)
    scale = (amax / torch.finfo(dtype).max).reshape(rows, cols // 128)
    return data.contiguous(), scale.t().contiguous().t()


def _blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (out x in) cast to e4m3 in 128x128 blocks: the fp8 weight and its decode scales (out/128 x in/128)."""
    n, k = w.shape
    t = w.float().reshape(n // 128, 128, k // 128, 128)
    amax = t.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    data = (t * (torch.finfo(_E4M3).max / amax)).to(_E4M3).reshape(n, k)
    return data, (amax / torch.finfo(_E4M3).max).reshape(n // 128, k // 128)


def _transposed(wq: torch.Tensor, ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A blocked weight as the input-gradient GEMM takes it (in x out): 128x128 blocks transpose with their scales;
    the scales laid out as the forward's (cuBLAS reads a 128x128 scale tensor given transposed, as torch's tests)."""
    return wq.t().contiguous(), ws.t().contiguous()


def _scaled_mm(a, a_scale, a_recipe, b, b_scale, b_recipe) -> torch.Tensor:
    """``a @ b.t()`` for row-major fp8 ``a`` (m x k) and ``b`` (n x k) with their scales along k."""
    return F.scaled_mm(a, b.t(), a_scale, a_recipe, b_scale.t(), b_recipe, output_dtype=torch.bfloat16)


def _dequantized_mm(a, a_scale, a_block, b, b_scale, b_block) -> torch.Tensor:
    """The reference for :func:`_scaled_mm`: the operands decoded to fp32 (``*_block``: rows a scale covers)."""
    def decode(t, s, block):
        return t.float() * s.repeat_interleave(block, 0).repeat_interleave(128, 1)
    return (decode(a, a_scale, a_block) @ decode(b, b_scale, b_block).t()).bfloat16()


class _BlockwiseMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_hp, weight):
        shape = input_hp.shape
        x = input_hp.reshape(-1, shape[-1])
        xq, xs = _tiles(x, _E4M3, along=1)
        wq, ws = _blocks(weight)
        xtq, xts = _tiles(x, _E4M3, along=0)  # for the weight gradient: tiles along the tokens
        ctx.save_for_backward(xtq, xts, wq, ws)
        ctx.input_shape = shape
        out = _scaled_mm(xq, xs, S.BlockWise1x128, wq, ws, S.BlockWise128x128)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        xtq, xts, wq, ws = ctx.saved_tensors
        g = grad_output.reshape(-1, grad_output.shape[-1])
        gq, gs = _tiles(g, _E5M2, along=1)
        gtq, gts = _tiles(g, _E5M2, along=0)
        grad_input = _scaled_mm(gq, gs, S.BlockWise1x128, *_transposed(wq, ws), S.BlockWise128x128)
        grad_weight = _scaled_mm(gtq, gts, S.BlockWise1x128, xtq, xts, S.BlockWise1x128)
        return grad_input.reshape(ctx.input_shape), grad_weight


class BlockwiseFp8Linear(nn.Linear):
    def forward(self, input):
        out = _BlockwiseMatmul.apply(input, self.weight)
        return out if self.bias is None else out + self.bias


def check_blockwise(device: str) -> None:
    """Each of the blockwise linear's three GEMMs against the same GEMM on its decoded operands (fp32 math): the
    scale layouts cuBLAS takes are right, or this raises before anything is timed."""
    torch.manual_seed(0)
    # every contraction a multiple of 4 blocks: torch 2.11 wants a 128x128 scale tensor's contraction dimension
    # padded to 4 (cuBLAS's alignment), as the model's widths (2048, 8192) are
    x = torch.randn(1024, 512, device=device, dtype=torch.bfloat16)
    w = torch.randn(1536, 512, device=device, dtype=torch.bfloat16)
    g = torch.randn(1024, 1536, device=device, dtype=torch.bfloat16)
    xq, xs = _tiles(x, _E4M3, 1)
    wq, ws = _blocks(w)
    gq, gs = _tiles(g, _E5M2, 1)
    xtq, xts = _tiles(x, _E4M3, 0)
    gtq, gts = _tiles(g, _E5M2, 0)
    wtq, wts = _transposed(wq, ws)
    pairs = {
        "forward": (_scaled_mm(xq, xs, S.BlockWise1x128, wq, ws, S.BlockWise128x128),
                    _dequantized_mm(xq, xs, 1, wq, ws, 128)),
        "input gradient": (_scaled_mm(gq, gs, S.BlockWise1x128, wtq, wts, S.BlockWise128x128),
                           _dequantized_mm(gq, gs, 1, wtq, wts, 128)),
        "weight gradient": (_scaled_mm(gtq, gts, S.BlockWise1x128, xtq, xts, S.BlockWise1x128),
                            _dequantized_mm(gtq, gts, 1, xtq, xts, 1)),
    }
    for name, (got, want) in pairs.items():
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"blockwise {name}: relative error against the decoded operands {err:.2e}")
        if not err < 1e-2:
            raise AssertionError(f"blockwise {name} GEMM differs from its decoded operands (relative error {err})")


def use_blockwise(module: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Every exact ``nn.Linear`` in ``module`` (but those named in ``skip``) becomes a :class:`BlockwiseFp8Linear`
    in place (same Parameters); returns their names.  Sizes must be multiples of 128."""
    names = []
    for name, m in module.named_modules():
        if type(m) is nn.Linear and name not in skip:
            if m.in_features % 128 or m.out_features % 128:
                raise ValueError(f"{name}: {m.in_features}x{m.out_features} is not in 128x128 blocks")
            m.__class__ = BlockwiseFp8Linear
            names.append(name)
    return names
