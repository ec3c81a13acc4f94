// The LSTM cell as a C++ autograd Function: one call from Python per step, forward and
// backward run without Python (no torch.autograd.Function, no PyNode, no GIL in the
// backward), and the step is one autograd node instead of the ~5 nn.LSTMCell records
// (two linears, their transposes, the fused cell).
//
// Why: a cell step is tiny on the GPU (6 GEMMs + 2 pointwise kernels, ~20-100 us on an
// H200) and its cost is host work per call; measured on the H200 the Python Function
// made our cell slower than nn.LSTMCell at 256x1024 (0.51 vs 0.34 ms).
//
// The compute is lstm_cell_forward / lstm_cell_backward (lstm_cell.cu). CPU tensors take
// the same math in ATen ops, only so that this wiring can be tested on a machine without
// a GPU (the Python front end sends CPU tensors to the pure-PyTorch reference).
// Host-only code; a .cu so that the extension build (mptrain_ext.cpp + csrc/*.cu) picks it up.
#include "type_shim.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <tuple>
#include <vector>

// lstm_cell.cu
std::vector<at::Tensor> lstm_cell_forward(const at::Tensor& x, const at::Tensor& h, const at::Tensor& c,
                                          const at::Tensor& w_ih, const at::Tensor& w_hh,
                                          const std::optional<at::Tensor>& b_ih,
                                          const std::optional<at::Tensor>& b_hh);
std::vector<at::Tensor> lstm_cell_backward(const std::optional<at::Tensor>& dh,
                                           const std::optional<at::Tensor>& dc, const at::Tensor& x,
                                           const at::Tensor& h, const at::Tensor& c, const at::Tensor& w_ih,
                                           const at::Tensor& w_hh, const at::Tensor& ws,
                                           const at::Tensor& c_new, const std::vector<bool>& need);

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// CPU: the kernels' math in ATen ops -> [h', c', workspace (activated i, f, g, o)].
std::vector<at::Tensor> cpu_forward(const at::Tensor& x, const at::Tensor& h, const at::Tensor& c,
                                    const at::Tensor& w_ih, const at::Tensor& w_hh, const at::Tensor& b_ih,
                                    const at::Tensor& b_hh) {
  auto gates = at::mm(x, w_ih.t()).addmm_(h, w_hh.t());
  if (b_ih.defined()) gates = gates + b_ih;
  if (b_hh.defined()) gates = gates + b_hh;
  const auto q = gates.chunk(4, 1);
  const auto i = q[0].sigmoid(), f = q[1].sigmoid(), g = q[2].tanh(), o = q[3].sigmoid();
  const auto c1 = f * c + i * g;
  return {o * c1.tanh(), c1, at::cat({i, f, g, o}, 1)};
}

// CPU: lstm_cell_backward's math -> [dx, dh, dc, dw_ih, dw_hh, db] (undefined where not needed).
std::vector<at::Tensor> cpu_backward(const at::Tensor& dh, const at::Tensor& dc, const at::Tensor& x,
                                     const at::Tensor& h, const at::Tensor& c, const at::Tensor& w_ih,
                                     const at::Tensor& w_hh, const at::Tensor& ws, const at::Tensor& c1,
                                     const std::vector<bool>& need) {
  const auto q = ws.chunk(4, 1);
  const auto &i = q[0], &f = q[1], &g = q[2], &o = q[3];
  const auto dhv = dh.defined() ? dh : at::zeros_like(c1);
  const auto dcv = dc.defined() ? dc : at::zeros_like(c1);
  const auto tc = c1.tanh();
  const auto dct = dcv + dhv * o * (1 - tc * tc);
  const auto dg = at::cat({dct * g * i * (1 - i), dct * c * f * (1 - f), dct * i * (1 - g * g),
                           dhv * tc * o * (1 - o)}, 1);
  at::Tensor dx, dh0, dw_ih, dw_hh, db;
  if (need[0]) dx = at::mm(dg, w_ih);
  if (need[1]) dh0 = at::mm(dg, w_hh);
  if (need[3]) dw_ih = at::mm(dg.t(), x);
  if (need[4]) dw_hh = at::mm(dg.t(), h);
  if (need[5]) db = dg.sum(0);
  return {dx, dh0, need[2] ? dct * f : at::Tensor(), dw_ih, dw_hh, db};
}

// Inputs (x, h, c, w_ih, w_hh, b_ih?, b_hh?). An absent bias is no input edge at all, so
// the needs_input_grad index of b_hh depends on whether b_ih is there.
// Saves x, h, c, the weights, the activated gates (storage dtype) and c'.
struct LSTMCellFn : public torch::autograd::Function<LSTMCellFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& h,
                               const at::Tensor& c, const at::Tensor& w_ih, const at::Tensor& w_hh,
                               const std::optional<at::Tensor>& b_ih, const std::optional<at::Tensor>& b_hh) {
    RECORD_FUNCTION("mpt::lstm_cell_node::forward", std::vector<c10::IValue>());
    const at::Tensor cc = c.contiguous();  // the kernel reads c row-major (no copy if it already is)
    const at::Tensor bi = b_ih.value_or(at::Tensor()), bh = b_hh.value_or(at::Tensor());
    auto r = x.is_cuda() ? lstm_cell_forward(x, h, cc, w_ih, w_hh, opt(bi), opt(bh))
                         : cpu_forward(x, h, cc, w_ih, w_hh, bi, bh);
    ctx->set_materialize_grads(false);  // an unused h' or c' costs no zero tensor
    ctx->save_for_backward({x, h, cc, w_ih, w_hh, r[2], r[1]});
    ctx->saved_data["b_ih"] = bi.defined();
    ctx->saved_data["b_hh"] = bh.defined();
    return {r[0], r[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The whole node (its self time: saved-variable unpacking and checks); see lstm_cell_forward.
    RECORD_FUNCTION("mpt::lstm_cell_node::backward", std::vector<c10::IValue>());
    const auto s = ctx->get_saved_variables();
    const bool has_b_ih = ctx->saved_data["b_ih"].toBool(), has_b_hh = ctx->saved_data["b_hh"].toBool();
    const bool need_b_ih = has_b_ih && ctx->needs_input_grad(5);
    const bool need_b_hh = has_b_hh && ctx->needs_input_grad(has_b_ih ? 6 : 5);
    const std::vector<bool> need = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                    ctx->needs_input_grad(2), ctx->needs_input_grad(3),
                                    ctx->needs_input_grad(4), need_b_ih || need_b_hh};
    at::Tensor dh = grads[0].defined() ? grads[0].contiguous() : at::Tensor();
    at::Tensor dc = grads[1].defined() ? grads[1].contiguous() : at::Tensor();
    auto r = s[0].is_cuda() ? lstm_cell_backward(opt(dh), opt(dc), s[0], s[1], s[2], s[3], s[4], s[5], s[6], need)
                            : cpu_backward(dh, dc, s[0], s[1], s[2], s[3], s[4], s[5], s[6], need);
    // One gradient per forward argument (undefined for an absent bias); b_ih and b_hh
    // have the same gradient (torch's nn.LSTMCell does the same).
    return {r[0], r[1], r[2], r[3], r[4], need_b_ih ? r[5] : at::Tensor(), need_b_hh ? r[5] : at::Tensor()};
  }
};

}  // namespace

// One LSTM step with autograd -> (h', c'). Biases may be None.
std::tuple<at::Tensor, at::Tensor> lstm_cell_autograd(const at::Tensor& x, const at::Tensor& h,
                                                      const at::Tensor& c, const at::Tensor& w_ih,
                                                      const at::Tensor& w_hh,
                                                      const std::optional<at::Tensor>& b_ih,
                                                      const std::optional<at::Tensor>& b_hh) {
  auto r = LSTMCellFn::apply(x, h, c, w_ih, w_hh, b_ih, b_hh);
  return {r[0], r[1]};  // a tuple in Python, like nn.LSTMCell's
}
