// Multi-tensor scale / inf check, L2 norm and step counting.
//
// What is fused and why:
// * scale: dst = src * scale and found_inf = 1 if any src element is inf/NaN, in one
//   pass over a whole list. With dst = src it is the loss scaler's unscale_ (reads and
//   writes each grad once: 4 B/param for half grads), and unlike torch's
//   _amp_foreach_non_finite_check_and_unscale_ it takes bf16. With another dtype it is
//   the master-weight path's grads-up / params-down copy (optionally unscaling on the
//   way up); with no dst it is a read-only inf check (2 B/param for half grads), which
//   the optimizers run before an update that must be skipped bit-exactly.
// * l2norm: each chunk writes its partial sum of squares (no atomics, so the result
//   is deterministic), one block per tensor adds its chunks, one block adds the tensors:
//   the global norm for gradient clipping and the per-tensor norms for LAMB.
// * step_increment: the optimizers' per-parameter step counts, +1 unless found_inf,
//   without leaving the device.
#include "multi_tensor_apply.cuh"

namespace mpt_mt {

void check_large_kernel_args_supported() {
  if (!kLargeKernelArgs) return;
  static const int driver = [] {
    int v = 0;
    C10_CUDA_CHECK(cudaDriverGetVersion(&v));
    return v;
  }();
  MPT_CHECK(driver >= 12010,
              "mptrain multi-tensor kernels were built with CUDA >= 12.1 and pass up to 30 KB of kernel "
              "arguments, which needs a driver for CUDA 12.1 or newer; this driver supports CUDA ",
              driver / 1000, ".", (driver % 1000) / 10,
              ". Update the driver, or rebuild with MPTRAIN_SMALL_KERNEL_ARGS=1 in the environment.");
}

// ---------------------------------------------------------------- scale / check

// lists: 0 src (Tin), 1 dst (Tout; same as src when only checking)
// 4 groups of 4 elements per thread (8-byte half accesses, 32 B in flight per thread,
// 4096-element chunks), for every dtype pair: for half -> half, 16-byte accesses (4 or 2
// groups of 8) were 7% slower on the H200.
template <typename Tin, typename Tout, bool WRITE, int ILP = 4, int V = kVec>
struct ScaleOp {
  static constexpr int kILP = ILP;  // two streams at most: more groups keep bytes in flight
  static constexpr int kVecElems = V;
  // 32 elements per thread spill at 64 registers (4 blocks/SM); allow 128.
  static constexpr int kMinBlocks = ILP * V > 16 ? 2 : 4;
  const float* scale;  // nullptr: plain copy
  float* found_inf;    // nullptr: no check
  __device__ bool skip() const { return false; }
  __device__ void operator()(const TensorListMeta<2>& meta, int t, int, int64_t off, int n) const {
    const Tin* src = static_cast<const Tin*>(meta.addr[0][t]) + off;
    Tout* dst = static_cast<Tout*>(meta.addr[1][t]) + off;
    const bool vec = vec_aligned<Tin, V>(src) && (!WRITE || vec_aligned<Tout, V>(dst));
    // Nearly every chunk is whole and aligned: give it branch-free code.
    if (vec && n == op_chunk<ScaleOp>()) apply<true>(src, dst, n, true);
    else apply<false>(src, dst, n, vec);
  }

  template <bool FULL>
  __device__ __forceinline__ void apply(const Tin* src, Tout* dst, int n, bool vec) const {
    float r[ILP][V];
    load_frag<FULL>(r, src, n, vec);
    bool bad = false;
#pragma unroll
    for (int k = 0; k < ILP; ++k)
#pragma unroll
      for (int j = 0; j < V; ++j) bad |= !isfinite(r[k][j]);  // padding reads as 0
    if (WRITE) {
      if (scale != nullptr) {
        const float s = *scale;
#pragma unroll
        for (int k = 0; k < ILP; ++k)
#pragma unroll
          for (int j = 0; j < V; ++j) r[k][j] *= s;
      }
      store_frag<FULL>(dst, r, n, vec);
    }
    // Every writer stores the same 1.0, so the race is benign; one store per warp.
    if (found_inf != nullptr && __any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) *found_inf = 1.f;
  }
};

template <typename Tin, typename Tout, bool WRITE>
void scale_launch(const std::vector<std::vector<at::Tensor>>& lists, const float* s, float* fi, const char* name) {
  multi_tensor_apply<2>(lists, 0, ScaleOp<Tin, Tout, WRITE>{s, fi}, name);
}

void multi_tensor_scale(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
                        const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& found_inf) {
  static const char* name = "multi_tensor_scale";
  if (src.empty()) return;
  const bool write = !dst.empty();
  const at::Device device = src[0].device();
  const float* s = scalar_ptr(scale, device, name, "scale");
  float* fi = const_cast<float*>(scalar_ptr(found_inf, device, name, "found_inf"));
  const std::vector<std::vector<at::Tensor>> lists{src, write ? dst : src};
  MPT_DISPATCH_FLOAT_HALF_BF16(src[0].scalar_type(), name, Tin,
    if (!write) {
      scale_launch<Tin, Tin, false>(lists, s, fi, name);
    } else {
      MPT_DISPATCH_FLOAT_HALF_BF16(dst[0].scalar_type(), name, Tout,
        scale_launch<Tin, Tout, true>(lists, s, fi, name));
    });
}

// ---------------------------------------------------------------- l2 norm

__device__ __forceinline__ double block_sum(double x) {
  __shared__ double warp_sums[kBlock / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  x = lane < kBlock / 32 ? warp_sums[lane] : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  __syncthreads();  // warp_sums is reused by the next call
  return x;         // the same value in every thread
}

// lists: 0 tensors. Writes the chunk's sum of squares to partial[chunk_base + chunk].
template <typename T>
struct L2PartialOp {
  static constexpr int kILP = 4;
  float* partial;
  __device__ bool skip() const { return false; }
  __device__ void operator()(const TensorListMeta<1>& meta, int t, int chunk, int64_t off, int n) const {
    const T* x = static_cast<const T*>(meta.addr[0][t]) + off;
    float r[kILP][kVec];
    const bool vec = vec_aligned<T>(x);
    if (vec && n == op_chunk<L2PartialOp>()) load_frag<true>(r, x, n, true);
    else load_frag<false>(r, x, n, vec);
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < kILP; ++k)
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc = fmaf(r[k][j], r[k][j], acc);
    const double total = block_sum(acc);
    if (threadIdx.x == 0) partial[meta.chunk_base + chunk] = static_cast<float>(total);
  }
};

// One block per tensor of the launch: adds the tensor's chunk partials.
__global__ void __launch_bounds__(kBlock)
    l2norm_per_tensor_kernel(const __grid_constant__ TensorListMeta<1> meta, const float* partial, double* sq) {
  const int t = blockIdx.x;
  const int begin = t == 0 ? 0 : meta.chunk_end[t - 1];
  const int end = meta.chunk_end[t];
  double acc = 0.0;
  for (int c = begin + threadIdx.x; c < end; c += kBlock) acc += partial[meta.chunk_base + c];
  acc = block_sum(acc);
  if (threadIdx.x == 0) sq[meta.tensor_base + t] = acc;
}

// One block: the total norm and the per-tensor norms.
__global__ void __launch_bounds__(kBlock) l2norm_final_kernel(const double* sq, int n, float* total, float* per_tensor) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < n; i += kBlock) {
    acc += sq[i];
    if (per_tensor != nullptr) per_tensor[i] = static_cast<float>(sqrt(sq[i]));
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) *total = static_cast<float>(sqrt(acc));
}

std::vector<at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& tensors, bool per_tensor) {
  static const char* name = "multi_tensor_l2norm";
  MPT_CHECK(!tensors.empty(), name, ": got an empty list; pass at least one tensor");
  const auto fopts = tensors[0].options().dtype(at::kFloat);
  at::Tensor total = at::empty({}, fopts);
  at::Tensor norms = per_tensor ? at::empty({static_cast<int64_t>(tensors.size())}, fopts) : at::Tensor();
  // Every entry is written by l2norm_per_tensor_kernel (empty tensors too): no fill needed.
  at::Tensor sq = at::empty({static_cast<int64_t>(tensors.size())}, fopts.dtype(at::kDouble));
  at::Tensor partial = at::empty({std::max<int64_t>(1, count_chunks(tensors, op_chunk<L2PartialOp<float>>()))}, fopts);
  float* partial_ptr = partial.data_ptr<float>();
  double* sq_ptr = sq.data_ptr<double>();
  const std::vector<std::vector<at::Tensor>> lists{tensors};
  MPT_DISPATCH_FLOAT_HALF_BF16(tensors[0].scalar_type(), name, T,
    for_each_launch<1>(lists, 0, op_chunk<L2PartialOp<T>>(), name, [&](const TensorListMeta<1>& meta, int chunks) {
      auto stream = at::cuda::getCurrentCUDAStream();
      if (chunks > 0) {
        const int grid = persistent_grid<1, L2PartialOp<T>>(chunks);
        multi_tensor_kernel<1, L2PartialOp<T>><<<grid, kBlock, 0, stream>>>(meta, L2PartialOp<T>{partial_ptr});
        MPT_CHECK_LAUNCH(name);
      }
      l2norm_per_tensor_kernel<<<meta.ntensors, kBlock, 0, stream>>>(meta, partial_ptr, sq_ptr);
      MPT_CHECK_LAUNCH(name);
    }));
  l2norm_final_kernel<<<1, kBlock, 0, at::cuda::getCurrentCUDAStream()>>>(
      sq_ptr, static_cast<int>(tensors.size()), total.data_ptr<float>(), per_tensor ? norms.data_ptr<float>() : nullptr);
  MPT_CHECK_LAUNCH(name);
  return {total, norms};
}

// ---------------------------------------------------------------- step counts

struct StepIncrementOp {
  static constexpr int kILP = 1;
  const float* found_inf;
  __device__ bool skip() const { return found_inf != nullptr && *found_inf != 0.f; }
  __device__ void operator()(const TensorListMeta<1>& meta, int t, int, int64_t, int) const {
    if (threadIdx.x == 0) *static_cast<float*>(meta.addr[0][t]) += 1.f;
  }
};

void step_increment(const std::vector<at::Tensor>& steps, const float* found_inf, const char* name) {
  if (steps.empty()) return;
  for (size_t i = 0; i < steps.size(); ++i)
    MPT_CHECK(steps[i].scalar_type() == at::kFloat, name, ": step ", i, " must be float32, got ",
                steps[i].scalar_type());
  multi_tensor_apply<1>({steps}, 1u, StepIncrementOp{found_inf}, name);
}

}  // namespace mpt_mt

// ---------------------------------------------------------------- entry points (mptrain_ext.cpp)

void multi_tensor_scale(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
                        const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& found_inf) {
  mpt_mt::multi_tensor_scale(src, dst, scale, found_inf);
}

std::vector<at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& tensors, bool per_tensor) {
  return mpt_mt::multi_tensor_l2norm(tensors, per_tensor);
}
