// The pybind front end of the mptrain extension: the kernels' host entry points as plain
// functions, for what Python still calls directly -- the kernel benchmarks and GPU tests
// (which time and check the kernels below the custom ops) and one test hook.  Training
// code reaches the kernels only through the custom ops torch.ops.mptrain.* (registered in
// ops_cuda.cpp and ops_autograd.cpp, schemas in mptrain/ops/library.py), and for the
// normalization layers also through the lean entry point of fast_call.cpp.
// Declarations live in entry_points.h; keep this file free of logic.
#include <torch/extension.h>

#include "entry_points.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // [defs: multi_tensor]
  m.def("multi_tensor_scale", &multi_tensor_scale,
        "dst = src * scale (scale None: copy; dst []: check only); found_inf = 1 on any inf/NaN in src");
  m.def("multi_tensor_l2norm", &multi_tensor_l2norm, "-> [global L2 norm (0-dim fp32), per-tensor norms or undefined]");
  m.def("multi_tensor_adam", &multi_tensor_adam, "Adam/AdamW step over lists (masters [] = no master weights)");
  m.def("multi_tensor_sgd", &multi_tensor_sgd, "SGD step over lists (momentum_buffers [] when momentum == 0)");
  m.def("multi_tensor_lamb", &multi_tensor_lamb, "LAMB step over lists (masters [] = no master weights)");
  m.def("multi_tensor_adam_sr", &multi_tensor_adam_sr,
        "Adam/AdamW step, bf16 params written with stochastic rounding (..., seed, tensor_offset)");
  m.def("multi_tensor_sgd_sr", &multi_tensor_sgd_sr,
        "SGD step, bf16 params written with stochastic rounding (..., seed, tensor_offset)");
  m.def("multi_tensor_lamb_sr", &multi_tensor_lamb_sr,
        "LAMB step, bf16 params written with stochastic rounding (..., seed, tensor_offset)");
  // [end defs: multi_tensor]
  // [defs: stochastic_round]
  m.def("stochastic_round", &stochastic_round, "float32 -> bfloat16, stochastic rounding: (x, seed, step, tensor)");
  // [end defs: stochastic_round]
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
  m.def("lstm_gemm_rm", &lstm_gemm_rm,
        "test hook: out = op(a) op(b) + beta * out as the LSTM GEMMs do it -> True if cuBLAS was called directly");
  // [end defs: lstm]
  register_fast_calls(m.ptr());  // fast_call.cpp: METH_FASTCALL entry points (norm)
}
