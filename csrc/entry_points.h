// The host entry points of the kernel families (one .cu each), declared once for the
// pybind front end (mptrain_ext.cpp) and the custom-op registrations (ops_cuda.cpp).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <vector>

// ---- multi-tensor ops and optimizers (multi_tensor_*.cu) ----
// [section: multi_tensor]
// Lists are one tensor per parameter; every tensor of a list shares dtype and device.
// Optional tensors (lr, grad_scale, found_inf) are 1-element float32 on that device.
void multi_tensor_scale(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
                        const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& found_inf);
std::vector<at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& tensors, bool per_tensor);
void multi_tensor_adam(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& masters, double lr,
                       const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double eps,
                       double weight_decay, bool decoupled, bool maximize,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);
void multi_tensor_sgd(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& steps,
                      const std::vector<at::Tensor>& masters, double lr, const std::optional<at::Tensor>& lr_tensor,
                      double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);
void multi_tensor_lamb(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& masters, double lr,
                       const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double eps,
                       double weight_decay, bool bias_correction, bool maximize,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);
// Stochastic rounding (bf16-sr): bf16 params and grads, fp32 state, no masters; the new weight is rounded
// stochastically from Philox keyed by (seed, step) with counter (tensor_offset + list index, element)
// (stochastic_round.cuh).
void multi_tensor_adam_sr(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<at::Tensor>& steps, double lr, const std::optional<at::Tensor>& lr_tensor,
                          double beta1, double beta2, double eps, double weight_decay, bool decoupled, bool maximize,
                          const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                          int64_t seed, int64_t tensor_offset);
void multi_tensor_sgd_sr(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& steps,
                         double lr, const std::optional<at::Tensor>& lr_tensor, double momentum, double dampening,
                         double weight_decay, bool nesterov, bool maximize, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, int64_t seed, int64_t tensor_offset);
void multi_tensor_lamb_sr(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<at::Tensor>& steps, double lr, const std::optional<at::Tensor>& lr_tensor,
                          double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
                          bool maximize, const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf, int64_t seed, int64_t tensor_offset);
// [end section: multi_tensor]

// ---- stochastic rounding (stochastic_round.cu) ----
// [section: stochastic_round]
// float32 -> bfloat16 rounded stochastically, element i with the bits of (seed, step, tensor, i in memory order).
at::Tensor stochastic_round(const at::Tensor& x, int64_t seed, int64_t step, int64_t tensor);
// [end section: stochastic_round]

// ---- normalization (layer_norm.cu) ----
// [section: layer_norm]
std::tuple<at::Tensor, at::Tensor> layer_norm_forward_stats(const at::Tensor& x,
                                                            const std::optional<at::Tensor>& weight,
                                                            const std::optional<at::Tensor>& bias, int64_t hidden,
                                                            double eps, bool rms);
std::vector<at::Tensor> layer_norm_backward_stats(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& stats,
                                                  const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias, int64_t hidden, bool rms);
std::vector<at::Tensor> layer_norm_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                           const std::optional<at::Tensor>& bias, int64_t hidden, double eps,
                                           bool rms);
std::vector<at::Tensor> layer_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                            const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
                                            const std::optional<at::Tensor>& bias, int64_t hidden, bool rms,
                                            const std::optional<at::Tensor>& work);
// [end section: layer_norm]

// ---- softmax (softmax.cu) ----
// [section: softmax]
at::Tensor scaled_masked_softmax_forward(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale,
                                         bool causal);
at::Tensor scaled_masked_softmax_backward(const at::Tensor& dy, const at::Tensor& y, double scale);
// [end section: softmax]

// ---- max pooling (max_pool.cu) ----
// [section: max_pool]
// channels_last 4-d tensors; offsets: int8, the window offset (kh * kernel_w + kw) of each output's maximum
std::vector<at::Tensor> max_pool2d_forward(const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                           at::IntArrayRef padding);
at::Tensor max_pool2d_backward(const at::Tensor& grad_out, const at::Tensor& offsets, at::IntArrayRef input_size,
                               at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding);
// [end section: max_pool]

// ---- LSTM cell (lstm_cell.cu) ----
// [section: lstm]
std::vector<at::Tensor> lstm_cell_pointwise_forward(const at::Tensor& igates,
                                                    const std::optional<at::Tensor>& hgates,
                                                    const at::Tensor& c,
                                                    const std::optional<at::Tensor>& b_ih,
                                                    const std::optional<at::Tensor>& b_hh);
std::vector<at::Tensor> lstm_cell_pointwise_backward(const std::optional<at::Tensor>& dh,
                                                     const std::optional<at::Tensor>& dh2,
                                                     const std::optional<at::Tensor>& dc,
                                                     const at::Tensor& c_prev, const at::Tensor& c_new,
                                                     const at::Tensor& ws);
std::vector<at::Tensor> lstm_cell_forward(const at::Tensor& x, const at::Tensor& h, const at::Tensor& c,
                                          const at::Tensor& w_ih, const at::Tensor& w_hh,
                                          const std::optional<at::Tensor>& b_ih,
                                          const std::optional<at::Tensor>& b_hh);
std::vector<at::Tensor> lstm_cell_backward(const std::optional<at::Tensor>& dh,
                                           const std::optional<at::Tensor>& dc, const at::Tensor& x,
                                           const at::Tensor& h, const at::Tensor& c, const at::Tensor& w_ih,
                                           const at::Tensor& w_hh, const at::Tensor& ws,
                                           const at::Tensor& c_new, const std::vector<bool>& need);
std::vector<at::Tensor> lstm_layer_forward(const at::Tensor& x, const at::Tensor& h0, const at::Tensor& c0,
                                           const at::Tensor& w_ih, const at::Tensor& w_hh,
                                           const std::optional<at::Tensor>& b_ih,
                                           const std::optional<at::Tensor>& b_hh);
std::vector<at::Tensor> lstm_layer_backward(const std::optional<at::Tensor>& d_out,
                                            const std::optional<at::Tensor>& dc_n, const at::Tensor& x,
                                            const at::Tensor& h0, const at::Tensor& c0, const at::Tensor& out,
                                            const at::Tensor& c_all, const at::Tensor& ws,
                                            const at::Tensor& w_ih, const at::Tensor& w_hh,
                                            const std::vector<bool>& need);
// lstm_cell.cu: test hook for the direct-cuBLAS GEMM helper (cublas_gemm.cuh).
bool lstm_gemm_rm(at::Tensor out, const at::Tensor& a, bool trans_a, const at::Tensor& b, bool trans_b,
                  double beta);
// [end section: lstm]

// ---- lean Python entry points (fast_call.cpp) ----
// Adds norm(...) (METH_FASTCALL) to the extension module.  struct _object is CPython's
// PyObject, named here so the .cu files that include this header need no Python.h.
void register_fast_calls(struct _object* module);
