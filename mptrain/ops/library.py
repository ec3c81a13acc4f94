"""The custom ops ``torch.ops.mptrain.*``: schemas, CPU kernels, fake kernels, autograd.

* Schemas are defined here, in Python, so every op exists without the CUDA extension (CPU, CI, a failed
  build); the extension only adds CUDA implementations (``csrc/ops_cuda.cpp``) and never redefines an op.
* The CPU kernel is the reference's op form (:mod:`mptrain.ops.reference`: what the CUDA entry points
  return, saved statistics and workspaces included), registered for ``CompositeExplicitAutograd`` so it
  also serves CUDA tensors while the extension is not loaded.
* Fake kernels give shapes, dtypes and contiguous strides, so ``torch.compile`` traces every op.
* Autograd: a Python formula here for the CPU path; CUDA tensors take the C++ autograd nodes registered
  for ``AutogradCUDA`` (``csrc/ops_autograd.cpp``, ``csrc/lstm_autograd.cu``), which cost no Python.
  The backward ops are not differentiable again: use ``fused=False`` for double backward.  Under
  ``create_graph=True`` the gradients carry a graph whose backward raises that (the C++ nodes give them an
  Error node: ``csrc/autograd_node.h``), so a gradient penalty never silently contributes nothing.
* The multi-tensor ops mutate their list arguments and return nothing; they have no autograd.
"""
from __future__ import annotations

import torch

from . import reference as R

NAMESPACE = "mptrain"
_lib = torch.library.Library(NAMESPACE, "DEF")  # kept alive for the process: dropping it removes the ops

_SCHEMA_TEXTS = (
    "layer_norm(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, bool rms) "
    "-> (Tensor, Tensor)",
    "layer_norm_backward(Tensor grad_out, Tensor input, Tensor stats, Tensor? weight, Tensor? bias, "
    "int[] normalized_shape, bool rms) -> (Tensor, Tensor, Tensor)",
    "scaled_masked_softmax(Tensor input, Tensor? mask, float scale, bool causal) -> Tensor",
    "scaled_masked_softmax_backward(Tensor grad_out, Tensor output, float scale) -> Tensor",
    "lstm_cell(Tensor x, Tensor h, Tensor c, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh) "
    "-> (Tensor, Tensor, Tensor)",
    "lstm_cell_backward(Tensor? grad_h, Tensor? grad_c, Tensor x, Tensor h, Tensor c, Tensor w_ih, Tensor w_hh, "
    "Tensor workspace, Tensor c_new, bool[6] need) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "lstm_layer(Tensor x, Tensor h0, Tensor c0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    "lstm_layer_backward(Tensor? grad_out, Tensor? grad_c_n, Tensor x, Tensor h0, Tensor c0, Tensor out, "
    "Tensor c_all, Tensor workspace, Tensor w_ih, Tensor w_hh, bool[6] need) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "max_pool2d(Tensor input, int[2] kernel_size, int[2] stride, int[2] padding) -> (Tensor, Tensor)",
    "max_pool2d_backward(Tensor grad_out, Tensor offsets, int[2] input_size, int[2] kernel_size, int[2] stride, "
    "int[2] padding) -> Tensor",
    "multi_tensor_scale_(Tensor[] src, Tensor(a!)[] dst, Tensor? scale, Tensor(b!)? found_inf) -> ()",
    "multi_tensor_unscale_(Tensor(a!)[] tensors, Tensor inv_scale, Tensor(b!)? found_inf) -> ()",
    "multi_tensor_check_finite_(Tensor[] tensors, Tensor(a!) found_inf) -> ()",
    "multi_tensor_l2norm(Tensor[] tensors, bool per_tensor) -> (Tensor, Tensor)",
    "multi_tensor_adam_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] steps, Tensor(e!)[] masters, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, "
    "float weight_decay, bool decoupled, bool maximize, Tensor? grad_scale, Tensor? found_inf) -> ()",
    "multi_tensor_sgd_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] momentum_buffers, Tensor(c!)[] steps, "
    "Tensor(d!)[] masters, float lr, Tensor? lr_tensor, float momentum, float dampening, float weight_decay, "
    "bool nesterov, bool maximize, Tensor? grad_scale, Tensor? found_inf) -> ()",
    "multi_tensor_lamb_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] steps, Tensor(e!)[] masters, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, "
    "float weight_decay, bool bias_correction, bool maximize, Tensor? grad_scale, Tensor? found_inf) -> ()",
    # Stochastic rounding (bf16-sr): bf16 params written from Philox bits keyed by (seed, step), counter
    # (tensor_offset + list index, element); fp32 state, no masters (csrc/stochastic_round.cuh).
    "multi_tensor_adam_sr_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] steps, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, float weight_decay, "
    "bool decoupled, bool maximize, Tensor? grad_scale, Tensor? found_inf, int seed, int tensor_offset) -> ()",
    "multi_tensor_sgd_sr_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] momentum_buffers, Tensor(c!)[] steps, "
    "float lr, Tensor? lr_tensor, float momentum, float dampening, float weight_decay, bool nesterov, bool maximize, "
    "Tensor? grad_scale, Tensor? found_inf, int seed, int tensor_offset) -> ()",
    "multi_tensor_lamb_sr_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] steps, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, float weight_decay, "
    "bool bias_correction, bool maximize, Tensor? grad_scale, Tensor? found_inf, int seed, int tensor_offset) -> ()",
    "stochastic_round(Tensor x, int seed, int step, int tensor) -> Tensor",
)
SCHEMAS = {text[:text.index("(")]: text for text in _SCHEMA_TEXTS}  # op name -> schema
for _schema in _SCHEMA_TEXTS:
    _lib.define(_schema)

OPS = {name: getattr(torch.ops.mptrain, name).default for name in SCHEMAS}  # OpOverloads, looked up once


def _impl(name):
    """Register the decorated function as ``name``'s CPU kernel (and CUDA fallback)."""

    def register(fn):
        _lib.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


def _fake(name):
    return lambda fn: torch.library.register_fake(f"{NAMESPACE}::{name}", fn, lib=_lib)


def _new(like, *shape, dtype=None, memory_format=torch.contiguous_format):
    """A tensor on ``like``'s device in the layout the kernels allocate (contiguous unless told)."""
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device, memory_format=memory_format)


# CPU kernels that are the reference's op forms as they are (the others check their inputs first, below).
for _name, _kernel in (("layer_norm_backward", R.layer_norm_backward),
                       ("scaled_masked_softmax", R.scaled_masked_softmax),
                       ("scaled_masked_softmax_backward", R.scaled_masked_softmax_backward),
                       ("lstm_cell", R.lstm_cell_forward), ("lstm_cell_backward", R.lstm_cell_backward),
                       ("lstm_layer_backward", R.lstm_layer_backward), ("multi_tensor_scale_", R.multi_tensor_scale)):
    _impl(_name)(_kernel)


# LayerNorm / RMSNorm
def _check_norm(x, normalized_shape, weight, bias):
    R.normalized_dims(x, normalized_shape)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != tuple(normalized_shape):
            raise ValueError(f"{name} has shape {list(p.shape)}, expected normalized_shape {list(normalized_shape)}")


@_impl("layer_norm")
def _layer_norm_cpu(x, normalized_shape, weight, bias, eps, rms):
    _check_norm(x, normalized_shape, weight, bias)
    return R.layer_norm_forward(x, normalized_shape, weight, bias, eps, rms)


@_fake("layer_norm")
def _layer_norm_fake(x, normalized_shape, weight, bias, eps, rms):
    _check_norm(x, normalized_shape, weight, bias)
    rows, _ = R.norm_rows(x, normalized_shape)
    stats_dtype = torch.promote_types(x.dtype, torch.float32)
    return _new(x, *x.shape), _new(x, (0 if rms else rows) + rows + 1, dtype=stats_dtype)


@_fake("layer_norm_backward")
def _layer_norm_backward_fake(dy, x, stats, weight, bias, normalized_shape, rms):
    return tuple(_new(x, 0) if p is None else _new(p, *p.shape) for p in (x, weight, bias))


def _norm_setup(ctx, inputs, output):
    x, normalized_shape, weight, bias, _eps, rms = inputs
    ctx.save_for_backward(x, weight, bias, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.normalized_shape, ctx.rms = normalized_shape, rms


def _norm_backward(ctx, dy, _dstats):
    x, weight, bias, stats = ctx.saved_tensors
    dx, dw, db = OPS["layer_norm_backward"](dy, x, stats, weight, bias, ctx.normalized_shape, ctx.rms)
    return dx, None, (dw if weight is not None else None), (db if bias is not None else None), None, None


torch.library.register_autograd(f"{NAMESPACE}::layer_norm", _norm_backward, setup_context=_norm_setup, lib=_lib)


# Scaled masked softmax
@_fake("scaled_masked_softmax")
def _softmax_fake(x, mask, scale, causal):
    R.check_softmax_mask(x, mask, causal)
    return _new(x, *x.shape)


@_fake("scaled_masked_softmax_backward")
def _softmax_backward_fake(dy, y, scale):
    return _new(y, *y.shape)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[2]


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return OPS["scaled_masked_softmax_backward"](dy, y, ctx.scale), None, None, None


torch.library.register_autograd(f"{NAMESPACE}::scaled_masked_softmax", _softmax_backward,
                                setup_context=_softmax_setup, lib=_lib)


# LSTM cell and layer
@_fake("lstm_cell")
def _lstm_cell_fake(x, h, c, w_ih, w_hh, b_ih, b_hh):
    B, H = x.shape[0], w_hh.shape[1]
    return _new(x, B, H), _new(x, B, H), _new(x, B, 4 * H)


def _lstm_grads_fake(need, like, shapes):
    return tuple(_new(like, *s) if n else _new(like, 0) for n, s in zip(need, shapes))


@_fake("lstm_cell_backward")
def _lstm_cell_backward_fake(dh, dc, x, h, c, w_ih, w_hh, ws, c_new, need):
    return _lstm_grads_fake(need, x, (x.shape, h.shape, c.shape, w_ih.shape, w_hh.shape, (w_ih.shape[0],)))


def _need(ctx):
    """The backward ops' six flags from needs_input_grad (the two biases share one)."""
    n = ctx.needs_input_grad
    return [n[0], n[1], n[2], n[3], n[4], n[5] or n[6]]


def _lstm_input_grads(ctx, need, grads):
    """The seven input gradients (x, h, c, w_ih, w_hh, b_ih, b_hh) from the backward op's six."""
    *grads, db = grads
    n = ctx.needs_input_grad
    return (*[g if k else None for g, k in zip(grads, need)], db if n[5] else None, db if n[6] else None)


def _lstm_cell_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5], output[2], output[1])  # x, h, c, w_ih, w_hh, workspace, c'
    ctx.mark_non_differentiable(output[2])


def _lstm_cell_backward(ctx, dh, dc, _dws):
    x, h, c, w_ih, w_hh, ws, c1 = ctx.saved_tensors
    need = _need(ctx)
    return _lstm_input_grads(ctx, need, OPS["lstm_cell_backward"](dh, dc, x, h, c, w_ih, w_hh, ws, c1, need))


torch.library.register_autograd(f"{NAMESPACE}::lstm_cell", _lstm_cell_backward, setup_context=_lstm_cell_setup,
                                lib=_lib)


def _check_layer_input(x):
    if x.dim() != 3 or x.shape[0] == 0:
        raise ValueError(f"lstm_layer: x must be (T, batch, input_size) with T >= 1, got shape {tuple(x.shape)}")


@_impl("lstm_layer")
def _lstm_layer_cpu(x, h0, c0, w_ih, w_hh, b_ih, b_hh):
    _check_layer_input(x)
    return R.lstm_layer_forward(x, h0, c0, w_ih, w_hh, b_ih, b_hh)


@_fake("lstm_layer")
def _lstm_layer_fake(x, h0, c0, w_ih, w_hh, b_ih, b_hh):
    _check_layer_input(x)
    T, B, H = x.shape[0], x.shape[1], w_hh.shape[1]
    return _new(x, T, B, H), _new(x, B, H), _new(x, T, B, H), _new(x, T, B, 4 * H)


@_fake("lstm_layer_backward")
def _lstm_layer_backward_fake(d_out, dc_n, x, h0, c0, out, c_all, ws, w_ih, w_hh, need):
    return _lstm_grads_fake(need, x, (x.shape, h0.shape, c0.shape, w_ih.shape, w_hh.shape, (w_ih.shape[0],)))


def _lstm_layer_setup(ctx, inputs, output):
    out, _c_n, c_all, ws = output
    ctx.save_for_backward(*inputs[:5], out, c_all, ws)  # x, h0, c0, w_ih, w_hh, ...
    ctx.mark_non_differentiable(c_all, ws)


def _lstm_layer_backward(ctx, d_out, dc_n, _dc_all, _dws):
    x, h0, c0, w_ih, w_hh, out, c_all, ws = ctx.saved_tensors
    need = _need(ctx)
    grads = OPS["lstm_layer_backward"](d_out, dc_n, x, h0, c0, out, c_all, ws, w_ih, w_hh, need)
    return _lstm_input_grads(ctx, need, grads)


torch.library.register_autograd(f"{NAMESPACE}::lstm_layer", _lstm_layer_backward, setup_context=_lstm_layer_setup,
                                lib=_lib)


# Max pooling: channels_last in and out (what the kernels write, so the fakes give those strides)
_CL = torch.channels_last


@_impl("max_pool2d")
def _max_pool2d_cpu(x, kernel_size, stride, padding):
    R.check_max_pool2d(x, kernel_size, stride, padding, "mptrain::max_pool2d")
    return R.max_pool2d_forward(x, kernel_size, stride, padding)


@_fake("max_pool2d")
def _max_pool2d_fake(x, kernel_size, stride, padding):
    R.check_max_pool2d(x, kernel_size, stride, padding, "mptrain::max_pool2d")
    ho, wo = R.pool_out_size(x.shape[2:], kernel_size, stride, padding)
    n, c = x.shape[:2]
    return _new(x, n, c, ho, wo, memory_format=_CL), _new(x, n, c, ho, wo, dtype=torch.int8, memory_format=_CL)


@_impl("max_pool2d_backward")
def _max_pool2d_backward_cpu(dy, offsets, input_size, kernel_size, stride, padding):
    return R.max_pool2d_backward(dy, offsets, input_size, kernel_size, stride, padding)


@_fake("max_pool2d_backward")
def _max_pool2d_backward_fake(dy, offsets, input_size, kernel_size, stride, padding):
    return _new(dy, dy.shape[0], dy.shape[1], *input_size, memory_format=_CL)


def _max_pool2d_setup(ctx, inputs, output):
    x, ctx.kernel_size, ctx.stride, ctx.padding = inputs
    ctx.input_size = list(x.shape[2:])
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _max_pool2d_backward(ctx, dy, _doffsets):
    (offsets,) = ctx.saved_tensors
    dx = OPS["max_pool2d_backward"](dy.contiguous(memory_format=_CL), offsets, ctx.input_size,
                                    ctx.kernel_size, ctx.stride, ctx.padding)
    return dx, None, None, None


torch.library.register_autograd(f"{NAMESPACE}::max_pool2d", _max_pool2d_backward, setup_context=_max_pool2d_setup,
                                lib=_lib)


# Multi-tensor ops (in place, no outputs)
@_impl("multi_tensor_unscale_")
def _unscale_cpu(tensors, inv_scale, found_inf):
    R.multi_tensor_scale(tensors, tensors, inv_scale, found_inf)


@_impl("multi_tensor_check_finite_")
def _check_finite_cpu(tensors, found_inf):
    R.multi_tensor_scale(tensors, [], None, found_inf)


@_impl("multi_tensor_l2norm")
def _l2norm_cpu(tensors, per_tensor):
    total, norms = R.multi_tensor_l2norm(tensors, per_tensor)
    return total, (norms if per_tensor else total.new_empty(0))


@_fake("multi_tensor_l2norm")
def _l2norm_fake(tensors, per_tensor):
    if not tensors:
        raise ValueError("multi_tensor_l2norm: got an empty list; pass at least one tensor")
    t = tensors[0]
    return _new(t, dtype=torch.float32), _new(t, len(tensors) if per_tensor else 0, dtype=torch.float32)


def _step_cpu(reference_step, lr_at):
    """The CPU kernel of an optimizer-step op: the reference, with the schema's (lr, lr_tensor) at
    positions ``lr_at``, ``lr_at + 1`` passed as one lr (the tensor when given)."""

    def kernel(*args):
        lr, lr_tensor = args[lr_at:lr_at + 2]
        reference_step(*args[:lr_at], lr if lr_tensor is None else lr_tensor, *args[lr_at + 2:])

    return kernel


for _name, _step, _lr_at in (("multi_tensor_adam_", R.multi_tensor_adam, 6),
                             ("multi_tensor_sgd_", R.multi_tensor_sgd, 5),
                             ("multi_tensor_lamb_", R.multi_tensor_lamb, 6),
                             ("multi_tensor_adam_sr_", R.multi_tensor_adam_sr, 5),
                             ("multi_tensor_sgd_sr_", R.multi_tensor_sgd_sr, 4),
                             ("multi_tensor_lamb_sr_", R.multi_tensor_lamb_sr, 5)):
    _impl(_name)(_step_cpu(_step, _lr_at))


def _check_round_args(x, step, tensor):
    if x.dtype != torch.float32:
        raise TypeError(f"mptrain::stochastic_round: expected float32 input, got {x.dtype}")
    if not (0 <= step < 2 ** 32 and 0 <= tensor < 2 ** 32):
        raise ValueError(f"mptrain::stochastic_round: step and tensor must lie in [0, 2^32), got step={step}, "
                         f"tensor={tensor}")


@_impl("stochastic_round")
def _stochastic_round_cpu(x, seed, step, tensor):
    _check_round_args(x, step, tensor)
    return R.stochastic_round(x if R.is_dense(x) else x.contiguous(), seed, step, tensor)


@_fake("stochastic_round")
def _stochastic_round_fake(x, seed, step, tensor):
    _check_round_args(x, step, tensor)
    if R.is_dense(x):  # the kernel keeps a dense layout (the elements' memory order)
        return torch.empty_strided(x.shape, x.stride(), dtype=torch.bfloat16, device=x.device)
    return _new(x, *x.shape, dtype=torch.bfloat16)


for _name in ("multi_tensor_scale_", "multi_tensor_unscale_", "multi_tensor_check_finite_", "multi_tensor_adam_",
              "multi_tensor_sgd_", "multi_tensor_lamb_", "multi_tensor_adam_sr_", "multi_tensor_sgd_sr_",
              "multi_tensor_lamb_sr_"):
    torch.library.register_fake(f"{NAMESPACE}::{_name}", lambda *_args: None, lib=_lib)  # no outputs


# The backward ops: not differentiable again
def _twice(name):
    def backward(ctx, *grads):
        raise RuntimeError(f"mptrain::{name} has no derivative: the fused ops are differentiable once; use fused=False "
                           "(the pure-PyTorch reference) for double backward")

    return backward


for _name in ("layer_norm_backward", "scaled_masked_softmax_backward", "lstm_cell_backward", "lstm_layer_backward",
              "max_pool2d_backward"):
    torch.library.register_autograd(f"{NAMESPACE}::{_name}", _twice(_name), lib=_lib)
