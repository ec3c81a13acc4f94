// Autograd for the custom ops on CUDA tensors, in C++ (the LSTM cell's node is in
// lstm_autograd.cu): mptrain::layer_norm, mptrain::scaled_masked_softmax, mptrain::lstm_layer.
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
// would be taken for a variable (and fail asking for its device).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <initializer_list>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

OptTensor opt(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
Tensor undef_if(bool keep, const Tensor& t) { return keep ? t : Tensor(); }

// Whether autograd must record this call (else the op runs below autograd, no node built).
bool track(std::initializer_list<const Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : ts) {
    if (t->defined() && t->requires_grad()) return true;
  }
  return false;
}

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// ---- LayerNorm / RMSNorm
using LnFwd = std::tuple<Tensor, Tensor>(const Tensor&, at::IntArrayRef, const OptTensor&, const OptTensor&, double,
                                         bool);
using LnBwd = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                                 const OptTensor&, at::IntArrayRef, bool);

struct NormFunction : public torch::autograd::Function<NormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& w, const OptTensor& b,
                               at::IntArrayRef shape, double eps, bool rms) {
    static const auto fwd = op<LnFwd>("mptrain::layer_norm");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, stats] = fwd.call(x, shape, w, b, eps, rms);
    ctx->save_for_backward({x, w.value_or(Tensor()), b.value_or(Tensor()), stats});
    ctx->saved_data["shape"] = shape;
    ctx->saved_data["rms"] = rms;
    ctx->mark_non_differentiable({stats});
    return {y, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<LnBwd>("mptrain::layer_norm_backward");
    const auto s = ctx->get_saved_variables();
    const auto shape = ctx->saved_data["shape"].toIntVector();
    at::AutoDispatchBelowADInplaceOrView below;  // once differentiable: skip the backward op's autograd kernel
    auto [dx, dw, db] = bwd.call(grads[0], s[0], s[3], opt(s[1]), opt(s[2]), shape, ctx->saved_data["rms"].toBool());
    // needs_input_grad counts edges, and an absent weight / bias has none.
    const bool need_w = s[1].defined() && ctx->needs_input_grad(1);
    const bool need_b = s[2].defined() && ctx->needs_input_grad(s[1].defined() ? 2 : 1);
    return {undef_if(ctx->needs_input_grad(0), dx), undef_if(need_w, dw), undef_if(need_b, db), Tensor(), Tensor(),
            Tensor()};
  }
};

std::tuple<Tensor, Tensor> layer_norm_autograd(const Tensor& x, at::IntArrayRef shape, const OptTensor& w,
                                               const OptTensor& b, double eps, bool rms) {
  const Tensor& wt = w.has_value() ? *w : x;
  const Tensor& bt = b.has_value() ? *b : x;
  if (!track({&x, &wt, &bt})) {
    static const auto fwd = op<LnFwd>("mptrain::layer_norm");
    at::AutoDispatchBelowADInplaceOrView below;
    return fwd.call(x, shape, w, b, eps, rms);
  }
  auto r = NormFunction::apply(x, w, b, shape, eps, rms);
  return {r[0], r[1]};
}

// ---- scaled masked softmax (the backward reads only the output)
using SmFwd = Tensor(const Tensor&, const OptTensor&, double, bool);
using SmBwd = Tensor(const Tensor&, const Tensor&, double);

struct SoftmaxFunction : public torch::autograd::Function<SoftmaxFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& mask, double scale,
                               bool causal) {
    static const auto fwd = op<SmFwd>("mptrain::scaled_masked_softmax");
    at::AutoDispatchBelowADInplaceOrView below;
    Tensor y = fwd.call(x, mask, scale, causal);
    ctx->save_for_backward({y});
    ctx->saved_data["scale"] = scale;
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<SmBwd>("mptrain::scaled_masked_softmax_backward");
    const auto s = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below;
    return {bwd.call(grads[0], s[0], ctx->saved_data["scale"].toDouble()), Tensor(), Tensor(), Tensor()};
  }
};

Tensor softmax_autograd(const Tensor& x, const OptTensor& mask, double scale, bool causal) {
  if (!track({&x})) {
    static const auto fwd = op<SmFwd>("mptrain::scaled_masked_softmax");
    at::AutoDispatchBelowADInplaceOrView below;
    return fwd.call(x, mask, scale, causal);
  }
  return SoftmaxFunction::apply(x, mask, scale, causal)[0];
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
    return {undef_if(n[0], dx),    undef_if(n[1], dh0), undef_if(n[2], dc0), undef_if(n[3], dw_ih),
            undef_if(n[4], dw_hh), undef_if(n[5], db),  undef_if(n[6], db)};
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
  m.impl("lstm_layer", &lstm_layer_autograd);
}
