// The LSTM cell as a hand-written C++ autograd node: one call from Python per step,
// forward and backward run without Python (no torch.autograd.Function, no PyNode, no GIL
// in the backward), and the step is one autograd node instead of the ~5 nn.LSTMCell
// records (two linears, their transposes, the fused cell).
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

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
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

// The step's autograd node, written like torch's generated nodes rather than as a
// torch::autograd::Function (whose apply() builds a CppNode through generic wrapping --
// input extraction, output wrapping with view / dirty / non-differentiable handling, a
// string-keyed saved_data map -- and whose backward goes through a generic checker): that
// machinery is host time on every step. Same behaviour: one edge per defined input (an
// absent bias is no edge, so b_hh's index depends on b_ih being there); the task decides
// which gradients are computed (task_should_compute_output, what needs_input_grad reads);
// undefined incoming gradients stay undefined (set_materialize_grads(false) before);
// SavedVariable keeps the version checks (an input modified in place raises at backward)
// and saved-tensor hooks; release_variables frees them after a backward without
// retain_graph (a second one then raises, as before).
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using NodePtr = decltype(torch::autograd::Edge::function);  // shared_ptr<Node>, or intrusive_ptr in newer torch

struct LSTMCellBackward : public Node {
  SavedVariable x, h, c, w_ih, w_hh, ws, c1;  // c1 is an output (saved without its grad_fn)
  bool has_b_ih = false, has_b_hh = false;

  std::string name() const override { return "LSTMCellBackward"; }

  void release_variables() override {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (SavedVariable* v : {&x, &h, &c, &w_ih, &w_hh, &ws, &c1}) v->reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    // The whole node (its self time: saved-variable unpacking and checks); see lstm_cell_backward.
    RECORD_FUNCTION("mpt::lstm_cell_node::backward", std::vector<c10::IValue>());
    const std::lock_guard<std::mutex> lock(mutex_);  // see torch's Note [Thread Safety on Autograd Node]
    const size_t ib_hh = has_b_ih ? 6 : 5;
    const bool need_b_ih = has_b_ih && task_should_compute_output(5);
    const bool need_b_hh = has_b_hh && task_should_compute_output(ib_hh);
    const std::vector<bool> need = {task_should_compute_output(0), task_should_compute_output(1),
                                    task_should_compute_output(2), task_should_compute_output(3),
                                    task_should_compute_output(4), need_b_ih || need_b_hh};
    const at::Tensor sx = x.unpack(), sh = h.unpack(), sc = c.unpack(), swi = w_ih.unpack(),
                     swh = w_hh.unpack(), sws = ws.unpack(), sc1 = c1.unpack(getptr());
    const at::Tensor dh = grads[0].defined() ? grads[0].contiguous() : at::Tensor();
    const at::Tensor dc = grads[1].defined() ? grads[1].contiguous() : at::Tensor();
    auto r = sx.is_cuda() ? lstm_cell_backward(opt(dh), opt(dc), sx, sh, sc, swi, swh, sws, sc1, need)
                          : cpu_backward(dh, dc, sx, sh, sc, swi, swh, sws, sc1, need);
    // One gradient per edge; b_ih and b_hh get the same tensor (torch's nn.LSTMCell does too).
    variable_list out(num_outputs());
    for (size_t i = 0; i < 5; ++i) out[i] = std::move(r[i]);
    if (need_b_ih) out[5] = r[5];
    if (need_b_hh) out[ib_hh] = r[5];
    return out;
  }
};

// A new node, owned as torch owns its nodes in this version (std::shared_ptr with torch's
// deleteNode, which unlinks long chains without deep recursion; or intrusive_ptr).
template <typename N, typename P = NodePtr>
P make_node() {
  if constexpr (std::is_same_v<P, std::shared_ptr<Node>>) {
    return std::shared_ptr<N>(new N(), [](auto* n) { deleteNode(n); });  // torch::autograd::deleteNode (ADL)
  } else {
    return c10::make_intrusive<N>();
  }
}

bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
bool has_fw_grad(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }

}  // namespace

// One LSTM step with autograd -> (h', c'). Biases may be None.
std::tuple<at::Tensor, at::Tensor> lstm_cell_autograd(const at::Tensor& x, const at::Tensor& h,
                                                      const at::Tensor& c, const at::Tensor& w_ih,
                                                      const at::Tensor& w_hh,
                                                      const std::optional<at::Tensor>& b_ih,
                                                      const std::optional<at::Tensor>& b_hh) {
  const at::Tensor bi = b_ih.value_or(at::Tensor()), bh = b_hh.value_or(at::Tensor());
  const at::Tensor* in[] = {&x, &h, &c, &w_ih, &w_hh, &bi, &bh};
  bool any_grad = false;
  for (const at::Tensor* t : in) {
    MPT_CHECK(!has_fw_grad(*t), "lstm_cell: forward-mode AD (dual tensors) is not supported by the fused LSTM "
                "cell; use fused=False (the reference) for jvp / forward AD");
    any_grad = any_grad || requires_grad(*t);
  }
  const bool track = any_grad && at::GradMode::is_enabled();
  NodePtr node;
  at::Tensor cc;
  std::vector<at::Tensor> r;
  {
    RECORD_FUNCTION("mpt::lstm_cell_node::forward", std::vector<c10::IValue>());
    cc = c.contiguous();  // the kernel reads c row-major (no copy if it already is)
    if (x.is_cuda()) {
      r = lstm_cell_forward(x, h, cc, w_ih, w_hh, opt(bi), opt(bh));  // below autograd (plain outputs)
    } else {
      const at::AutoDispatchBelowADInplaceOrView no_autograd;
      r = cpu_forward(x, h, cc, w_ih, w_hh, bi, bh);
    }
    if (track) {
      node = make_node<LSTMCellBackward>();
      auto* n = static_cast<LSTMCellBackward*>(node.get());
      n->has_b_ih = bi.defined();
      n->has_b_hh = bh.defined();
      n->set_next_edges(bi.defined() ? (bh.defined() ? torch::autograd::collect_next_edges(x, h, c, w_ih, w_hh, bi, bh)
                                                      : torch::autograd::collect_next_edges(x, h, c, w_ih, w_hh, bi))
                                     : (bh.defined() ? torch::autograd::collect_next_edges(x, h, c, w_ih, w_hh, bh)
                                                     : torch::autograd::collect_next_edges(x, h, c, w_ih, w_hh)));
      torch::autograd::set_history(r[0], node);
      torch::autograd::set_history(r[1], node);
      n->x = SavedVariable(x, false);
      n->h = SavedVariable(h, false);
      n->c = SavedVariable(cc, false);
      n->w_ih = SavedVariable(w_ih, false);
      n->w_hh = SavedVariable(w_hh, false);
      n->ws = SavedVariable(r[2], false);
      n->c1 = SavedVariable(r[1], true);
    }
  }
  return {r[0], r[1]};  // a tuple in Python, like nn.LSTMCell's
}
