// Helpers for the hand-written autograd nodes of the custom ops (ops_autograd.cpp,
// lstm_autograd.cu): nodes written like torch's generated ones (a Node subclass with
// SavedVariables, edges from collect_next_edges, set_history on the outputs) instead of a
// torch::autograd::Function, whose generic wrapping (input info, output wrapping, a
// string-keyed saved_data map, a generic backward checker) is host time on every call.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace mpt {

using NodePtr = decltype(torch::autograd::Edge::function);  // shared_ptr<Node>, or intrusive_ptr in newer torch

// A new node, owned as torch owns its nodes in this version (std::shared_ptr with torch's
// deleteNode, which unlinks long chains without deep recursion; or intrusive_ptr).
template <typename N, typename P = NodePtr, typename... Args>
P make_node(Args&&... args) {
  if constexpr (std::is_same_v<P, std::shared_ptr<torch::autograd::Node>>) {
    // torch::autograd::deleteNode (ADL)
    return std::shared_ptr<N>(new N(std::forward<Args>(args)...), [](auto* n) { deleteNode(n); });
  } else {
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
  }
}

// The op `name` ("mptrain::...") for typed calls through the dispatcher; look it up once.
template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

inline std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}
inline bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool has_fw_grad(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }

// Under create_graph (grad mode on inside a backward) the gradients a node returns must
// carry a graph, but the fused backward ops are differentiable once.  The node's backward
// runs its op below autograd either way (host time), and under create_graph this gives the
// defined gradients one Error node as history, with edges to what they depend on (incoming
// gradients, saved inputs): differentiating them raises the message the CPU path's formula
// raises (mptrain/ops/library.py), instead of the gradients coming back silently without
// a graph (a gradient penalty would then contribute nothing).
inline void once_differentiable(const torch::autograd::variable_list& grads_out,
                                const torch::autograd::variable_list& depends_on, const char* backward_op) {
  if (!at::GradMode::is_enabled()) return;
  bool any = false;
  for (const at::Tensor& t : depends_on) any = any || requires_grad(t);
  if (!any) return;
  auto node = make_node<torch::autograd::Error>(
      std::string(backward_op) + " has no derivative: the fused ops are differentiable once; use fused=False "
                                 "(the pure-PyTorch reference) for double backward",
      torch::autograd::collect_next_edges(depends_on));
  for (size_t i = 0; i < grads_out.size(); ++i) {
    const at::Tensor& g = grads_out[i];
    bool seen = false;  // one tensor may be returned for two edges (the LSTM cell's two biases)
    for (size_t j = 0; j < i; ++j) seen = seen || (grads_out[j].defined() && grads_out[j].is_same(g));
    if (g.defined() && !seen && !g.requires_grad()) torch::autograd::set_history(g, node);
  }
}

}  // namespace mpt
