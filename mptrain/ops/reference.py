"""Pure-PyTorch version of every kernel in csrc/: the test oracle and the CPU fallback.

Each function computes what its kernel computes with plain torch ops, so tests can compare the two on
any input: fp32 math (float64 stays float64, so the same code is the float64 oracle), results in the
storage dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion


def _upcast(t):
    """``t`` in the dtype the kernels compute in: fp32, or float64 for float64 (None stays None)."""
    return None if t is None else t.to(torch.promote_types(t.dtype, torch.float32))


# The multi-tensor kernels (csrc/multi_tensor_*.cu). found_inf skips are done with torch.where on the
# device: no host sync, and a skipped step leaves every tensor bit-for-bit as it was.


def _mt_log(beta):
    """log(beta), -inf for 0 (then 1 - beta^t = -expm1(t * log beta) = 1, as in the kernels)."""
    return -math.inf if beta == 0 else math.log(beta)


def _mt_keep(found_inf):
    """Bool 0-dim tensor: True when the step must change nothing (None: never)."""
    return None if found_inf is None else found_inf.reshape(()) != 0


def _mt_commit(keep, p, w_t, w, *buffers, sr=None):
    """Write the (dst, new) ``buffers``, the new weights ``w`` into ``w_t`` and, when ``w_t`` is a
    master, into the param ``p``, each in its dtype; where ``keep``, everything stays as it was.
    ``sr`` = (seed, step, tensor): the param is written with :func:`stochastic_round` instead."""
    for dst, new in [*buffers, (w_t, w)] + ([(p, w)] if w_t is not p else []):
        new = stochastic_round(new.float(), *sr) if sr is not None and dst is p else new.to(dst.dtype)
        dst.copy_(new if keep is None else torch.where(keep.to(dst.device), dst, new))


# Stochastic rounding (csrc/stochastic_round.cuh, bit for bit): Philox-4x32-10 keyed by (seed low 32 bits,
# step), counter (q low, q high, tensor, seed high 32 bits) for elements 4q .. 4q+3 in memory order; element e
# adds the low 16 bits of word e % 4 to its fp32 bit pattern and keeps the upper 16 bits. uint32 arithmetic
# is done in int64 with 16-bit halves for the products (no overflow anywhere).

_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def _mulhilo(a: int, b):
    """(hi, lo) 32-bit halves of the 64-bit product of the constant ``a`` and int64 tensor ``b`` < 2^32."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    b_lo, b_hi = b & 0xFFFF, b >> 16
    mid = a_lo * b_hi + a_hi * b_lo  # < 2^33
    low = a_lo * b_lo + ((mid & 0xFFFF) << 16)  # < 2^33
    return a_hi * b_hi + (mid >> 16) + (low >> 32), low & _U32


def philox4x32_10(counter, key):
    """Philox-4x32-10 on int64 tensors (or ints) holding uint32 values: ``counter`` 4 of them, ``key`` 2 (a key
    word may be a 0-dim tensor, e.g. a step count on the device). Returns the 4 output words (int64)."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _U32, (k1 + _PHILOX_W[1]) & _U32
    return c0, c1, c2, c3


def is_dense(t) -> bool:
    """Whether the kernels can walk ``t`` flat: ATen's ``is_non_overlapping_and_dense`` (contiguous,
    channels_last, a transpose, ...; not a slice with gaps, not an expanded view), which csrc checks."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _memory_order_index(t):
    """For each element of ``t`` its position in memory order (what the kernels walk): a dense layout is a
    permutation of 0..numel-1."""
    idx = torch.arange(t.numel(), dtype=torch.int64, device=t.device)
    if t.is_contiguous():
        return idx.view(t.shape)
    if not is_dense(t):
        raise ValueError(f"stochastic_round: a tensor with strides {t.stride()} has no memory order; pass a dense one")
    return idx.as_strided(t.shape, t.stride())


def stochastic_round_bits(t, seed: int, step, tensor: int):
    """The 16-bit random value (int64) each element of ``t`` adds in :func:`stochastic_round`. ``step`` may be an
    int or a 0-dim integer tensor (a step count on the device: no host read)."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    n = t.numel()
    q = torch.arange((n + 3) // 4, dtype=torch.int64, device=t.device)
    k1 = step.to(device=t.device, dtype=torch.int64).reshape(()) & _U32 if torch.is_tensor(step) else int(step) & _U32
    words = philox4x32_10((q & _U32, q >> 32, torch.full_like(q, int(tensor) & _U32), torch.full_like(q, seed >> 32)),
                          (seed & _U32, k1))
    flat = torch.stack(words, dim=1).reshape(-1)[:n] & 0xFFFF
    return flat[_memory_order_index(t)]


def stochastic_round(x, seed: int, step, tensor: int):
    """float32 ``x`` -> bfloat16 rounded stochastically (unbiased: rounds away from zero with probability equal to
    the distance to the truncated value in ulps); inf stays inf, NaN stays NaN (quiet bit set). Same layout as
    ``x``. The bits are those of ``mptrain::stochastic_round`` and the bf16-sr optimizer kernels."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round: expected float32 input, got {x.dtype}")
    u = x.view(torch.int32).to(torch.int64) & _U32
    special = (u & 0x7F800000) == 0x7F800000
    nan_bits = (u >> 16) | torch.where((u & 0x007FFFFF) != 0, 0x0040, 0)
    out = torch.where(special, nan_bits, (u + stochastic_round_bits(x, seed, step, tensor)) >> 16)
    out = torch.where(out >= 0x8000, out - 0x10000, out)  # uint16 bits as int16
    return out.to(torch.int16).view(torch.bfloat16)


def _mt_inv_scale(grad_scale):
    return None if grad_scale is None else torch.reciprocal(grad_scale.reshape(()).float())


def _mt_grad(g, inv_scale, maximize):
    g = _upcast(g)
    if inv_scale is not None:
        g = g * inv_scale.to(g.device)
    return -g if maximize else g


def _mt_lr(lr, like):
    """lr as a 0-dim float32 tensor on ``like``'s device (the kernel reads it as float);
    built with a fill, not a host-to-device copy, so the reference never syncs either."""
    if torch.is_tensor(lr):
        return lr.reshape(()).to(like.device, torch.float32)
    return torch.full((), lr, dtype=torch.float32, device=like.device)


def _mt_steps_advance(steps, keep):
    for s in steps:
        s.add_(1.0 if keep is None else (~keep).to(s.dtype))


def multi_tensor_scale(src, dst, scale=None, found_inf=None):
    """dst = src * scale (None: copy; dst empty: check only); found_inf = 1 if any src is inf/NaN."""
    if found_inf is not None and len(src) > 0:
        bad = torch.stack([~torch.isfinite(x).all() for x in src]).any()
        found_inf.masked_fill_(bad.to(found_inf.device), 1.0)
    for s, d in zip(src, dst):
        x = _upcast(s)
        if scale is not None:
            x = x * scale.reshape(()).float().to(x.device)
        d.copy_(x)


def multi_tensor_l2norm(tensors, per_tensor=False):
    """(global L2 norm, per-tensor norms or None), float32; sums of squares in float64."""
    if len(tensors) == 0:
        raise ValueError("multi_tensor_l2norm: got an empty list; pass at least one tensor")
    sq = torch.stack([_upcast(t).double().pow(2).sum() for t in tensors])
    total = sq.sum().sqrt().float()
    return total, (sq.sqrt().float() if per_tensor else None)


def _sr_key(sr, steps, i):
    """(seed, step being taken, tensor id) of tensor ``i`` for ``sr`` = (seed, tensor_offset), or None."""
    return None if sr is None else (sr[0], steps[i].reshape(()).to(torch.int64) + 1, sr[1] + i)


def multi_tensor_adam(grads, params, exp_avgs, exp_avg_sqs, steps, masters, lr, beta1, beta2, eps, weight_decay,
                      decoupled, maximize=False, grad_scale=None, found_inf=None, sr=None):
    """torch.optim.Adam/AdamW's update on every tensor; ``masters`` (fp32) replace the params in the math.
    ``sr`` = (seed, tensor_offset): bf16 params written with stochastic rounding (no masters)."""
    keep, inv = _mt_keep(found_inf), _mt_inv_scale(grad_scale)
    for i, p in enumerate(params):
        w_t = masters[i] if masters else p
        s = steps[i].reshape(()).double() + 1
        lr_t = _mt_lr(lr, p)
        step_size = (lr_t.double() / -torch.expm1(s * _mt_log(beta1))).float()
        bc2_sqrt = (-torch.expm1(s * _mt_log(beta2))).sqrt().float()
        g = _mt_grad(grads[i], inv, maximize)
        w = _upcast(w_t)
        if decoupled:
            w = w * (1 - lr_t * weight_decay)
        elif weight_decay != 0:
            g = g + weight_decay * w
        m = _upcast(exp_avgs[i])
        m = m + (1 - beta1) * (g - m)
        v = beta2 * _upcast(exp_avg_sqs[i]) + (1 - beta2) * g * g
        w = w - step_size * m / (v.sqrt() / bc2_sqrt + eps)
        _mt_commit(keep, p, w_t, w, (exp_avgs[i], m), (exp_avg_sqs[i], v), sr=_sr_key(sr, steps, i))
    _mt_steps_advance(steps, keep)


def multi_tensor_sgd(grads, params, momentum_buffers, steps, masters, lr, momentum, dampening, weight_decay,
                     nesterov, maximize=False, grad_scale=None, found_inf=None, sr=None):
    """torch.optim.SGD's update; a step count of 0 marks a new momentum buffer (buf = grad).
    ``sr`` as in :func:`multi_tensor_adam`."""
    keep, inv = _mt_keep(found_inf), _mt_inv_scale(grad_scale)
    for i, p in enumerate(params):
        w_t = masters[i] if masters else p
        g = _mt_grad(grads[i], inv, maximize)
        w = _upcast(w_t)
        if weight_decay != 0:
            g = g + weight_decay * w
        if momentum != 0:
            first = steps[i].reshape(()) == 0
            buf = torch.where(first, g, momentum * _upcast(momentum_buffers[i]) + (1 - dampening) * g)
            g = g + momentum * buf if nesterov else buf
        w = w - _mt_lr(lr, p) * g
        _mt_commit(keep, p, w_t, w, *([(momentum_buffers[i], buf)] if momentum != 0 else []),
                   sr=_sr_key(sr, steps, i))
    _mt_steps_advance(steps, keep)


def multi_tensor_lamb(grads, params, exp_avgs, exp_avg_sqs, steps, masters, lr, beta1, beta2, eps, weight_decay,
                      bias_correction=True, maximize=False, grad_scale=None, found_inf=None, sr=None):
    """LAMB: Adam-style update u plus weight decay, scaled per tensor by ||w|| / ||u||.
    ``sr`` as in :func:`multi_tensor_adam`."""
    keep, inv = _mt_keep(found_inf), _mt_inv_scale(grad_scale)
    for i, p in enumerate(params):
        w_t = masters[i] if masters else p
        s = steps[i].reshape(()).double() + 1
        bc1, bc2 = ((-torch.expm1(s * _mt_log(b))).float() if bias_correction else 1.0 for b in (beta1, beta2))
        g = _mt_grad(grads[i], inv, maximize)
        w = _upcast(w_t)
        m = _upcast(exp_avgs[i])
        m = m + (1 - beta1) * (g - m)
        v = beta2 * _upcast(exp_avg_sqs[i]) + (1 - beta2) * g * g
        u = (m / bc1) / ((v / bc2).sqrt() + eps) + weight_decay * w
        wn = w.double().pow(2).sum().sqrt().float()
        un = u.double().pow(2).sum().sqrt().float()
        ratio = torch.where((wn > 0) & (un > 0), wn / un, torch.ones_like(wn))
        w = w - (_mt_lr(lr, p) * ratio) * u
        _mt_commit(keep, p, w_t, w, (exp_avgs[i], m), (exp_avg_sqs[i], v), sr=_sr_key(sr, steps, i))
    _mt_steps_advance(steps, keep)


# The stochastic-rounding ops' argument order (no masters; seed and tensor_offset last).
def multi_tensor_adam_sr(grads, params, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, decoupled,
                         maximize, grad_scale, found_inf, seed, tensor_offset):
    multi_tensor_adam(grads, params, exp_avgs, exp_avg_sqs, steps, [], lr, beta1, beta2, eps, weight_decay, decoupled,
                      maximize, grad_scale, found_inf, sr=(seed, tensor_offset))


def multi_tensor_sgd_sr(grads, params, momentum_buffers, steps, lr, momentum, dampening, weight_decay, nesterov,
                        maximize, grad_scale, found_inf, seed, tensor_offset):
    multi_tensor_sgd(grads, params, momentum_buffers, steps, [], lr, momentum, dampening, weight_decay, nesterov,
                     maximize, grad_scale, found_inf, sr=(seed, tensor_offset))


def multi_tensor_lamb_sr(grads, params, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                         bias_correction, maximize, grad_scale, found_inf, seed, tensor_offset):
    multi_tensor_lamb(grads, params, exp_avgs, exp_avg_sqs, steps, [], lr, beta1, beta2, eps, weight_decay,
                      bias_correction, maximize, grad_scale, found_inf, sr=(seed, tensor_offset))


# LayerNorm / RMSNorm as csrc/layer_norm.cu computes them: weight/bias in the input's dtype or fp32.


def normalized_dims(x, normalized_shape):
    """The trailing dims that ``normalized_shape`` names, checked against ``x``."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) == 0 or tuple(x.shape[x.dim() - len(shape):]) != shape or len(shape) > x.dim():
        raise ValueError(
            f"normalized_shape={list(shape)} must be the trailing dims of the input, whose shape is {list(x.shape)}"
        )
    return shape


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``F.layer_norm`` in fp32, result in ``x``'s dtype. Differentiable."""
    shape = normalized_dims(x, normalized_shape)
    return F.layer_norm(_upcast(x), shape, _upcast(weight), _upcast(bias), eps).to(x.dtype)


# What F.rms_norm takes for eps=None: from torch 2.7 on (pytorch#142848) the machine epsilon of the
# math dtype (fp32 for half input); torch 2.6 took the input dtype's (bf16's is 2**16 times fp32's).
_RMS_EPS_OF_MATH_DTYPE = TorchVersion(torch.__version__) >= "2.7"


def rms_norm_eps(x, eps):
    """``eps=None`` means what the installed torch means (above)."""
    if eps is not None:
        return eps
    return torch.finfo(torch.promote_types(x.dtype, torch.float32) if _RMS_EPS_OF_MATH_DTYPE else x.dtype).eps


def rms_norm(x, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` in fp32, result in ``x``'s dtype. Differentiable."""
    shape = normalized_dims(x, normalized_shape)
    xf = _upcast(x)
    dims = tuple(range(-len(shape), 0))
    y = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + rms_norm_eps(x, eps))
    if weight is not None:
        y = y * _upcast(weight)
    return y.to(x.dtype)


# The op forms (the CPU kernels of torch.ops.mptrain.layer_norm / layer_norm_backward): what the CUDA entry
# points return. stats = [mean (rows; LayerNorm only) | rstd (rows) | one zero word], in the math dtype.


def norm_rows(x, normalized_shape):
    """(rows, hidden): ``x`` as the kernels see it, rows of ``prod(normalized_shape)`` elements."""
    hidden = math.prod(normalized_shape)
    return (x.numel() // hidden if hidden else 0), hidden


def layer_norm_forward(x, normalized_shape, weight, bias, eps, rms):
    """(y in x's dtype, stats): LayerNorm (rms=False) or RMSNorm over the trailing dims."""
    w = _upcast(weight)
    if not rms:  # torch's own kernel, in the math dtype: few ops on the host
        y, mean, rstd = torch.native_layer_norm(_upcast(x), normalized_shape, w, _upcast(bias), eps)
        return y.to(x.dtype), torch.cat([mean.reshape(-1), rstd.reshape(-1), rstd.new_zeros(1)])
    rows, hidden = norm_rows(x, normalized_shape)
    x2 = _upcast(x).reshape(rows, hidden)
    rstd = torch.rsqrt(x2.pow(2).mean(1) + eps)
    y = x2 * rstd[:, None]
    if w is not None:
        y = y * w.reshape(hidden)
    return y.to(x.dtype).reshape(x.shape), torch.cat([rstd, rstd.new_zeros(1)])


def layer_norm_backward(dy, x, stats, weight, bias, normalized_shape, rms):
    """(dx, dweight, dbias) from the forward's stats; an absent parameter's gradient is an
    empty tensor (as the CUDA op returns it)."""
    rows, hidden = norm_rows(x, normalized_shape)
    w = _upcast(weight)
    if not rms:
        st = stats.to(_upcast(x).dtype)
        shape = tuple(x.shape[:x.dim() - len(normalized_shape)]) + (1,) * len(normalized_shape)  # mean/rstd's
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            _upcast(dy), _upcast(x), normalized_shape, st[:rows].reshape(shape), st[rows:2 * rows].reshape(shape),
            w, _upcast(bias), [True, weight is not None, bias is not None])
    else:
        x2 = _upcast(x).reshape(rows, hidden)
        g = _upcast(dy).reshape(rows, hidden)
        rstd = stats[:rows].to(x2.dtype)[:, None]
        xhat = x2 * rstd
        gw = g if w is None else g * w.reshape(hidden)
        dx = (gw - xhat * (gw * xhat).mean(1, keepdim=True)) * rstd
        dw = None if weight is None else (g * xhat).sum(0)
        db = None
    dx = dx.to(x.dtype).reshape(x.shape)
    dw = x.new_empty(0) if weight is None else dw.to(weight.dtype).reshape(weight.shape)
    db = x.new_empty(0) if bias is None else db.to(bias.dtype).reshape(bias.shape)
    return dx, dw, db


def check_softmax_mask(x, mask, causal):
    """Raise naming what is wrong with ``mask`` (dtype, device, shape) or ``causal`` for the input ``x``."""
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = masked out), got {mask.dtype}; use mask.bool()")
        if mask.device != x.device:
            raise ValueError(f"mask is on {mask.device} but the input is on {x.device}; move the mask")
        torch.broadcast_shapes(mask.shape, x.shape)  # raises with both shapes
        if mask.dim() > x.dim():
            raise ValueError(f"mask of shape {list(mask.shape)} has more dims than the input {list(x.shape)}")
    if causal and x.dim() < 2:
        raise ValueError(f"causal=True needs an input with at least 2 dims (..., queries, keys), got {list(x.shape)}")


def scaled_masked_softmax(x, mask=None, scale=1.0, causal=False):
    """softmax(masked_fill(scale * x, mask, -inf)) over the last dim in fp32, result in ``x``'s dtype; a fully masked
    row gives zeros (and zero gradient). ``causal`` also masks key k > query q, top-left aligned as in
    ``scaled_dot_product_attention(is_causal=True)``; q indexes ``x``'s second-to-last dim. Differentiable."""
    check_softmax_mask(x, mask, causal)
    v = _upcast(x) * scale
    if causal:
        tri = torch.ones(x.shape[-2], x.shape[-1], dtype=torch.bool, device=x.device).triu(1)
        mask = tri if mask is None else (mask | tri)
    if mask is None:
        return torch.softmax(v, dim=-1).to(x.dtype)
    v = v.masked_fill(mask, float("-inf"))
    # Rows with nothing left would be 0/0: give them finite logits, then zero them.
    dead = mask.all(dim=-1, keepdim=True)
    v = v.masked_fill(dead, 0.0)
    return torch.softmax(v, dim=-1).masked_fill(dead, 0.0).to(x.dtype)


def scaled_masked_softmax_backward(dy, y, scale):
    """dx = scale * y * (dy - sum(dy * y, -1)) in fp32, in y's dtype (the CUDA op's backward)."""
    yf, g = _upcast(y), _upcast(dy)
    return (scale * yf * (g - (g * yf).sum(-1, keepdim=True))).to(y.dtype)


# LSTM: gate order is torch's (i, f, g, o) along the 4*hidden dimension.


def _lstm_pointwise(igates, hgates, c, b_ih, b_hh):
    """(activated gates [sigmoid(i), sigmoid(f), tanh(g), sigmoid(o)], h', c') in fp32 from the summed
    pre-activations ``igates`` (B, 4H) [+ ``hgates``] [+ biases]."""
    g = _upcast(igates)
    for extra in (hgates, b_ih, b_hh):
        if extra is not None:
            g = g + _upcast(extra)
    i, f, gg, o = g.chunk(4, dim=-1)
    i, f, gg, o = i.sigmoid(), f.sigmoid(), gg.tanh(), o.sigmoid()
    c_new = f * _upcast(c) + i * gg
    return [i, f, gg, o], o * c_new.tanh(), c_new


def lstm_cell_pointwise_forward(igates, hgates, c, b_ih=None, b_hh=None):
    """The forward kernel: (h', c', workspace); the workspace is the activated gates (i, f, g, o)
    rounded to the storage dtype, as the kernel saves them."""
    gates, h_new, c_new = _lstm_pointwise(igates, hgates, c, b_ih, b_hh)
    return h_new.to(igates.dtype), c_new.to(igates.dtype), torch.cat(gates, dim=-1).to(igates.dtype)


def lstm_cell_pointwise_backward(dh, dh2, dc, c_prev, c_new, ws):
    """The backward kernel: (d pre-activation gates, dc) from dh' (+ dh2), dc' and the saved workspace / c / c'
    (tanh(c') recomputed from the stored c', as the kernel does). Any of ``dh``, ``dh2``, ``dc`` may be None (zero)."""
    dtype = ws.dtype
    i, f, gg, o = _upcast(ws).chunk(4, dim=-1)
    zero = _upcast(torch.zeros_like(c_prev))
    dhv = sum((_upcast(t) for t in (dh, dh2) if t is not None), zero)
    dcv = zero if dc is None else _upcast(dc)
    tc = _upcast(c_new).tanh()
    dct = dcv + dhv * o * (1 - tc * tc)
    dgates = torch.cat([dct * gg * i * (1 - i), dct * _upcast(c_prev) * f * (1 - f), dct * i * (1 - gg * gg),
                        dhv * tc * o * (1 - o)], dim=-1)
    return dgates.to(dtype), (dct * f).to(dtype)


def lstm_cell_gates(igates, hgates, c, b_ih=None, b_hh=None):
    """Differentiable pointwise part: (h', c') with fp32 math, outputs in the gates' dtype."""
    _, h_new, c_new = _lstm_pointwise(igates, hgates, c, b_ih, b_hh)
    return h_new.to(igates.dtype), c_new.to(igates.dtype)


def lstm_cell(x, h, c, w_ih, w_hh, b_ih=None, b_hh=None):
    """One LSTM step as torch.nn.LSTMCell computes it: GEMMs in the storage dtype,
    gate math in fp32. Differentiable; the CPU fallback and the test oracle."""
    return lstm_cell_gates(F.linear(x, w_ih), F.linear(h, w_hh), c, b_ih, b_hh)


def lstm_layer(x, h0, c0, w_ih, w_hh, b_ih=None, b_hh=None):
    """One unidirectional LSTM layer over a time-major sequence x (T, B, I). Returns (out (T, B, H), c_n (B, H)); h_n is
    out[-1]. The input projections of all steps are one GEMM, as in the fused path."""
    xg = F.linear(x, w_ih)
    h, c, outs = h0, c0, []
    for t in range(x.shape[0]):
        h, c = lstm_cell_gates(xg[t], F.linear(h, w_hh), c, b_ih, b_hh)
        outs.append(h)
    return torch.stack(outs), c


# The op forms (the CPU kernels of torch.ops.mptrain.lstm_cell / lstm_layer and their backwards): the
# CUDA entry points' algorithm step for step (GEMMs in the storage dtype, the pointwise kernels above,
# the saved workspace). A gradient not in ``need`` is an empty tensor.


def lstm_cell_forward(x, h, c, w_ih, w_hh, b_ih=None, b_hh=None):
    """(h', c', workspace) of one step."""
    gates = x @ w_ih.t()
    gates.addmm_(h, w_hh.t())
    return lstm_cell_pointwise_forward(gates, None, c, b_ih, b_hh)


def lstm_cell_backward(dh, dc, x, h, c, w_ih, w_hh, ws, c_new, need):
    """(dx, dh, dc, dw_ih, dw_hh, dbias) of one step; ``need``: six flags in that order."""
    dg, dc_prev = lstm_cell_pointwise_backward(dh, None, dc, c, c_new, ws)
    grads = (lambda: dg @ w_ih, lambda: dg @ w_hh, lambda: dc_prev, lambda: dg.t() @ x, lambda: dg.t() @ h,
             lambda: dg.sum(0))
    return tuple(g() if n else x.new_empty(0) for g, n in zip(grads, need))


def lstm_layer_forward(x, h0, c0, w_ih, w_hh, b_ih=None, b_hh=None):
    """(out (T, B, H), c_n (B, H), c_all (T, B, H), workspace (T, B, 4H)) of one layer."""
    T, B, I = x.shape
    H = w_hh.shape[1]
    xg = (x.reshape(T * B, I) @ w_ih.t()).view(T, B, 4 * H)
    out, c_all, ws = (x.new_empty(T, B, n) for n in (H, H, 4 * H))
    for t in range(T):
        xg[t].addmm_(h0 if t == 0 else out[t - 1], w_hh.t())
        out[t], c_all[t], ws[t] = lstm_cell_pointwise_forward(xg[t], None, c0 if t == 0 else c_all[t - 1], b_ih, b_hh)
    return out, c_all[-1].clone(), c_all, ws


def lstm_layer_backward(d_out, dc_n, x, h0, c0, out, c_all, ws, w_ih, w_hh, need):
    """(dx, dh0, dc0, dw_ih, dw_hh, dbias) of one layer: the recurrent dh and dc run
    backwards over the steps, the weight gradients are GEMMs over all steps at once."""
    T, B, I = x.shape
    H = w_hh.shape[1]
    dg = x.new_empty(T, B, 4 * H)
    dh_rec, dc_rec = None, dc_n
    for t in range(T - 1, -1, -1):
        dh_t = None if d_out is None else d_out[t]
        dg[t], dc_rec = lstm_cell_pointwise_backward(dh_t, dh_rec, dc_rec, c0 if t == 0 else c_all[t - 1], c_all[t],
                                                     ws[t])
        dh_rec = dg[t] @ w_hh
    dg2 = dg.view(T * B, 4 * H)

    def dw_hh():
        d = dg[0].t() @ h0
        return d.addmm_(dg[1:].reshape(-1, 4 * H).t(), out[:-1].reshape(-1, H)) if T > 1 else d

    grads = (lambda: (dg2 @ w_ih).view(T, B, I), lambda: dh_rec, lambda: dc_rec,
             lambda: dg2.t() @ x.reshape(T * B, I), dw_hh, lambda: dg2.sum(0))
    return tuple(g() if n else x.new_empty(0) for g, n in zip(grads, need))


# Max pooling (csrc/max_pool.cu): channels_last in and out; the second output holds, per output
# element, the window offset (kh * kernel_w + kw, int8) of the input element its maximum came from.
def pool_out_size(size, k, stride, pad):
    return [(size[i] + 2 * pad[i] - k[i]) // stride[i] + 1 for i in (0, 1)]


def check_max_pool2d(x, kernel_size, stride, padding, op="max_pool2d"):
    """A ValueError naming the argument the kernels cannot take."""
    if x.dim() != 4:
        raise ValueError(f"{op}: input must be 4-d (N, C, H, W), got shape {tuple(x.shape)}")
    k, s, p = (list(v) for v in (kernel_size, stride, padding))
    if not (len(k) == len(s) == len(p) == 2):
        raise ValueError(f"{op}: kernel_size, stride and padding must have 2 values each, got {k}, {s}, {p}")
    if min(k) < 1 or k[0] * k[1] > 127 or min(s) < 1 or min(p) < 0 or 2 * p[0] > k[0] or 2 * p[1] > k[1]:
        raise ValueError(f"{op}: kernel_size={k}, stride={s}, padding={p}: need kernel_size >= 1 with at most 127 "
                         "elements (int8 offsets), stride >= 1 and 0 <= padding <= kernel_size / 2")
    if min(pool_out_size(x.shape[2:], k, s, p)) < 1:
        raise ValueError(f"{op}: the output would be empty for input shape {tuple(x.shape)}, kernel_size={k}, "
                         f"padding={p}")


def max_pool2d_forward(x, kernel_size, stride, padding):
    """(y, offsets) as ``mptrain::max_pool2d`` returns them, from ATen's ``max_pool2d_with_indices``
    (the same tie / NaN / all -inf rules on the CPU)."""
    k, s, p = list(kernel_size), list(stride), list(padding)
    y, flat = F.max_pool2d(x, k, s, p, return_indices=True)
    ho = torch.arange(y.shape[2], device=x.device).view(-1, 1) * s[0] - p[0]
    wo = torch.arange(y.shape[3], device=x.device).view(1, -1) * s[1] - p[1]
    offsets = (flat // x.shape[3] - ho) * k[1] + (flat % x.shape[3] - wo)
    cl = torch.channels_last
    return y.contiguous(memory_format=cl), offsets.to(torch.int8).contiguous(memory_format=cl)


def max_pool2d_backward(dy, offsets, input_size, kernel_size, stride, padding):
    """dx of the pool from its output gradient and the forward's offsets (fp32 sums, channels_last)."""
    k, s, p = list(kernel_size), list(stride), list(padding)
    H, W = input_size
    N, C, Ho, Wo = dy.shape
    off = offsets.long()
    rows = (torch.arange(Ho, device=dy.device).view(-1, 1) * s[0] - p[0]) + off // k[1]
    cols = (torch.arange(Wo, device=dy.device).view(1, -1) * s[1] - p[1]) + off % k[1]
    flat = (rows * W + cols).reshape(N * C, Ho * Wo)
    dx = torch.zeros(N * C, H * W, dtype=_upcast(dy).dtype, device=dy.device)
    dx.scatter_add_(1, flat, _upcast(dy).reshape(N * C, Ho * Wo))
    return dx.view(N, C, H, W).to(dy.dtype).contiguous(memory_format=torch.channels_last)
