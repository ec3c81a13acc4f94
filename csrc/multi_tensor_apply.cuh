// Multi-tensor machinery: one kernel launch walks a whole list of tensors
// (hundreds of parameters) instead of one launch per tensor.
//
// Why it looks the way it does:
// * The tensor list travels in the kernel arguments (TensorListMeta, read through
//   __grid_constant__ so the compiler never copies it to local memory). Since
//   CUDA 12.1 a kernel may take 32 KB of arguments on sm_70+, enough for ~460
//   tensors with 6 pointers each: BERT-large's 392 parameters fit in ONE launch.
//   Older toolkits (or -DMPT_SMALL_KERNEL_ARGS) fall back to the classic 4 KB and
//   split the list over several launches.
// * Work is cut into chunks of a few thousand elements. A persistent grid (as many
//   blocks as fit on the GPU at once) strides over the concatenated chunk list,
//   so big and small tensors share the SMs evenly and the tail of a launch is at
//   most one chunk per block (a few microseconds).
// * Each thread handles ILP groups of kVec = 4 consecutive elements (ILP is chosen
//   per op: more groups for ops with few streams, so every op keeps enough bytes in
//   flight). One group is
//   one 16-byte access for fp32 and one 8-byte access for fp16/bf16, and a warp
//   covers 128 consecutive elements per group, so every access is fully coalesced
//   for every dtype mix (half grads next to fp32 masters). All loads of a chunk
//   are issued before any math, which keeps enough bytes in flight per SM. Ops give
//   whole, aligned chunks (nearly all of them) a branch-free path (load_frag<true>):
//   behind a per-group bounds test each load sits in its own branch, and the
//   compiler may wait for it (to convert it) before issuing the next one.
// * An op may choose 8 elements per access (kVecElems) for 16-byte half accesses.
// * The Adam master-weight step uses a queue kernel instead (resident grid, chunks handed
//   out by an atomic counter): see multi_tensor_queue_kernel.
// * A tensor whose pointers are not all aligned to the group size (a view with a
//   storage offset) takes the same element mapping with scalar accesses.
// * Math is fp32 whatever the storage type.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "launch.cuh"
#include "type_shim.h"

namespace mpt_mt {

constexpr int kBlock = 256;  // threads per block
constexpr int kVec = 4;      // consecutive elements per access

// Elements per chunk for an op whose threads handle ILP groups each.
template <int ILP>
constexpr int chunk_size() { return kBlock * kVec * ILP; }

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010 && !defined(MPT_SMALL_KERNEL_ARGS)
constexpr int kArgBudget = 30 * 1024;  // bytes of tensor-list metadata per launch
constexpr bool kLargeKernelArgs = true;
#else
constexpr int kArgBudget = 3 * 1024 + 512;
constexpr bool kLargeKernelArgs = false;
#endif

// The tensors of one launch. addr[d][i] is tensor i of list d; chunk_end[i] is the
// number of chunks in tensors 0..i (a prefix sum, so a block finds its tensor by
// walking forward). tensor_base / chunk_base place this launch inside the caller's
// whole list, for ops that write per-tensor or per-chunk results.
template <int DEPTH>
struct TensorListMeta {
  static constexpr int kMaxTensors = (kArgBudget - 16) / (DEPTH * 8 + 8 + 4);
  void* addr[DEPTH][kMaxTensors];
  int64_t numel[kMaxTensors];
  int chunk_end[kMaxTensors];
  int ntensors;
  int tensor_base;
  int chunk_base;
};

// ---------------------------------------------------------------- fragments
// V (elements per access) defaults to kVec; ops may pick 8 for 16-byte half accesses
// (then fp32 streams take two 16-byte accesses per group).

template <typename T, int V = kVec>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V = kVec>
__device__ __forceinline__ bool vec_aligned(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * V)) == 0;
}

// Element index of group k of this thread inside a chunk.
template <int V = kVec>
__device__ __forceinline__ int group_start(int k) { return (k * kBlock + threadIdx.x) * V; }

// Loads the thread's ILP x V elements as float; elements past n read as 0.
// FULL: the caller knows the chunk is whole and every pointer vector-aligned, so
// the loads are straight-line code with no per-group test; the compiler then issues
// every load of every stream before the first use (all bytes in flight at once).
template <bool FULL = false, typename T, int ILP, int V>
__device__ __forceinline__ void load_frag(float (&r)[ILP][V], const T* p, int n, bool vec) {
#pragma unroll
  for (int k = 0; k < ILP; ++k) {
    const int i = group_start<V>(k);
    if (FULL || (vec && i + V <= n)) {
      const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p + i);
#pragma unroll
      for (int j = 0; j < V; ++j) r[k][j] = static_cast<float>(pk.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) r[k][j] = (i + j < n) ? static_cast<float>(p[i + j]) : 0.f;
    }
  }
}

// Stores the elements below n, converting from float to T (round to nearest).
template <bool FULL = false, typename T, int ILP, int V>
__device__ __forceinline__ void store_frag(T* p, const float (&r)[ILP][V], int n, bool vec) {
#pragma unroll
  for (int k = 0; k < ILP; ++k) {
    const int i = group_start<V>(k);
    if (FULL || (vec && i + V <= n)) {
      Pack<T, V> pk;
#pragma unroll
      for (int j = 0; j < V; ++j) pk.v[j] = static_cast<T>(r[k][j]);
      *reinterpret_cast<Pack<T, V>*>(p + i) = pk;
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (i + j < n) p[i + j] = static_cast<T>(r[k][j]);
    }
  }
}

// Reads an optional device scalar (loss scale, lr, found_inf) or a default.
__device__ __forceinline__ float read_or(const float* p, float dflt) { return p ? *p : dflt; }

// ---------------------------------------------------------------- the kernel

// Op provides:
//   static constexpr int kILP;       // groups of V elements per thread per chunk
//   static constexpr int kVecElems;  // optional: V, elements per access (default kVec)
//   static constexpr int kMinBlocks; // optional: __launch_bounds__ min blocks/SM (default 4)
//   __device__ bool skip() const;   // true: the whole launch does nothing (found_inf set)
//   __device__ void operator()(const TensorListMeta<DEPTH>&, int t, int chunk, int64_t off, int n) const;
// `chunk` is the launch-local chunk index, `off` the element offset of the chunk in
// tensor t, n <= op_chunk<Op>() the number of elements in it. All threads of a block call
// the op for the same chunk, so ops may use __syncthreads.
template <typename Op, typename = void>
struct op_vec { static constexpr int value = kVec; };
template <typename Op>
struct op_vec<Op, std::void_t<decltype(Op::kVecElems)>> { static constexpr int value = Op::kVecElems; };
template <typename Op, typename = void>
struct op_min_blocks { static constexpr int value = 4; };
template <typename Op>
struct op_min_blocks<Op, std::void_t<decltype(Op::kMinBlocks)>> { static constexpr int value = Op::kMinBlocks; };

// Elements per chunk of an op.
template <typename Op>
constexpr int op_chunk() { return kBlock * op_vec<Op>::value * Op::kILP; }

template <int DEPTH, typename Op>
__global__ void __launch_bounds__(kBlock, op_min_blocks<Op>::value)
    multi_tensor_kernel(const __grid_constant__ TensorListMeta<DEPTH> meta, const __grid_constant__ Op op) {
  constexpr int kChunk = op_chunk<Op>();
  if (op.skip()) return;
  const int total = meta.chunk_end[meta.ntensors - 1];
  int t = 0;
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    while (c >= meta.chunk_end[t]) ++t;
    const int first = t == 0 ? 0 : meta.chunk_end[t - 1];
    const int64_t off = static_cast<int64_t>(c - first) * kChunk;
    const int64_t left = meta.numel[t] - off;
    op(meta, t, c, off, static_cast<int>(left < kChunk ? left : kChunk));
  }
}

// ---------------------------------------------------------------- the queue kernel
// A resident grid whose blocks take chunks from a global counter (atomicAdd) instead
// of a fixed stride: a block that finishes early takes more chunks, so the launch
// ends within about one chunk of the slowest block (the fixed-stride grids end when
// the last of their pre-assigned chunk lists does, a wave-quantization tail). Each
// block asks for its next chunk while it works on the current one (two shared slots,
// one barrier per chunk). The last block to finish (a second counter) runs
// op.last_block(meta) -- e.g. the step-count increment that otherwise needs a launch
// of its own -- and sets both counters back to zero (the host side gives every launch
// fresh zeroed counters anyway; the reset keeps the kernel correct for reused ones).
// A launch that skips (found_inf) touches neither counter.
struct QueueCounters {
  unsigned int next;  // next chunk to hand out
  unsigned int done;  // blocks finished
};

template <int DEPTH, typename Op>
__global__ void __launch_bounds__(kBlock, op_min_blocks<Op>::value)
    multi_tensor_queue_kernel(const __grid_constant__ TensorListMeta<DEPTH> meta, const __grid_constant__ Op op,
                              QueueCounters* q) {
  constexpr int kChunk = op_chunk<Op>();
  if (op.skip()) return;
  __shared__ int slot[2];
  __shared__ bool last;
  const int total = meta.chunk_end[meta.ntensors - 1];
  if (threadIdx.x == 0) slot[0] = static_cast<int>(atomicAdd(&q->next, 1u));
  __syncthreads();
  int t = 0;
  for (int s = 0;; s ^= 1) {
    const int c = slot[s];
    if (c >= total) break;
    // Slot s^1 was last read before the barrier that ended the previous chunk.
    if (threadIdx.x == 0) slot[s ^ 1] = static_cast<int>(atomicAdd(&q->next, 1u));
    while (c >= meta.chunk_end[t]) ++t;  // chunks of a block only increase
    const int first = t == 0 ? 0 : meta.chunk_end[t - 1];
    const int64_t off = static_cast<int64_t>(c - first) * kChunk;
    const int64_t left = meta.numel[t] - off;
    op(meta, t, c, off, static_cast<int>(left < kChunk ? left : kChunk));
    __syncthreads();
  }
  // Every thread of the block has left the loop: its reads of shared per-tensor values
  // (step counts) are done. Publish that, then count the block.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&q->done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other blocks' work (and reads) happened before their count
  op.last_block(meta);
  if (threadIdx.x == 0) {
    q->next = 0;
    q->done = 0;
  }
}

// ---------------------------------------------------------------- host side

void check_large_kernel_args_supported();

// Checks every list and calls launch(meta, chunks) once per group of at most
// kMaxTensors tensors, cutting tensors into chunks of `chunk` elements. Lists whose bit is set in `scalar_lists` hold one value
// per tensor (step counts) and are exempt from the numel/stride checks.
template <int DEPTH, typename Launch>
void for_each_launch(const std::vector<std::vector<at::Tensor>>& lists, unsigned scalar_lists, int chunk,
                     const char* name, Launch&& launch) {
  MPT_CHECK(lists.size() == DEPTH, name, ": expected ", DEPTH, " tensor lists, got ", lists.size());
  const size_t n = lists[0].size();
  for (int d = 1; d < DEPTH; ++d)
    MPT_CHECK(lists[d].size() == n, name, ": tensor list ", d, " has ", lists[d].size(),
                " tensors but list 0 has ", n, "; every list must have one tensor per parameter");
  if (n == 0) return;
  check_large_kernel_args_supported();
  const at::Device device = lists[0][0].device();
  MPT_CHECK(device.is_cuda(), name, ": tensors must be on a CUDA device, got ", device);
  for (int d = 0; d < DEPTH; ++d) {
    const at::ScalarType dtype = lists[d][0].scalar_type();
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& x = lists[d][i];
      const at::Tensor& ref = lists[0][i];
      MPT_CHECK(x.device() == device, name, ": list ", d, " tensor ", i, " is on ", x.device(),
                  " but list 0 tensor 0 is on ", device, "; all tensors of one call must share a device");
      MPT_CHECK(x.scalar_type() == dtype, name, ": list ", d, " mixes dtypes (", dtype, " and ",
                  x.scalar_type(), " at tensor ", i, "); split the list by dtype");
      if (scalar_lists & (1u << d)) {
        MPT_CHECK(x.numel() == 1, name, ": list ", d, " tensor ", i, " must hold one value, has ", x.numel());
        continue;
      }
      MPT_CHECK(x.numel() == ref.numel(), name, ": list ", d, " tensor ", i, " has ", x.numel(),
                  " elements but list 0 tensor ", i, " has ", ref.numel());
      MPT_CHECK(x.is_non_overlapping_and_dense(), name, ": list ", d, " tensor ", i,
                  " is not dense (call .contiguous() on it)");
      MPT_CHECK(x.strides() == ref.strides(), name, ": list ", d, " tensor ", i, " has strides ", x.strides(),
                  " but list 0 tensor ", i, " has ", ref.strides(), "; give them the same memory format");
    }
  }
  const c10::cuda::CUDAGuard guard(device);
  TensorListMeta<DEPTH> meta;
  meta.ntensors = 0;
  meta.tensor_base = 0;
  meta.chunk_base = 0;
  int chunks = 0;
  for (size_t i = 0; i < n; ++i) {
    // Empty tensors stay in the list with zero chunks, so tensor_base + t is always
    // the caller's index; the kernel's forward walk steps over them.
    const int64_t numel = lists[0][i].numel();
    const int64_t c = (numel + chunk - 1) / chunk;
    MPT_CHECK(meta.chunk_base + chunks + c < (int64_t{1} << 31), name, ": the lists hold more than 2^31 chunks");
    const int k = meta.ntensors;
    for (int d = 0; d < DEPTH; ++d) meta.addr[d][k] = lists[d][i].data_ptr();
    meta.numel[k] = numel;
    chunks += static_cast<int>(c);
    meta.chunk_end[k] = chunks;
    meta.ntensors = k + 1;
    if (meta.ntensors == TensorListMeta<DEPTH>::kMaxTensors || i + 1 == n) {
      launch(meta, chunks);
      meta.tensor_base += meta.ntensors;
      meta.chunk_base += chunks;
      meta.ntensors = 0;
      chunks = 0;
    }
  }
}

// Total chunks of a list (sizes the per-chunk scratch of reductions).
inline int64_t count_chunks(const std::vector<at::Tensor>& list, int chunk) {
  int64_t c = 0;
  for (const auto& x : list) c += (x.numel() + chunk - 1) / chunk;
  return c;
}

// Grid size of the kernel for `total_chunks` chunks: as many blocks as are resident at
// once on every SM (a persistent grid, no block waits for a slot), at most one per chunk.
template <int DEPTH, typename Op>
int persistent_grid(int total_chunks) {
  static const int64_t resident = mpt::resident_blocks(multi_tensor_kernel<DEPTH, Op>, kBlock);
  return total_chunks < resident ? total_chunks : static_cast<int>(resident);
}

// The common case: one persistent launch of `op` per group of tensors.
template <int DEPTH, typename Op>
void multi_tensor_apply(const std::vector<std::vector<at::Tensor>>& lists, unsigned scalar_lists, const Op& op,
                        const char* name) {
  static_assert(sizeof(TensorListMeta<DEPTH>) + sizeof(Op) <= (kLargeKernelArgs ? 32764 : 4096),
                "kernel arguments exceed the launch limit: lower kArgBudget");
  for_each_launch<DEPTH>(lists, scalar_lists, op_chunk<Op>(), name, [&](const TensorListMeta<DEPTH>& meta, int chunks) {
    if (chunks == 0) return;
    const int grid = persistent_grid<DEPTH, Op>(chunks);
    multi_tensor_kernel<DEPTH, Op><<<grid, kBlock, 0, at::cuda::getCurrentCUDAStream()>>>(meta, op);
    MPT_CHECK_LAUNCH(name);
  });
}

// The queue form of multi_tensor_apply: same lists and op (which must also provide
// `__device__ void last_block(const TensorListMeta<DEPTH>&) const`, run by one block after
// all others finished), grid = the blocks resident at once.
template <int DEPTH, typename Op>
void multi_tensor_apply_queue(const std::vector<std::vector<at::Tensor>>& lists, unsigned scalar_lists,
                              const Op& op, const char* name) {
  static_assert(sizeof(TensorListMeta<DEPTH>) + sizeof(Op) + sizeof(void*) <= (kLargeKernelArgs ? 32764 : 4096),
                "kernel arguments exceed the launch limit: lower kArgBudget");
  for_each_launch<DEPTH>(lists, scalar_lists, op_chunk<Op>(), name, [&](const TensorListMeta<DEPTH>& meta, int chunks) {
    static const int64_t resident = mpt::resident_blocks(multi_tensor_queue_kernel<DEPTH, Op>, kBlock);
    // At least one block even for a launch of empty tensors: its last block still runs.
    const int grid = chunks < resident ? (chunks > 0 ? chunks : 1) : static_cast<int>(resident);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    // Fresh zeroed counters per launch from the caching allocator: stream-ordered, private
    // to this launch (no state shared between streams, optimizers or captured graphs), and
    // captured with the launch (graph pool + memset node). Cost: one 8-byte memset.
    const at::Tensor counters = at::zeros({2}, lists[0][0].options().dtype(at::kInt));
    multi_tensor_queue_kernel<DEPTH, Op>
        <<<grid, kBlock, 0, stream>>>(meta, op, reinterpret_cast<QueueCounters*>(counters.data_ptr<int>()));
    MPT_CHECK_LAUNCH(name);
  });
}

// Optional 1-element float32 device tensor -> pointer (nullptr when absent).
inline const float* scalar_ptr(const std::optional<at::Tensor>& t, const at::Device& device, const char* name,
                               const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  MPT_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1, name, ": '", what,
              "' must be a float32 tensor with one element, got ", t->scalar_type(), " with ", t->numel(),
              " elements");
  MPT_CHECK(t->device() == device, name, ": '", what, "' is on ", t->device(), " but the tensors are on ",
              device);
  return t->data_ptr<float>();
}

// Every tensor of `list` must have `dtype`; the error names the list.
inline void check_dtype(const std::vector<at::Tensor>& list, at::ScalarType dtype, const char* name,
                        const char* what) {
  for (size_t i = 0; i < list.size(); ++i)
    MPT_CHECK(list[i].scalar_type() == dtype, name, ": ", what, "[", i, "] has dtype ", list[i].scalar_type(),
                ", expected ", dtype);
}

// The hyper-parameters Adam and LAMB share (their Args structs name the fields alike),
// checked and converted once on the host for the kernels.
template <typename Args>
void fill_moment_args(Args& a, const char* name, const at::Device& device, double lr,
                      const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double eps,
                      double weight_decay, bool maximize, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
  MPT_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0, name, ": betas must lie in [0, 1), got (",
              beta1, ", ", beta2, ")");  // log(0) = -inf gives a bias correction of exactly 1
  a.lr = static_cast<float>(lr);
  a.lr_ptr = scalar_ptr(lr_tensor, device, name, "lr");
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.log_beta1 = std::log(beta1);
  a.log_beta2 = std::log(beta2);
  a.maximize = maximize;
  a.grad_scale = scalar_ptr(grad_scale, device, name, "grad_scale");
  a.found_inf = scalar_ptr(found_inf, device, name, "found_inf");
}

// Dtypes of an Adam-family step's lists; true when fp32 masters carry half params
// (grads like the params, fp32 step counts; moments like the params, or fp32 with masters).
inline bool check_moment_lists(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                               const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& masters,
                               const char* name) {
  const at::ScalarType pt = params[0].scalar_type();
  check_dtype(grads, pt, name, "grads");
  check_dtype(steps, at::kFloat, name, "steps");
  if (masters.empty()) {
    check_dtype(exp_avgs, pt, name, "exp_avgs");
    check_dtype(exp_avg_sqs, pt, name, "exp_avg_sqs");
    return false;
  }
  MPT_CHECK(pt == at::kHalf || pt == at::kBFloat16, name, ": master weights are for float16/bfloat16 params, got ",
              pt, "; pass an empty master list for float32 params");
  check_dtype(masters, at::kFloat, name, "masters");
  check_dtype(exp_avgs, at::kFloat, name, "exp_avgs");
  check_dtype(exp_avg_sqs, at::kFloat, name, "exp_avg_sqs");
  return true;
}

// 1 - beta^step computed as -expm1(step * log(beta)) in double: exact for the
// small steps where 1 - beta^step is tiny and float would lose digits.
__device__ __forceinline__ double bias_correction(double log_beta, float step) {
  return -expm1(static_cast<double>(step) * log_beta);
}

// Global L2 norm (0-dim float32) and, when per_tensor, the norm of each tensor
// (float32 [n]) of a one-dtype list (multi_tensor_scale.cu).
std::vector<at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& tensors, bool per_tensor);

// Increments every step count by one unless *found_inf is non-zero (multi_tensor_scale.cu).
void step_increment(const std::vector<at::Tensor>& steps, const float* found_inf, const char* name);

}  // namespace mpt_mt
