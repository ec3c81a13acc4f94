// Autograd for the custom ops on CUDA tensors, in C++ (the LSTM cell's node is in
// lstm_autograd.cu): mptrain::layer_norm, mptrain::scaled_masked_softmax and
// mptrain::max_pool2d as hand-written nodes (an eager call of each is held to the host time
// of torch's nearest op; the norms and softmax run many times a step), mptrain::lstm_layer as a
// torch::autograd::Function (once per layer and sequence: its overhead does not matter).
//
// Why C++: a Python autograd.Function costs ~95 us of host time each way per call on an
// H200 host, more than the kernels themselves at small and medium shapes; these nodes cost
// what torch's own generated nodes cost.  The CPU path keeps the Python formula
// (torch.library.register_autograd in mptrain/ops/library.py): a registration for the
// AutogradCUDA key takes precedence over that alias registration for CUDA tensors.
//
// Forward and backward call the ops through the dispatcher (below autograd), never the
// kernels directly, so torch.compile's tracing (fake tensors, AOTAutograd) sees them as ops.
// Optional tensors stay std::optional into Function::apply: an undefined at::Tensor there
// would be taken for a variable (and fail asking for its device). A node is built only when
// a gradient is needed (grad mode on, an input requiring grad).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <array>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "autograd_node.h"
#include "check.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Tensor undef_if(bool keep, const Tensor& t) { return keep ? t : Tensor(); }
using mpt::has_fw_grad;
using mpt::make_node;
using mpt::op;
using mpt::opt;
using mpt::requires_grad;

// ---- LayerNorm / RMSNorm: a hand-written node (autograd_node.h says why), edges for
// (input, weight, bias) at fixed positions as torch's generated nodes have them (an
// absent parameter's edge is invalid and gets no gradient).
using LnFwd = std::tuple<Tensor, Tensor>(const Tensor&, at::IntArrayRef, const OptTensor&, const OptTensor&, double,
                                         bool);
using LnBwd = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                                 const OptTensor&, at::IntArrayRef, bool);

struct NormBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable x, w, b, stats;  // stats: a non-differentiable output (no grad_fn to cycle)
  std::vector<int64_t> shape;
  bool rms = false;

  std::string name() const override { return "MptLayerNormBackward"; }

  void release_variables() override {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (torch::autograd::SavedVariable* v : {&x, &w, &b, &stats}) v->reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    static const auto bwd = op<LnBwd>("mptrain::layer_norm_backward");
    const std::lock_guard<std::mutex> lock(mutex_);  // see torch's Note [Thread Safety on Autograd Node]
    variable_list out(3);
    if (!grads[0].defined()) return out;  // only stats was used: nothing flows back
    const Tensor sw = w.unpack(), sb = b.unpack();
    at::AutoDispatchBelowADInplaceOrView below;  // once differentiable: skip the backward op's autograd kernel
    const Tensor sx = x.unpack();
    auto [dx, dw, db] = bwd.call(grads[0], sx, stats.unpack(), opt(sw), opt(sb), shape, rms);
    if (task_should_compute_output(0)) out[0] = std::move(dx);
    if (sw.defined() && task_should_compute_output(1)) out[1] = std::move(dw);
    if (sb.defined() && task_should_compute_output(2)) out[2] = std::move(db);
    mpt::once_differentiable(out, {grads[0], sx, sw, sb}, "mptrain::layer_norm_backward");
    return out;
  }
};

std::tuple<Tensor, Tensor> layer_norm_autograd(const Tensor& x, at::IntArrayRef shape, const OptTensor& w,
                                               const OptTensor& b, double eps, bool rms) {
  static const auto fwd = op<LnFwd>("mptrain::layer_norm");
  const Tensor wt = w.value_or(Tensor()), bt = b.value_or(Tensor());
  for (const Tensor* t : {&x, &wt, &bt}) {
    MPT_CHECK(!has_fw_grad(*t), "layer_norm: forward-mode AD (dual tensors) is not supported by the fused kernel; "
              "use fused=False (the reference) for jvp / forward AD");
  }
  const bool track = at::GradMode::is_enabled() && (requires_grad(x) || requires_grad(wt) || requires_grad(bt));
  std::tuple<Tensor, Tensor> r;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    r = fwd.call(x, shape, w, b, eps, rms);
  }
  if (track) {
    auto node = make_node<NormBackward>();
    auto* n = static_cast<NormBackward*>(node.get());
    n->set_next_edges(torch::autograd::collect_next_edges(x, wt, bt));
    torch::autograd::set_history(std::get<0>(r), node);
    n->x = torch::autograd::SavedVariable(x, false);
    n->w = torch::autograd::SavedVariable(wt, false);
    n->b = torch::autograd::SavedVariable(bt, false);
    n->stats = torch::autograd::SavedVariable(std::get<1>(r), false);
    n->shape = shape.vec();
    n->rms = rms;
  }
  return r;
}

// ---- scaled masked softmax: a hand-written node; the backward reads only the output.
using SmFwd = Tensor(const Tensor&, const OptTensor&, double, bool);
using SmBwd = Tensor(const Tensor&, const Tensor&, double);

struct SoftmaxBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable y;  // the output: saved without its grad_fn (no reference cycle)
  double scale = 1.0;

  std::string name() const override { return "MptScaledMaskedSoftmaxBackward"; }

  void release_variables() override {
    const std::lock_guard<std::mutex> lock(mutex_);
    y.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    static const auto bwd = op<SmBwd>("mptrain::scaled_masked_softmax_backward");
    const std::lock_guard<std::mutex> lock(mutex_);
    variable_list out(1);
    if (!grads[0].defined() || !task_should_compute_output(0)) return out;
    const Tensor sy = y.unpack(getptr());
    at::AutoDispatchBelowADInplaceOrView below;
    out[0] = bwd.call(grads[0], sy, scale);
    mpt::once_differentiable(out, {grads[0], sy}, "mptrain::scaled_masked_softmax_backward");
    return out;
  }
};

Tensor softmax_autograd(const Tensor& x, const OptTensor& mask, double scale, bool causal) {
  static const auto fwd = op<SmFwd>("mptrain::scaled_masked_softmax");
  MPT_CHECK(!has_fw_grad(x), "scaled_masked_softmax: forward-mode AD (dual tensors) is not supported by the fused "
            "kernel; use fused=False (the reference) for jvp / forward AD");
  Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    y = fwd.call(x, mask, scale, causal);
  }
  if (at::GradMode::is_enabled() && x.requires_grad()) {
    auto node = make_node<SoftmaxBackward>();
    auto* n = static_cast<SoftmaxBackward*>(node.get());
    n->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(y, node);
    n->y = torch::autograd::SavedVariable(y, true);
    n->scale = scale;
  }
  return y;
}

// ---- max pooling: a hand-written node; the backward reads only the saved window offsets.
using PoolFwd = std::tuple<Tensor, Tensor>(const Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef);
using PoolBwd = Tensor(const Tensor&, const Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                       at::IntArrayRef);

struct MaxPoolBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable offsets;  // a non-differentiable output (int8, no grad_fn to cycle)
  std::vector<int64_t> input_size, kernel_size, stride, padding;

  std::string name() const override { return "MptMaxPool2DBackward"; }

  void release_variables() override {
    const std::lock_guard<std::mutex> lock(mutex_);
    offsets.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    static const auto bwd = op<PoolBwd>("mptrain::max_pool2d_backward");
    const std::lock_guard<std::mutex> lock(mutex_);
    variable_list out(1);
    if (!grads[0].defined() || !task_should_compute_output(0)) return out;
    const Tensor off = offsets.unpack();
    at::AutoDispatchBelowADInplaceOrView below;
    out[0] = bwd.call(grads[0].contiguous(at::MemoryFormat::ChannelsLast), off, input_size, kernel_size, stride,
                      padding);
    mpt::once_differentiable(out, {grads[0]}, "mptrain::max_pool2d_backward");
    return out;
  }
};

std::tuple<Tensor, Tensor> max_pool2d_autograd(const Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                               at::IntArrayRef padding) {
  static const auto fwd = op<PoolFwd>("mptrain::max_pool2d");
  MPT_CHECK(!has_fw_grad(x), "max_pool2d: forward-mode AD (dual tensors) is not supported by the fused kernel; "
            "use fused=False (torch's pool) for jvp / forward AD");
  std::tuple<Tensor, Tensor> r;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    r = fwd.call(x, kernel_size, stride, padding);
  }
  if (at::GradMode::is_enabled() && x.requires_grad()) {
    auto node = make_node<MaxPoolBackward>();
    auto* n = static_cast<MaxPoolBackward*>(node.get());
    n->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(std::get<0>(r), node);
    n->offsets = torch::autograd::SavedVariable(std::get<1>(r), false);
    n->input_size = {x.size(2), x.size(3)};
    n->kernel_size = kernel_size.vec();
    n->stride = stride.vec();
    n->padding = padding.vec();
  }
  return r;
}

// ---- LSTM layer: outputs (out, c_n) differentiable; c_all and the gate workspace saved.
using LayerFwd = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                            const Tensor&, const Tensor&, const OptTensor&,
                                                            const OptTensor&);
using Grads6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using LayerBwd = Grads6(const OptTensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, std::array<bool, 6>);

struct LSTMLayerFunction : public torch::autograd::Function<LSTMLayerFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& h0, const Tensor& c0,
                               const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh) {
    static const auto fwd = op<LayerFwd>("mptrain::lstm_layer");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, c_n, c_all, ws] = fwd.call(x, h0, c0, w_ih, w_hh, b_ih, b_hh);
    ctx->set_materialize_grads(false);  // an unused out or c_n costs no zero tensor
    ctx->save_for_backward({x, h0, c0, w_ih, w_hh, out, c_all, ws});
    ctx->mark_non_differentiable({c_all, ws});
    ctx->saved_data["b_ih"] = b_ih.has_value() && b_ih->defined();
    ctx->saved_data["b_hh"] = b_hh.has_value() && b_hh->defined();
    return {out, c_n, c_all, ws};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<LayerBwd>("mptrain::lstm_layer_backward");
    const auto s = ctx->get_saved_variables();
    // needs_input_grad counts edges: x, h0, c0, w_ih, w_hh, then each bias that is present.
    const bool has_bi = ctx->saved_data["b_ih"].toBool(), has_bh = ctx->saved_data["b_hh"].toBool();
    std::array<bool, 7> n{};
    for (size_t i = 0; i < 5; ++i) n[i] = ctx->needs_input_grad(i);
    n[5] = has_bi && ctx->needs_input_grad(5);
    n[6] = has_bh && ctx->needs_input_grad(has_bi ? 6 : 5);
    const std::array<bool, 6> need = {n[0], n[1], n[2], n[3], n[4], n[5] || n[6]};
    at::AutoDispatchBelowADInplaceOrView below;
    auto [dx, dh0, dc0, dw_ih, dw_hh, db] =
        bwd.call(opt(grads[0]), opt(grads[1]), s[0], s[1], s[2], s[5], s[6], s[7], s[3], s[4], need);
    variable_list out = {undef_if(n[0], dx),    undef_if(n[1], dh0), undef_if(n[2], dc0), undef_if(n[3], dw_ih),
                         undef_if(n[4], dw_hh), undef_if(n[5], db),  undef_if(n[6], db)};
    mpt::once_differentiable(out, {grads[0], grads[1], s[0], s[1], s[2], s[3], s[4]}, "mptrain::lstm_layer_backward");
    return out;
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_layer_autograd(const Tensor& x, const Tensor& h0, const Tensor& c0,
                                                               const Tensor& w_ih, const Tensor& w_hh,
                                                               const OptTensor& b_ih, const OptTensor& b_hh) {
  auto r = LSTMLayerFunction::apply(x, h0, c0, w_ih, w_hh, b_ih, b_hh);
  return {r[0], r[1], r[2], r[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(mptrain, AutogradCUDA, m) {
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("scaled_masked_softmax", &softmax_autograd);
  m.impl("max_pool2d", &max_pool2d_autograd);
  m.impl("lstm_layer", &lstm_layer_autograd);
}
