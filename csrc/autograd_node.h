// Helpers for the hand-written autograd nodes of the custom ops (ops_autograd.cpp,
// lstm_autograd.cu): nodes written like torch's generated ones (a Node subclass with
// SavedVariables, edges from collect_next_edges, set_history on the outputs) instead of a
// torch::autograd::Function, whose generic wrapping (input info, output wrapping, a
// string-keyed saved_data map, a generic backward checker) is host time on every call.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <optional>
#include <type_traits>

namespace mpt {

using NodePtr = decltype(torch::autograd::Edge::function);  // shared_ptr<Node>, or intrusive_ptr in newer torch

// A new node, owned as torch owns its nodes in this version (std::shared_ptr with torch's
// deleteNode, which unlinks long chains without deep recursion; or intrusive_ptr).
template <typename N, typename P = NodePtr>
P make_node() {
  if constexpr (std::is_same_v<P, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<N>(new N(), [](auto* n) { deleteNode(n); });  // torch::autograd::deleteNode (ADL)
  } else {
    return c10::make_intrusive<N>();
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

}  // namespace mpt
