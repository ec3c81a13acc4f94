// The LSTM cell as a hand-written C++ autograd node: one call from Python per step,
// forward and backward run without Python (no torch.autograd.Function, no PyNode, no GIL
// in the backward), and the step is one autograd node instead of the ~5 nn.LSTMCell
// records (two linears, their transposes, the fused cell).
//
// Why: a cell step is tiny on the GPU (6 GEMMs + 2 pointwise kernels, ~20-100 us on an
// H200) and its cost is host work per call; measured on the H200 the Python Function
// made our cell slower than nn.LSTMCell at 256x1024 (0.51 vs 0.34 ms).
//
// Registered as the AutogradCUDA kernel of the custom op mptrain::lstm_cell (schema in
// mptrain/ops/library.py; the CPU path uses the Python formula registered there).  Forward
// and backward call mptrain::lstm_cell / mptrain::lstm_cell_backward through the
// dispatcher (below autograd), so torch.compile traces them as ops.
// Host-only code; a .cu so that the extension build (mptrain_ext.cpp + csrc/*.cu) picks it up.
#include "autograd_node.h"
#include "type_shim.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

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

namespace {

using torch::autograd::variable_list;

using Grads6 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using CellFwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, const at::Tensor&,
                                                               const std::optional<at::Tensor>&,
                                                               const std::optional<at::Tensor>&);
using CellBwd = Grads6(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, std::array<bool, 6>);

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
using mpt::has_fw_grad;
using mpt::make_node;
using mpt::NodePtr;
using mpt::op;
using mpt::opt;
using mpt::requires_grad;

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
    const std::array<bool, 6> need = {task_should_compute_output(0), task_should_compute_output(1),
                                      task_should_compute_output(2), task_should_compute_output(3),
                                      task_should_compute_output(4), need_b_ih || need_b_hh};
    const at::Tensor sx = x.unpack(), sh = h.unpack(), sc = c.unpack(), swi = w_ih.unpack(),
                     swh = w_hh.unpack(), sws = ws.unpack(), sc1 = c1.unpack(getptr());
    static const auto bwd = op<CellBwd>("mptrain::lstm_cell_backward");
    at::AutoDispatchBelowADInplaceOrView below;  // once differentiable: skip the backward op's autograd kernel
    auto g = bwd.call(opt(grads[0]), opt(grads[1]), sx, sh, sc, swi, swh, sws, sc1, need);
    at::Tensor r[6] = {std::get<0>(g), std::get<1>(g), std::get<2>(g), std::get<3>(g), std::get<4>(g), std::get<5>(g)};
    // One gradient per edge; b_ih and b_hh get the same tensor (torch's nn.LSTMCell does too).
    variable_list out(num_outputs());
    for (size_t i = 0; i < 5; ++i) out[i] = need[i] ? std::move(r[i]) : at::Tensor();
    if (need_b_ih) out[5] = r[5];
    if (need_b_hh) out[ib_hh] = r[5];
    mpt::once_differentiable(out, {grads[0], grads[1], sx, sh, sc, swi, swh}, "mptrain::lstm_cell_backward");
    return out;
  }
};


// The AutogradCUDA kernel of mptrain::lstm_cell -> (h', c', workspace); biases may be None.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell_autograd(const at::Tensor& x, const at::Tensor& h,
                                                                  const at::Tensor& c, const at::Tensor& w_ih,
                                                                  const at::Tensor& w_hh,
                                                                  const std::optional<at::Tensor>& b_ih,
                                                                  const std::optional<at::Tensor>& b_hh) {
  static const auto fwd = op<CellFwd>("mptrain::lstm_cell");
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
  std::tuple<at::Tensor, at::Tensor, at::Tensor> r;
  {
    RECORD_FUNCTION("mpt::lstm_cell_node::forward", std::vector<c10::IValue>());
    {
      at::AutoDispatchBelowADInplaceOrView below;
      r = fwd.call(x, h, c, w_ih, w_hh, b_ih, b_hh);
    }
    if (track) {
      auto& [h1, c1, ws] = r;
      node = make_node<LSTMCellBackward>();
      auto* n = static_cast<LSTMCellBackward*>(node.get());
      n->has_b_ih = bi.defined();
      n->has_b_hh = bh.defined();
      n->set_next_edges(bi.defined() ? (bh.defined() ? torch::autograd::collect_next_edges(x, h, c, w_ih, w_hh, bi, bh)
                                                      : torch::autograd::collect_next_edges(x, h, c, w_ih, w_hh, bi))
                                     : (bh.defined() ? torch::autograd::collect_next_edges(x, h, c, w_ih, w_hh, bh)
                                                     : torch::autograd::collect_next_edges(x, h, c, w_ih, w_hh)));
      torch::autograd::set_history(h1, node);
      torch::autograd::set_history(c1, node);
      n->x = SavedVariable(x, false);
      n->h = SavedVariable(h, false);
      n->c = SavedVariable(c, false);
      n->w_ih = SavedVariable(w_ih, false);
      n->w_hh = SavedVariable(w_hh, false);
      n->ws = SavedVariable(ws, false);
      n->c1 = SavedVariable(c1, true);
    }
  }
  return r;
}

}  // namespace

TORCH_LIBRARY_IMPL(mptrain, AutogradCUDA, m) { m.impl("lstm_cell", &lstm_cell_autograd); }
