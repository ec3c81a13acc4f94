// A new uninitialised CUDA tensor: what at::empty / at::empty_like run for a contiguous
// CUDA tensor, without the dispatcher (~3 us of host time per call on the H200 host; an
// LSTM cell step allocates up to 9 tensors, a norm forward + backward 6).  For outputs
// and workspaces whose every element the kernels write before anything reads them.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>

namespace mpt {

inline at::Tensor new_cuda(at::IntArrayRef shape, at::ScalarType dtype, at::Device device) {
  return at::detail::empty_cuda(shape, dtype, device, std::nullopt);
}

// Contiguous, with ref's dtype and device.
inline at::Tensor new_cuda(at::IntArrayRef shape, const at::Tensor& ref) {
  return new_cuda(shape, ref.scalar_type(), ref.device());
}

}  // namespace mpt
