// The single pybind front end of the mptrain extension: declarations and m.def only.
// Each kernel family lives in its own .cu file; keep this file free of logic.
#include <torch/extension.h>
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
void multi_tensor_set_blocks_per_sm(int64_t blocks);
void multi_tensor_set_variant(int64_t variant);
// [end section: multi_tensor]

// ---- normalization (layer_norm.cu) ----
// [section: layer_norm]
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
// lstm_autograd.cu: the cell step as a C++ autograd Function (no Python per step).
std::tuple<at::Tensor, at::Tensor> lstm_cell_autograd(const at::Tensor& x, const at::Tensor& h,
                                                      const at::Tensor& c, const at::Tensor& w_ih,
                                                      const at::Tensor& w_hh,
                                                      const std::optional<at::Tensor>& b_ih,
                                                      const std::optional<at::Tensor>& b_hh);
// lstm_cell.cu: test hook for the direct-cuBLAS GEMM helper (cublas_gemm.cuh).
bool lstm_gemm_rm(at::Tensor out, const at::Tensor& a, bool trans_a, const at::Tensor& b, bool trans_b,
                  double beta);
// [end section: lstm]

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // [defs: multi_tensor]
  m.def("multi_tensor_scale", &multi_tensor_scale,
        "dst = src * scale (scale None: copy; dst []: check only); found_inf = 1 on any inf/NaN in src");
  m.def("multi_tensor_l2norm", &multi_tensor_l2norm, "-> [global L2 norm (0-dim fp32), per-tensor norms or undefined]");
  m.def("multi_tensor_adam", &multi_tensor_adam, "Adam/AdamW step over lists (masters [] = no master weights)");
  m.def("multi_tensor_sgd", &multi_tensor_sgd, "SGD step over lists (momentum_buffers [] when momentum == 0)");
  m.def("multi_tensor_lamb", &multi_tensor_lamb, "LAMB step over lists (masters [] = no master weights)");
  m.def("multi_tensor_set_blocks_per_sm", &multi_tensor_set_blocks_per_sm,
        "persistent grid size of the multi-tensor kernels in blocks per SM (0 = occupancy maximum)");
  m.def("multi_tensor_set_variant", &multi_tensor_set_variant,
        "code variant of the master-weight Adam and half unscale kernels (0 = default; for benchmarking)");
  // [end defs: multi_tensor]
  // [defs: layer_norm]
  m.def("layer_norm_forward", &layer_norm_forward,
        "LayerNorm (rms=False) / RMSNorm (rms=True) forward over the last `hidden` elements: "
        "(x, weight?, bias?, hidden, eps, rms) -> [y, mean (fp32, empty for RMS), rstd (fp32), "
        "work (int32 counter for the backward's dweight/dbias finish)]");
  m.def("layer_norm_backward", &layer_norm_backward,
        "LayerNorm / RMSNorm backward: (dy, x, mean, rstd, weight?, bias?, hidden, rms, work?) -> "
        "[dx, dweight?, dbias?]; work: the forward's, or None for a separate finish kernel");
  // [end defs: layer_norm]
  // [defs: softmax]
  m.def("scaled_masked_softmax_forward", &scaled_masked_softmax_forward,
        "softmax(where(mask | causal, -inf, scale * x), -1), fully masked rows -> 0: (x, mask?, scale, causal) -> y");
  m.def("scaled_masked_softmax_backward", &scaled_masked_softmax_backward,
        "dx = scale * y * (dy - sum(dy * y, -1)): (dy, y, scale) -> dx");
  // [end defs: softmax]
  // [defs: lstm]
  m.def("lstm_cell_pointwise_forward", &lstm_cell_pointwise_forward,
        "LSTM gate math, one kernel: (igates [+hgates] [+b_ih] [+b_hh], c) -> [h', c', workspace]");
  m.def("lstm_cell_pointwise_backward", &lstm_cell_pointwise_backward,
        "LSTM gate math backward, one kernel: (dh', dh2, dc', c, c', workspace) -> [dgates, dc]");
  m.def("lstm_cell_forward", &lstm_cell_forward, "LSTM step: 2 GEMMs + fused kernel -> [h', c', workspace]");
  m.def("lstm_cell_backward", &lstm_cell_backward,
        "LSTM step backward -> [dx, dh, dc, dw_ih, dw_hh, dbias] (undefined where not needed)");
  m.def("lstm_layer_forward", &lstm_layer_forward, "LSTM layer over (T, B, I) -> [out, c_all, workspace]");
  m.def("lstm_layer_backward", &lstm_layer_backward,
        "LSTM layer backward -> [dx, dh0, dc0, dw_ih, dw_hh, dbias] (undefined where not needed)");
  m.def("lstm_cell_autograd", &lstm_cell_autograd,
        "LSTM step with a C++ autograd node: (x, h, c, w_ih, w_hh, b_ih?, b_hh?) -> (h', c')");
  m.def("lstm_gemm_rm", &lstm_gemm_rm,
        "test hook: out = op(a) op(b) + beta * out as the LSTM GEMMs do it -> True if cuBLAS was called directly");
  // [end defs: lstm]
}
