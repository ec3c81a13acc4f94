"""The Triton kernels of :mod:`mptrain.precision.fp8_swiglu` (imported on first use: ``import mptrain`` stays without
Triton).  One program per 64 x 64 tile; an amax is an atomic max over the tiles' maxima."""
import triton
import triton.language as tl


@triton.jit
def tile(M, N, B: tl.constexpr):
    """This program's B x B tile of an M x N row-major tensor: its rows, columns, mask and offsets (64-bit: an
    FFN activation of 16 x 8192 tokens at width 28672 holds 3.8e9 elements, past 2^31)."""
    rows = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    cols = tl.program_id(1).to(tl.int64) * B + tl.arange(0, B)
    return rows, cols, (rows[:, None] < M) & (cols[None, :] < N), rows[:, None] * N + cols[None, :]


@triton.jit
def forward(g_ptr, u_ptr, h_ptr, scale_ptr, amax_ptr, M, N, FP8_MAX: tl.constexpr, B: tl.constexpr):
    """h = silu(g) * u cast at ``scale`` (saturated), and its amax."""
    rows, cols, mask, offs = tile(M, N, B)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    s = tl.load(scale_ptr)
    tl.store(h_ptr + offs, tl.clamp(h * s, -FP8_MAX, FP8_MAX).to(h_ptr.dtype.element_ty), mask=mask)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(h), axis=1), axis=0))


@triton.jit
def backward(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, dgt_ptr, dut_ptr, sg_ptr, su_ptr, amax_g_ptr, amax_u_ptr,
             M, N, FP8_MAX: tl.constexpr, B: tl.constexpr):
    """The gradients of silu(g) * u for dh, each cast at its scale, row-major and transposed, and their amaxes."""
    rows, cols, mask, offs = tile(M, N, B)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    du = dh * g * sig
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    dg8 = tl.clamp(dg * tl.load(sg_ptr), -FP8_MAX, FP8_MAX)
    du8 = tl.clamp(du * tl.load(su_ptr), -FP8_MAX, FP8_MAX)
    tl.store(dg_ptr + offs, dg8.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, du8.to(du_ptr.dtype.element_ty), mask=mask)
    # the transposed copies (N x M, row-major): the tile transposed, so that the stores run along M
    offs_t = cols[:, None] * M + rows[None, :]
    mask_t = (cols[:, None] < N) & (rows[None, :] < M)
    tl.store(dgt_ptr + offs_t, tl.trans(dg8).to(dgt_ptr.dtype.element_ty), mask=mask_t)
    tl.store(dut_ptr + offs_t, tl.trans(du8).to(dut_ptr.dtype.element_ty), mask=mask_t)
    tl.atomic_max(amax_g_ptr, tl.max(tl.max(tl.abs(dg), axis=1), axis=0))
    tl.atomic_max(amax_u_ptr, tl.max(tl.max(tl.abs(du), axis=1), axis=0))
