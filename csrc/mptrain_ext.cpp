// The single pybind front end of the mptrain extension: declarations and m.def only.
// Each kernel family lives in its own .cu file; keep this file free of logic.
#include <torch/extension.h>
#include <vector>

// ---- multi-tensor ops and optimizers (multi_tensor_*.cu) ----
// [section: multi_tensor]
// [end section: multi_tensor]

// ---- normalization (layer_norm.cu) ----
// [section: layer_norm]
// [end section: layer_norm]

// ---- softmax (softmax.cu) ----
// [section: softmax]
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
// [end section: lstm]

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // [defs: multi_tensor]
  // [end defs: multi_tensor]
  // [defs: layer_norm]
  // [end defs: layer_norm]
  // [defs: softmax]
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
  // [end defs: lstm]
}
