// Launch helpers shared by the kernel families: programmatic dependent launch (PDL) and
// the sizing of persistent (resident) grids.
//
// * PDL (Hopper, sm_90+): a kernel launched with cudaLaunchAttributeProgrammaticStream-
//   Serialization may launch, become resident and run its prologue while the previous
//   kernel in the stream is still draining, which hides most of the launch latency and
//   ramp between back-to-back kernels (LayerNorm forward -> backward -> finish).  Such a
//   kernel must call pdl_wait() in every block before it touches memory the previous
//   kernel may write, and before it exits (that keeps "grid completed" transitive along a
//   chain of PDL launches).  pdl_launch_dependents() lets the next PDL-launched kernel
//   start launching once every block of this grid has called it; calling it first thing
//   is safe because the dependent still waits for this grid's completion in its own
//   pdl_wait().  Both are no-ops below sm_90 and in a kernel launched without the
//   attribute.  Stream capture records the attribute as a programmatic graph edge
//   (CUDA >= 12.3), so PDL launches work inside CUDA graphs.
// * Persistent grids: as many blocks as are resident at once (occupancy API x SMs), each
//   looping over rows or chunks; balanced_grid() then trims the grid so that the last
//   iteration is (nearly) full.
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace mpt {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

inline int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// Whether PDL may be used with `kernel` on the current device: sm_90+ and a binary
// compiled from sm_90+ PTX (a binary JIT-compiled from older PTX has no griddepcontrol.wait
// in it, and the attribute would then let it read memory the previous kernel is writing).
template <typename... KArgs>
bool pdl_supported(void (*kernel)(KArgs...)) {
  if (at::cuda::getCurrentDeviceProperties()->major < 9) return false;
  static const bool compiled_for_sm90 = [kernel] {
    cudaFuncAttributes a{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(kernel)));
    return a.ptxVersion >= 90;
  }();
  return compiled_for_sm90;
}

// Launches `kernel` on `stream`, with the programmatic-dependent-launch attribute when `pdl`.
template <typename... KArgs, typename... Args>
void launch_kernel(void (*kernel)(KArgs...), int64_t grid, int block, size_t smem, cudaStream_t stream, bool pdl,
                   Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// Resident blocks per SM of `kernel` (at least 1); sets the dynamic shared memory limit
// first when the kernel needs more than the default 48 KB.
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int block, size_t smem = 0) {
  if (smem > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block, smem));
  return n < 1 ? 1 : n;
}

// Blocks of `kernel` resident on the whole GPU at once (at least one per SM).
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int block, size_t smem = 0) {
  return int64_t(num_sms()) * blocks_per_sm(kernel, block, smem);
}

// Persistent grid over `groups` units of work with at most `cap` resident blocks: the
// iterations the resident grid needs, then the fewest blocks that cover the work in that
// many, so the last iteration is (nearly) full instead of, e.g., 64 of 2112 rows at
// 65536x768 on 264 blocks.  Never more than `cap`: kernels that wait inside the grid
// (LayerNorm's in-kernel finish) rely on every block being resident.
inline int64_t balanced_grid(int64_t groups, int64_t cap) {
  const int64_t iters = (groups + cap - 1) / cap;
  return (groups + iters - 1) / iters;
}

}  // namespace mpt
