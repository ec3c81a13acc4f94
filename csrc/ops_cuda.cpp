// The CUDA kernels of the custom ops torch.ops.mptrain.* (schemas: mptrain/ops/library.py).
//
// Each function adapts one host entry point (entry_points.h) to its op's schema: fixed
// tuples instead of vectors, contiguous inputs where the kernel reads row-major, empty
// tensors where the entry point leaves an output undefined (an op's Tensor return must be
// a tensor).  The schemas are defined in Python so the ops exist without this extension
// (CPU, failed build); registering implementations before the definition is allowed.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <tuple>
#include <vector>

#include "check.h"
#include "entry_points.h"
#include "new_tensor.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// An op's Tensor return must be a tensor: a 0-element one where the entry point leaves an
// output undefined (no storage, so no allocator call; without the dispatcher: host time).
Tensor or_empty(const Tensor& t, const Tensor& like) {
  return t.defined() ? t : mpt::new_cuda({0}, like);
}

// ---- normalization: stats = [mean (rows, LayerNorm only) | rstd (rows) | counter word].
// The counter is the backward's dweight/dbias finish ticket: the forward zeroes it and
// the backward leaves it zero again, so the op does not change `stats` (no (a!) in the schema).
int64_t norm_hidden(const char* op, const Tensor& x, at::IntArrayRef shape, const OptTensor& w, const OptTensor& b) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  MPT_CHECK(nd >= 1 && nd <= x.dim() && x.sizes().slice(x.dim() - nd).equals(shape), op, ": normalized_shape=",
            shape, " must be the trailing dims of the input, whose shape is ", x.sizes());
  for (const OptTensor* p : {&w, &b}) {
    MPT_CHECK(!p->has_value() || !(*p)->defined() || (*p)->sizes().equals(shape), op, ": ",
              p == &w ? "weight" : "bias", " has shape ", (*p)->sizes(), ", expected normalized_shape ", shape);
  }
  return c10::multiply_integers(shape);
}

std::tuple<Tensor, Tensor> layer_norm_cuda(const Tensor& x, at::IntArrayRef shape, const OptTensor& w,
                                           const OptTensor& b, double eps, bool rms) {
  const int64_t hidden = norm_hidden("mptrain::layer_norm", x, shape, w, b);
  return layer_norm_forward_stats(x.contiguous(), w, b, hidden, eps, rms);
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& stats,
                                                            const OptTensor& w, const OptTensor& b,
                                                            at::IntArrayRef shape, bool rms) {
  const int64_t hidden = norm_hidden("mptrain::layer_norm_backward", x, shape, w, b);
  auto r = layer_norm_backward_stats(dy.contiguous(), x.contiguous(), stats, w, b, hidden, rms);
  return {r[0], or_empty(r[1], x), or_empty(r[2], x)};
}

// ---- softmax
Tensor softmax_cuda(const Tensor& x, const OptTensor& mask, double scale, bool causal) {
  return scaled_masked_softmax_forward(x.contiguous(), mask, scale, causal);
}

Tensor softmax_backward_cuda(const Tensor& dy, const Tensor& y, double scale) {
  return scaled_masked_softmax_backward(dy.contiguous(), y.contiguous(), scale);
}

// ---- LSTM
std::tuple<Tensor, Tensor, Tensor> lstm_cell_cuda(const Tensor& x, const Tensor& h, const Tensor& c,
                                                  const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
                                                  const OptTensor& b_hh) {
  auto r = lstm_cell_forward(x, h, c.contiguous(), w_ih, w_hh, b_ih, b_hh);
  return {r[0], r[1], r[2]};
}

using Grads6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

Grads6 grads6(const std::vector<Tensor>& r, const Tensor& like) {
  return {or_empty(r[0], like), or_empty(r[1], like), or_empty(r[2], like),
          or_empty(r[3], like), or_empty(r[4], like), or_empty(r[5], like)};
}

OptTensor contiguous_or_none(const OptTensor& t) {
  return t.has_value() && t->defined() ? OptTensor(t->contiguous()) : std::nullopt;
}

Grads6 lstm_cell_backward_cuda(const OptTensor& dh, const OptTensor& dc, const Tensor& x, const Tensor& h,
                               const Tensor& c, const Tensor& w_ih, const Tensor& w_hh, const Tensor& ws,
                               const Tensor& c_new, std::array<bool, 6> need) {
  const std::vector<bool> nv(need.begin(), need.end());
  return grads6(lstm_cell_backward(contiguous_or_none(dh), contiguous_or_none(dc), x, h, c.contiguous(), w_ih, w_hh,
                                   ws, c_new, nv), x);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_layer_cuda(const Tensor& x, const Tensor& h0, const Tensor& c0,
                                                           const Tensor& w_ih, const Tensor& w_hh,
                                                           const OptTensor& b_ih, const OptTensor& b_hh) {
  MPT_CHECK(x.dim() == 3 && x.size(0) > 0, "mptrain::lstm_layer: x must be (T, batch, input_size) with T >= 1, got ",
            x.sizes());
  auto r = lstm_layer_forward(x.contiguous(), h0, c0.contiguous(), w_ih, w_hh, b_ih, b_hh);
  // c_n is a copy: the caller must not be able to change the saved cell states through it.
  return {r[0], r[1][-1].clone(), r[1], r[2]};
}

Grads6 lstm_layer_backward_cuda(const OptTensor& d_out, const OptTensor& dc_n, const Tensor& x, const Tensor& h0,
                                const Tensor& c0, const Tensor& out, const Tensor& c_all, const Tensor& ws,
                                const Tensor& w_ih, const Tensor& w_hh, std::array<bool, 6> need) {
  const std::vector<bool> nv(need.begin(), need.end());
  return grads6(lstm_layer_backward(contiguous_or_none(d_out), contiguous_or_none(dc_n), x.contiguous(), h0,
                                    c0.contiguous(), out, c_all, ws, w_ih, w_hh, nv), x);
}

// ---- max pooling (channels_last; mptrain/ops/pool.py makes the input so)
std::tuple<Tensor, Tensor> max_pool2d_cuda(const Tensor& x, at::IntArrayRef k, at::IntArrayRef stride,
                                           at::IntArrayRef pad) {
  auto r = max_pool2d_forward(x, k, stride, pad);
  return {r[0], r[1]};
}

// ---- multi-tensor ops (lists split by dtype in Python; the kernels check every tensor)
std::vector<Tensor> vec(at::TensorList l) { return l.vec(); }

void scale_cuda(at::TensorList src, at::TensorList dst, const OptTensor& scale, const OptTensor& found_inf) {
  multi_tensor_scale(vec(src), vec(dst), scale, found_inf);
}

void unscale_cuda(at::TensorList tensors, const Tensor& inv_scale, const OptTensor& found_inf) {
  const auto t = vec(tensors);
  multi_tensor_scale(t, t, inv_scale, found_inf);
}

void check_finite_cuda(at::TensorList tensors, const Tensor& found_inf) {
  multi_tensor_scale(vec(tensors), {}, std::nullopt, found_inf);
}

std::tuple<Tensor, Tensor> l2norm_cuda(at::TensorList tensors, bool per_tensor) {
  auto r = multi_tensor_l2norm(vec(tensors), per_tensor);
  return {r[0], per_tensor ? r[1] : at::empty({0}, r[0].options())};
}

void adam_cuda(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList steps, at::TensorList masters, double lr, const OptTensor& lr_tensor, double beta1,
               double beta2, double eps, double weight_decay, bool decoupled, bool maximize,
               const OptTensor& grad_scale, const OptTensor& found_inf) {
  multi_tensor_adam(vec(grads), vec(params), vec(exp_avgs), vec(exp_avg_sqs), vec(steps), vec(masters), lr, lr_tensor,
                    beta1, beta2, eps, weight_decay, decoupled, maximize, grad_scale, found_inf);
}

void sgd_cuda(at::TensorList grads, at::TensorList params, at::TensorList momentum_buffers, at::TensorList steps,
              at::TensorList masters, double lr, const OptTensor& lr_tensor, double momentum, double dampening,
              double weight_decay, bool nesterov, bool maximize, const OptTensor& grad_scale,
              const OptTensor& found_inf) {
  multi_tensor_sgd(vec(grads), vec(params), vec(momentum_buffers), vec(steps), vec(masters), lr, lr_tensor, momentum,
                   dampening, weight_decay, nesterov, maximize, grad_scale, found_inf);
}

void lamb_cuda(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList steps, at::TensorList masters, double lr, const OptTensor& lr_tensor, double beta1,
               double beta2, double eps, double weight_decay, bool bias_correction, bool maximize,
               const OptTensor& grad_scale, const OptTensor& found_inf) {
  multi_tensor_lamb(vec(grads), vec(params), vec(exp_avgs), vec(exp_avg_sqs), vec(steps), vec(masters), lr, lr_tensor,
                    beta1, beta2, eps, weight_decay, bias_correction, maximize, grad_scale, found_inf);
}

void adam_sr_cuda(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList steps, double lr, const OptTensor& lr_tensor, double beta1, double beta2, double eps,
                  double weight_decay, bool decoupled, bool maximize, const OptTensor& grad_scale,
                  const OptTensor& found_inf, int64_t seed, int64_t tensor_offset) {
  multi_tensor_adam_sr(vec(grads), vec(params), vec(exp_avgs), vec(exp_avg_sqs), vec(steps), lr, lr_tensor, beta1,
                       beta2, eps, weight_decay, decoupled, maximize, grad_scale, found_inf, seed, tensor_offset);
}

void sgd_sr_cuda(at::TensorList grads, at::TensorList params, at::TensorList momentum_buffers, at::TensorList steps,
                 double lr, const OptTensor& lr_tensor, double momentum, double dampening, double weight_decay,
                 bool nesterov, bool maximize, const OptTensor& grad_scale, const OptTensor& found_inf, int64_t seed,
                 int64_t tensor_offset) {
  multi_tensor_sgd_sr(vec(grads), vec(params), vec(momentum_buffers), vec(steps), lr, lr_tensor, momentum, dampening,
                      weight_decay, nesterov, maximize, grad_scale, found_inf, seed, tensor_offset);
}

void lamb_sr_cuda(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList steps, double lr, const OptTensor& lr_tensor, double beta1, double beta2, double eps,
                  double weight_decay, bool bias_correction, bool maximize, const OptTensor& grad_scale,
                  const OptTensor& found_inf, int64_t seed, int64_t tensor_offset) {
  multi_tensor_lamb_sr(vec(grads), vec(params), vec(exp_avgs), vec(exp_avg_sqs), vec(steps), lr, lr_tensor, beta1,
                       beta2, eps, weight_decay, bias_correction, maximize, grad_scale, found_inf, seed,
                       tensor_offset);
}

}  // namespace

TORCH_LIBRARY_IMPL(mptrain, CUDA, m) {
  m.impl("layer_norm", &layer_norm_cuda);
  m.impl("layer_norm_backward", &layer_norm_backward_cuda);
  m.impl("scaled_masked_softmax", &softmax_cuda);
  m.impl("scaled_masked_softmax_backward", &softmax_backward_cuda);
  m.impl("lstm_cell", &lstm_cell_cuda);
  m.impl("lstm_cell_backward", &lstm_cell_backward_cuda);
  m.impl("lstm_layer", &lstm_layer_cuda);
  m.impl("lstm_layer_backward", &lstm_layer_backward_cuda);
  m.impl("max_pool2d", &max_pool2d_cuda);
  m.impl("max_pool2d_backward", &max_pool2d_backward);
  m.impl("multi_tensor_scale_", &scale_cuda);
  m.impl("multi_tensor_unscale_", &unscale_cuda);
  m.impl("multi_tensor_check_finite_", &check_finite_cuda);
  m.impl("multi_tensor_l2norm", &l2norm_cuda);
  m.impl("multi_tensor_adam_", &adam_cuda);
  m.impl("multi_tensor_sgd_", &sgd_cuda);
  m.impl("multi_tensor_lamb_", &lamb_cuda);
  m.impl("multi_tensor_adam_sr_", &adam_sr_cuda);
  m.impl("multi_tensor_sgd_sr_", &sgd_sr_cuda);
  m.impl("multi_tensor_lamb_sr_", &lamb_sr_cuda);
  m.impl("stochastic_round", &stochastic_round);
}
