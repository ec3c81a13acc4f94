// Fused LSTM cell: all pointwise gate math of one time step in one kernel forward
// and one kernel backward; the gate GEMMs stay in cuBLAS (called directly for 16-bit
// tensors, cublas_gemm.cuh: at::mm's cuBLAS call without its host work).
//
// Why fused: unfused, one LSTM step is ~15 elementwise kernels (bias adds, four
// activations, the cell update, tanh, products) each re-reading the (B, 4H) gates.
// Here the forward reads the gate pre-activations once, adds both biases, applies
// sigmoid/tanh, updates the cell and writes h', c' and the activated gates (the
// workspace the backward needs); the backward reads dh', dc', the workspace, c and
// c' once and writes the pre-activation gate gradients and dc; for the cell step it
// also sums the bias gradient over the batch (fp32, fixed order, same launch). Everything
// else in the backward (dx, dh, dW) is GEMMs; the layer sums its db over all steps at
// once with at::sum (once per layer: not worth a kernel).
//
// Host work per step is what a cell step costs at these sizes (an H200 runs a 256x1024
// step's GEMMs in tens of us; the host needs several times that), so the cell step
// makes the fewest ATen calls it can: fwd = mm + addmm_ into one buffer + the kernel,
// which writes the activated gates back over that buffer (no workspace allocation);
// bwd = the kernel (with the bias sum) + only the GEMMs whose result is needed (dc not
// even allocated when c needs no gradient); the GEMMs of one op share one cuBLAS handle
// fetch (cublas_gemm.cuh's Session) and the tensors skip the dispatcher (new_cuda).
//
// The sequence functions (lstm_layer_*) run the whole time loop in C++: one GEMM for
// every step's input projection up front, then per step one recurrent GEMM and one
// pointwise kernel, with no Python and no autograd node per step.
//
// Gate order is torch's (i, f, g, o), so weights are nn.LSTMCell / nn.LSTM compatible.
// Math is fp32; storage fp32/fp16/bf16 (all tensors of one call share the dtype).
#include "cublas_gemm.cuh"
#include "new_tensor.h"
#include "type_shim.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/record_function.h>

#include <c10/cuda/CUDACachingAllocator.h>

#include <mutex>
#include <optional>
#include <vector>

using mpt::new_cuda;

namespace {

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ void load_v(const T* p, float (&out)[V]) {
  const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int k = 0; k < V; ++k) out[k] = static_cast<float>(pk.v[k]);
}

template <typename T, int V>
__device__ __forceinline__ void store_v(T* p, const float (&in)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int k = 0; k < V; ++k) pk.v[k] = static_cast<T>(in[k]);
  *reinterpret_cast<Pack<T, V>*>(p) = pk;
}

__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

// One thread owns V consecutive hidden units of a row; blockIdx.y walks the rows.
// Rows of the gate tensors have a leading dimension so a time step sliced out of a
// (T, B, 4H) buffer needs no copy.
// ws may alias ig (same layout, ld 4H): each thread reads its four gate vectors of a row
// before it writes them back activated, so the cell needs no separate workspace buffer.
// (Hence no __restrict__ on that pair.)
template <typename T, int V>
__global__ void lstm_fwd_kernel(const T* ig, int64_t ig_ld, const T* __restrict__ hg,
                                int64_t hg_ld, const T* __restrict__ b_ih, const T* __restrict__ b_hh,
                                const T* __restrict__ c, T* __restrict__ h_out, T* __restrict__ c_out,
                                T* ws, int64_t B, int64_t H) {
  const int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (j >= H) return;
  // Both biases are the same for every row: sum them once per thread.
  float bias[4][V];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float t[V];
#pragma unroll
    for (int k = 0; k < V; ++k) bias[q][k] = 0.f;
    if (b_ih) {
      load_v<T, V>(b_ih + q * H + j, t);
#pragma unroll
      for (int k = 0; k < V; ++k) bias[q][k] += t[k];
    }
    if (b_hh) {
      load_v<T, V>(b_hh + q * H + j, t);
#pragma unroll
      for (int k = 0; k < V; ++k) bias[q][k] += t[k];
    }
  }
  for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
    float g[4][V];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      load_v<T, V>(ig + b * ig_ld + q * H + j, g[q]);
      if (hg) {
        float t[V];
        load_v<T, V>(hg + b * hg_ld + q * H + j, t);
#pragma unroll
        for (int k = 0; k < V; ++k) g[q][k] += t[k];
      }
    }
    float cp[V], hn[V], cn[V];
    load_v<T, V>(c + b * H + j, cp);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float i = sigmoid_f(g[0][k] + bias[0][k]);
      const float f = sigmoid_f(g[1][k] + bias[1][k]);
      const float gg = tanhf(g[2][k] + bias[2][k]);
      const float o = sigmoid_f(g[3][k] + bias[3][k]);
      cn[k] = f * cp[k] + i * gg;
      hn[k] = o * tanhf(cn[k]);
      g[0][k] = i;
      g[1][k] = f;
      g[2][k] = gg;
      g[3][k] = o;
    }
    store_v<T, V>(h_out + b * H + j, hn);
    store_v<T, V>(c_out + b * H + j, cn);
#pragma unroll
    for (int q = 0; q < 4; ++q) store_v<T, V>(ws + b * 4 * H + q * H + j, g[q]);
  }
}

// One row b of the backward for hidden units j .. j+V-1: reads dh, dh2, dc (any may be
// null = zero), the workspace, c and c'; writes the gate gradients (rounded to T) and dc
// (when dc_prev is not null); leaves the fp32 gate gradients in `a` (the bias gradient
// sums them before rounding). dc may alias dc_prev (each element is read, then written,
// by the same thread).
template <typename T, int V>
__device__ __forceinline__ void bwd_row(const T* __restrict__ dh, const T* __restrict__ dh2, const T* dc,
                                        const T* __restrict__ c_prev, const T* __restrict__ c_new,
                                        const T* __restrict__ ws, T* __restrict__ dgates, T* dc_prev, int64_t b,
                                        int64_t j, int64_t H, float (&a)[4][V]) {
  const int64_t r = b * H + j;
  float dhv[V], dcv[V], cp[V], cn[V], t[V];
#pragma unroll
  for (int q = 0; q < 4; ++q) load_v<T, V>(ws + b * 4 * H + q * H + j, a[q]);
#pragma unroll
  for (int k = 0; k < V; ++k) dhv[k] = dcv[k] = 0.f;
  if (dh) {
    load_v<T, V>(dh + r, t);
#pragma unroll
    for (int k = 0; k < V; ++k) dhv[k] += t[k];
  }
  if (dh2) {
    load_v<T, V>(dh2 + r, t);
#pragma unroll
    for (int k = 0; k < V; ++k) dhv[k] += t[k];
  }
  if (dc) load_v<T, V>(dc + r, dcv);
  load_v<T, V>(c_prev + r, cp);
  load_v<T, V>(c_new + r, cn);
  float dcp[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const float i = a[0][k], f = a[1][k], gg = a[2][k], o = a[3][k];
    const float tc = tanhf(cn[k]);
    const float dct = dcv[k] + dhv[k] * o * (1.f - tc * tc);
    a[0][k] = dct * gg * i * (1.f - i);
    a[1][k] = dct * cp[k] * f * (1.f - f);
    a[2][k] = dct * i * (1.f - gg * gg);
    a[3][k] = dhv[k] * tc * o * (1.f - o);
    dcp[k] = dct * f;
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) store_v<T, V>(dgates + b * 4 * H + q * H + j, a[q]);
  if (dc_prev) store_v<T, V>(dc_prev + r, dcp);
}

// dh, dh2 (a second dh' term, e.g. the recurrent one), dc: any may be null (= zero).
// dc may alias dc_prev; dc_prev may be null (c needs no gradient: no buffer allocated).
// Geometry as the forward (one thread: V units of a row; rows on blockIdx.y).
template <typename T, int V>
__global__ void lstm_bwd_kernel(const T* __restrict__ dh, const T* __restrict__ dh2, const T* dc,
                                const T* __restrict__ c_prev, const T* __restrict__ c_new,
                                const T* __restrict__ ws, T* __restrict__ dgates, T* dc_prev, int64_t B,
                                int64_t H) {
  const int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (j >= H) return;
  for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
    float a[4][V];
    bwd_row<T, V>(dh, dh2, dc, c_prev, c_new, ws, dgates, dc_prev, b, j, H, a);
  }
}

// ---- the same backward, plus the bias gradient db = sum over rows of the fp32 gate
// gradients, in the same launch (the cell step's separate column sum cost a launch and
// ~8-10 us of host work per step).
//
// Geometry: a block owns a strip of kDbHidden hidden units (4 * kDbHidden gate columns)
// and a chunk of rows; within it, TX threads span the strip (V units each: 64 or 128 B of
// a row per gate, whole sectors) and TY row lanes walk the chunk, so a B=256 / 1024,
// H=1024 launch has as many threads, one row each, as the plain kernel. Each block sums
// its rows in a fixed tree (lanes in registers, then warp shuffles, then the warps in
// order through shared memory) and, with one row chunk, writes db itself. With several,
// it writes an fp32 partial row; the last block of the strip to finish (an atomic ticket)
// adds the partials in chunk order. Every sum has a fixed order whichever block comes
// last: db is deterministic, no float atomics. At most kDbMaxChunks chunks (rows per
// lane grow beyond that), so the last block's tail is a few loads per thread.
//
// Tickets: one unsigned per strip, zero before the launch; atomicInc(ticket, chunks - 1)
// wraps to zero on the last arrival, so every launch leaves them zero. See db_tickets()
// for why no two launches that can run at the same time share them.
constexpr int kDbThreads = 256;
constexpr int kDbHidden = 32;
constexpr int kDbMaxChunks = 16;

template <typename T, int V>
__global__ void __launch_bounds__(kDbThreads)
    lstm_bwd_db_kernel(const T* __restrict__ dh, const T* __restrict__ dh2, const T* dc,
                       const T* __restrict__ c_prev, const T* __restrict__ c_new, const T* __restrict__ ws,
                       T* __restrict__ dgates, T* dc_prev, T* __restrict__ db, float* __restrict__ partial,
                       unsigned* __restrict__ tickets, int64_t B, int64_t H, int64_t rows_per_block) {
  constexpr int TX = kDbHidden / V;      // threads across the strip (divides 32)
  constexpr int TY = kDbThreads / TX;    // row lanes
  constexpr int W = 4 * kDbHidden;       // gate columns of the strip
  constexpr int NW = kDbThreads / 32;    // warps
  static_assert(kDbHidden % V == 0 && 32 % TX == 0 && 2 * W == kDbThreads, "db kernel geometry");
  __shared__ float red[NW][W];
  __shared__ float half_sum[2][W];
  __shared__ bool last;
  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  const int64_t j0 = int64_t(blockIdx.x) * kDbHidden;
  const int64_t j = j0 + tx * V;
  float s[4][V];
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int k = 0; k < V; ++k) s[q][k] = 0.f;
  if (j < H) {  // V divides H when V > 1: a thread's units are all in or all out
    const int64_t r0 = int64_t(blockIdx.y) * rows_per_block;
    const int64_t r1 = min(B, r0 + rows_per_block);
    for (int64_t b = r0 + ty; b < r1; b += TY) {
      float a[4][V];
      bwd_row<T, V>(dh, dh2, dc, c_prev, c_new, ws, dgates, dc_prev, b, j, H, a);
#pragma unroll
      for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int k = 0; k < V; ++k) s[q][k] += a[q][k];
    }
  }
  // Lanes lane, lane + TX, ... of a warp share tx: fold them onto lanes < TX.
#pragma unroll
  for (int off = 16; off >= TX; off >>= 1)
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int k = 0; k < V; ++k) s[q][k] += __shfl_down_sync(0xffffffffu, s[q][k], off);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane < TX)
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int k = 0; k < V; ++k) red[warp][q * kDbHidden + tx * V + k] = s[q][k];
  __syncthreads();
  // Column c of the strip: gate c / kDbHidden, hidden unit j0 + c % kDbHidden.
  const int c = threadIdx.x % W, half = threadIdx.x / W;
  const int64_t col = (c / kDbHidden) * H + j0 + c % kDbHidden;
  const bool valid = threadIdx.x < W && j0 + c % kDbHidden < H;
  float v = 0.f;
  if (threadIdx.x < W)
#pragma unroll
    for (int w = 0; w < NW; ++w) v += red[w][c];
  const unsigned chunks = gridDim.y;
  if (chunks == 1) {
    if (valid) db[col] = static_cast<T>(v);
    return;
  }
  if (valid) partial[int64_t(blockIdx.y) * 4 * H + col] = v;
  __threadfence();  // the partial is visible device-wide before this block's ticket
  __syncthreads();
  if (threadIdx.x == 0) last = atomicInc(&tickets[blockIdx.x], chunks - 1) == chunks - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // (acquire) every other block's partial, read below from L2
  // Chunks [0, split) on the first W threads, [split, chunks) on the next W, then added.
  const unsigned split = (chunks + 1) / 2;
  const unsigned lo = half == 0 ? 0u : split, hi = half == 0 ? split : chunks;
  const int64_t pcol = j0 + c % kDbHidden < H ? col : 0;  // any in-bounds address for padding columns
  float acc = 0.f;
#pragma unroll 8
  for (unsigned y = lo; y < hi; ++y) acc += __ldcg(partial + int64_t(y) * 4 * H + pcol);
  half_sum[half][c] = acc;
  __syncthreads();
  if (valid) db[col] = static_cast<T>(half_sum[0][c] + half_sum[1][c]);
}

// ---------------------------------------------------------------- launch helpers

// Raw pointers so the time loop does not build a Tensor per slice.
struct FwdPtrs {
  const void *ig, *hg, *b_ih, *b_hh, *c;
  int64_t ig_ld, hg_ld;
  void *h_out, *c_out, *ws;
};
struct BwdPtrs {
  const void *dh, *dh2, *dc, *c_prev, *c_new, *ws;
  void *dgates, *dc_prev;
};

inline bool aligned_to(const void* p, int64_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline dim3 grid_for(int64_t B, int64_t H, int V, int threads) {
  const int64_t groups = H / V;
  return dim3(static_cast<unsigned>((groups + threads - 1) / threads),
              static_cast<unsigned>(std::min<int64_t>(B, 65535)));
}

inline int threads_for(int64_t H, int V) {
  const int64_t groups = H / V;
  return static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (groups + 31) / 32 * 32)));
}

// Widest vector (16 bytes) when every pointer, leading dimension and H allow it.
template <typename T>
int vec_width(std::initializer_list<const void*> ptrs, std::initializer_list<int64_t> lds, int64_t H) {
  constexpr int VMAX = 16 / sizeof(T);
  if (H % VMAX != 0) return 1;
  for (auto ld : lds)
    if (ld % VMAX != 0) return 1;
  for (auto p : ptrs)
    if (!aligned_to(p, 16)) return 1;
  return VMAX;
}

template <typename T>
void launch_fwd(const FwdPtrs& p, int64_t B, int64_t H, cudaStream_t stream) {
  constexpr int VMAX = 16 / sizeof(T);
  const int V = vec_width<T>({p.ig, p.hg, p.b_ih, p.b_hh, p.c, p.h_out, p.c_out, p.ws},
                             {p.ig_ld, p.hg ? p.hg_ld : 0}, H);
  const int threads = threads_for(H, V);
  const dim3 grid = grid_for(B, H, V, threads);
  auto args = [&](auto kernel) {
    kernel<<<grid, threads, 0, stream>>>(
        static_cast<const T*>(p.ig), p.ig_ld, static_cast<const T*>(p.hg), p.hg_ld,
        static_cast<const T*>(p.b_ih), static_cast<const T*>(p.b_hh), static_cast<const T*>(p.c),
        static_cast<T*>(p.h_out), static_cast<T*>(p.c_out), static_cast<T*>(p.ws), B, H);
  };
  if (V == VMAX)
    args(lstm_fwd_kernel<T, VMAX>);
  else
    args(lstm_fwd_kernel<T, 1>);
  MPT_CHECK_LAUNCH("lstm_cell forward");
}

template <typename T>
void launch_bwd(const BwdPtrs& p, int64_t B, int64_t H, cudaStream_t stream) {
  constexpr int VMAX = 16 / sizeof(T);
  const int V =
      vec_width<T>({p.dh, p.dh2, p.dc, p.c_prev, p.c_new, p.ws, p.dgates, p.dc_prev}, {}, H);
  const int threads = threads_for(H, V);
  const dim3 grid = grid_for(B, H, V, threads);
  auto args = [&](auto kernel) {
    kernel<<<grid, threads, 0, stream>>>(
        static_cast<const T*>(p.dh), static_cast<const T*>(p.dh2), static_cast<const T*>(p.dc),
        static_cast<const T*>(p.c_prev), static_cast<const T*>(p.c_new), static_cast<const T*>(p.ws),
        static_cast<T*>(p.dgates), static_cast<T*>(p.dc_prev), B, H);
  };
  if (V == VMAX)
    args(lstm_bwd_kernel<T, VMAX>);
  else
    args(lstm_bwd_kernel<T, 1>);
  MPT_CHECK_LAUNCH("lstm_cell backward");
}

// Tickets for the db kernel (one per column strip), zero at the launch.
//
// Why not per launch: the workspace comes from the caching allocator uninitialised, and a
// memset would be the extra launch the fused db exists to avoid. Two launches can share
// tickets only if they can run at the same time; kernels of one stream never overlap, so
// eagerly each (device, stream) owns one persistent buffer (zeroed once, when created, on
// that stream, and left zero by every launch; shared by host threads, whose launches on
// one stream are serialised all the same). Under CUDA-graph capture the kernel node would
// keep the capture stream's buffer and a replay may run beside other work using it
// (torch captures every graph on one side stream), so a captured launch gets its own
// tickets in the per-launch workspace (the graph's pool) plus a memset node in the graph.
// Process-lifetime buffers: never freed (a few KB per stream ever used).
unsigned* stream_tickets(cudaStream_t stream, int64_t n) {
  struct Entry {
    c10::DeviceIndex device;
    cudaStream_t stream;
    unsigned* ptr;
    int64_t n;
  };
  static std::mutex mu;
  static auto* cache = new std::vector<Entry>();  // never destroyed: no teardown-order issue
  const c10::DeviceIndex device = c10::cuda::current_device();
  const std::lock_guard<std::mutex> lock(mu);
  Entry* e = nullptr;
  for (auto& x : *cache)
    if (x.device == device && x.stream == stream) e = &x;
  if (e && e->n >= n) return e->ptr;
  // New, or too small (a wider hidden size): a fresh zeroed buffer on this stream; the old
  // one is left allocated (a launch still queued on the stream may use it).
  const int64_t size = std::max<int64_t>({n, 1024, e ? 2 * e->n : 0});
  auto* p = static_cast<unsigned*>(c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(size * sizeof(unsigned), stream));
  C10_CUDA_CHECK(cudaMemsetAsync(p, 0, size * sizeof(unsigned), stream));
  if (e)
    *e = Entry{device, stream, p, size};
  else
    cache->push_back(Entry{device, stream, p, size});
  return p;
}

template <typename T>
void launch_bwd_db(const BwdPtrs& p, void* db, int64_t B, int64_t H, cudaStream_t stream) {
  constexpr int VMAX = 16 / sizeof(T);
  const int V = vec_width<T>({p.dh, p.dh2, p.dc, p.c_prev, p.c_new, p.ws, p.dgates, p.dc_prev}, {}, H);
  const int64_t TY = kDbThreads / (kDbHidden / V);
  const int64_t strips = (H + kDbHidden - 1) / kDbHidden;
  MPT_CHECK(strips <= INT_MAX, "lstm_cell backward: hidden size ", H, " is too large for the bias-gradient kernel");
  const int64_t lanes_rows = (B + TY * kDbMaxChunks - 1) / (TY * kDbMaxChunks);  // rows per lane
  const int64_t rows_per_block = TY * lanes_rows;
  const int64_t chunks = (B + rows_per_block - 1) / rows_per_block;  // <= kDbMaxChunks
  // Per-launch workspace: fp32 partial rows (chunks x 4H) and, under capture, the tickets.
  at::DataPtr work;
  float* partial = nullptr;
  unsigned* tickets = nullptr;
  if (chunks > 1) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const bool captured = capture != cudaStreamCaptureStatusNone;
    const size_t partial_bytes = size_t(chunks) * 4 * H * sizeof(float);
    work = c10::cuda::CUDACachingAllocator::get()->allocate(partial_bytes + (captured ? strips * sizeof(unsigned) : 0));
    partial = static_cast<float*>(work.get());
    if (captured) {
      tickets = reinterpret_cast<unsigned*>(static_cast<char*>(work.get()) + partial_bytes);
      C10_CUDA_CHECK(cudaMemsetAsync(tickets, 0, strips * sizeof(unsigned), stream));
    } else {
      tickets = stream_tickets(stream, strips);
    }
  }
  const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(chunks));
  auto args = [&](auto kernel) {
    kernel<<<grid, kDbThreads, 0, stream>>>(
        static_cast<const T*>(p.dh), static_cast<const T*>(p.dh2), static_cast<const T*>(p.dc),
        static_cast<const T*>(p.c_prev), static_cast<const T*>(p.c_new), static_cast<const T*>(p.ws),
        static_cast<T*>(p.dgates), static_cast<T*>(p.dc_prev), static_cast<T*>(db), partial, tickets, B, H,
        rows_per_block);
  };
  if (V == VMAX)
    args(lstm_bwd_db_kernel<T, VMAX>);
  else
    args(lstm_bwd_db_kernel<T, 1>);
  MPT_CHECK_LAUNCH("lstm_cell backward (with bias gradient)");
}

// ---------------------------------------------------------------- argument checks

const void* opt_ptr(const std::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? t->data_ptr() : nullptr;
}

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// Address of slice t of a (T, ...) tensor without building a Tensor for it.
inline void* step_ptr(const at::Tensor& t, int64_t i) {
  return static_cast<char*>(t.data_ptr()) + i * t.stride(0) * t.element_size();
}

// Same device and dtype as `ref`, the given shape, unit stride on the last dim.
void check_like(const at::Tensor& t, const char* name, const at::Tensor& ref, at::IntArrayRef shape,
                const char* op) {
  MPT_CHECK(t.is_cuda(), op, ": '", name, "' must be a CUDA tensor, got ", t.device());
  MPT_CHECK(t.device() == ref.device(), op, ": '", name, "' is on ", t.device(), " but the input is on ",
              ref.device(), "; move it to the same GPU");
  MPT_CHECK(t.scalar_type() == ref.scalar_type(), op, ": '", name, "' has dtype ", t.scalar_type(),
              " but the input has ", ref.scalar_type(), "; cast all LSTM tensors to one dtype");
  MPT_CHECK(t.sizes() == shape, op, ": '", name, "' has shape ", t.sizes(), ", expected ", shape);
}

void check_rows(const at::Tensor& t, const char* name, const char* op) {
  MPT_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.stride(0) >= t.size(1), op, ": '", name,
              "' must be 2-D with unit stride on the last dim (got strides ", t.strides(),
              "); call .contiguous()");
}

}  // namespace

// ---------------------------------------------------------------- pointwise ops

// igates (B, 4H) [+ hgates (B, 4H)] [+ b_ih (4H)] [+ b_hh (4H)], c (B, H)
// -> h' (B, H), c' (B, H), workspace (B, 4H) = activated (i, f, g, o).
namespace {
// ws_in_place: the activated gates overwrite igates (an internal, contiguous buffer: the
// cell step's GEMM output), one (B, 4H) allocation less per step.
std::vector<at::Tensor> pointwise_forward(const at::Tensor& igates, const std::optional<at::Tensor>& hgates,
                                          const at::Tensor& c, const std::optional<at::Tensor>& b_ih,
                                          const std::optional<at::Tensor>& b_hh, bool ws_in_place,
                                          const char* op) {
  MPT_CHECK_CUDA(igates, op);
  MPT_CHECK(igates.dim() == 2 && igates.size(1) % 4 == 0, op, ": 'igates' must be (batch, 4*hidden), got ",
              igates.sizes());
  check_rows(igates, "igates", op);
  const int64_t B = igates.size(0), H = igates.size(1) / 4;
  check_like(c, "c", igates, {B, H}, op);
  MPT_CHECK_CONTIGUOUS(c, op);
  if (has(hgates)) {
    check_like(*hgates, "hgates", igates, {B, 4 * H}, op);
    check_rows(*hgates, "hgates", op);
  }
  for (auto* bp : {&b_ih, &b_hh}) {
    if (!has(*bp)) continue;
    check_like(**bp, bp == &b_ih ? "b_ih" : "b_hh", igates, {4 * H}, op);
    MPT_CHECK_CONTIGUOUS(**bp, op);
  }
  const c10::cuda::CUDAGuard guard(igates.device());
  auto h_out = new_cuda({B, H}, igates);
  auto c_out = new_cuda({B, H}, igates);
  MPT_CHECK(!ws_in_place || (!has(hgates) && igates.is_contiguous()), op,
              ": internal error: in-place workspace needs one contiguous gate buffer");
  auto ws = ws_in_place ? igates : at::empty({B, 4 * H}, igates.options());
  if (B * H == 0) return {h_out, c_out, ws};
  FwdPtrs p{igates.data_ptr(), opt_ptr(hgates), opt_ptr(b_ih), opt_ptr(b_hh), c.data_ptr(),
            igates.stride(0), has(hgates) ? hgates->stride(0) : 0,
            h_out.data_ptr(), c_out.data_ptr(), ws.data_ptr()};
  auto stream = at::cuda::getCurrentCUDAStream();
  MPT_DISPATCH_FLOAT_HALF_BF16(igates.scalar_type(), op, scalar_t, launch_fwd<scalar_t>(p, B, H, stream));
  return {h_out, c_out, ws};
}
}  // namespace

std::vector<at::Tensor> lstm_cell_pointwise_forward(const at::Tensor& igates,
                                                    const std::optional<at::Tensor>& hgates,
                                                    const at::Tensor& c,
                                                    const std::optional<at::Tensor>& b_ih,
                                                    const std::optional<at::Tensor>& b_hh) {
  return pointwise_forward(igates, hgates, c, b_ih, b_hh, false, "lstm_cell_pointwise_forward");
}

// dh', dh2 (added to dh'), dc' (each optional = zero), c, c', workspace
// -> dgates (B, 4H) w.r.t. the pre-activation gates (= d bias), dc (B, H).
namespace {
// need_dc = false: dc is not computed (undefined in the result). db: when not null, it
// receives the bias gradient (4H), the row sum of the fp32 gate gradients, same launch.
std::vector<at::Tensor> pointwise_backward(const std::optional<at::Tensor>& dh,
                                           const std::optional<at::Tensor>& dh2,
                                           const std::optional<at::Tensor>& dc, const at::Tensor& c_prev,
                                           const at::Tensor& c_new, const at::Tensor& ws, bool need_dc,
                                           at::Tensor* db, const char* op) {
  MPT_CHECK_CUDA(ws, op);
  MPT_CHECK(ws.dim() == 2 && ws.size(1) % 4 == 0, op, ": 'ws' must be (batch, 4*hidden), got ", ws.sizes());
  MPT_CHECK_CONTIGUOUS(ws, op);
  const int64_t B = ws.size(0), H = ws.size(1) / 4;
  check_like(c_prev, "c_prev", ws, {B, H}, op);
  check_like(c_new, "c_new", ws, {B, H}, op);
  MPT_CHECK_CONTIGUOUS(c_prev, op);
  MPT_CHECK_CONTIGUOUS(c_new, op);
  for (auto* gp : {&dh, &dh2, &dc}) {
    if (!has(*gp)) continue;
    check_like(**gp, gp == &dh ? "dh" : gp == &dh2 ? "dh2" : "dc", ws, {B, H}, op);
    MPT_CHECK_CONTIGUOUS(**gp, op);
  }
  const c10::cuda::CUDAGuard guard(ws.device());
  auto dgates = new_cuda({B, 4 * H}, ws);
  auto dc_prev = need_dc ? new_cuda({B, H}, ws) : at::Tensor();
  if (B * H == 0) {
    if (db) *db = at::zeros({4 * H}, ws.options());  // the sum over no rows
    return {dgates, dc_prev};
  }
  BwdPtrs p{opt_ptr(dh), opt_ptr(dh2), opt_ptr(dc), c_prev.data_ptr(), c_new.data_ptr(), ws.data_ptr(),
            dgates.data_ptr(), need_dc ? dc_prev.data_ptr() : nullptr};
  auto stream = at::cuda::getCurrentCUDAStream();
  if (db) {
    *db = new_cuda({4 * H}, ws);
    void* db_ptr = db->data_ptr();
    MPT_DISPATCH_FLOAT_HALF_BF16(ws.scalar_type(), op, scalar_t, launch_bwd_db<scalar_t>(p, db_ptr, B, H, stream));
  } else {
    MPT_DISPATCH_FLOAT_HALF_BF16(ws.scalar_type(), op, scalar_t, launch_bwd<scalar_t>(p, B, H, stream));
  }
  return {dgates, dc_prev};
}
}  // namespace

std::vector<at::Tensor> lstm_cell_pointwise_backward(const std::optional<at::Tensor>& dh,
                                                     const std::optional<at::Tensor>& dh2,
                                                     const std::optional<at::Tensor>& dc,
                                                     const at::Tensor& c_prev, const at::Tensor& c_new,
                                                     const at::Tensor& ws) {
  return pointwise_backward(dh, dh2, dc, c_prev, c_new, ws, true, nullptr, "lstm_cell_pointwise_backward");
}

// ---------------------------------------------------------------- one cell step

namespace {
void check_weights(const at::Tensor& x, const at::Tensor& w_ih, const at::Tensor& w_hh, int64_t H,
                   const char* op) {
  MPT_CHECK(x.dim() == 2, op, ": input must be 2-D (batch, input_size), got ", x.sizes());
  check_like(w_ih, "weight_ih", x, {4 * H, x.size(1)}, op);
  check_like(w_hh, "weight_hh", x, {4 * H, H}, op);
}
}  // namespace

// Two GEMMs into one gates buffer (the second accumulates in place), then the kernel.
std::vector<at::Tensor> lstm_cell_forward(const at::Tensor& x, const at::Tensor& h, const at::Tensor& c,
                                          const at::Tensor& w_ih, const at::Tensor& w_hh,
                                          const std::optional<at::Tensor>& b_ih,
                                          const std::optional<at::Tensor>& b_hh) {
  const char* op = "lstm_cell_forward";
  const at::AutoDispatchBelowADInplaceOrView no_autograd;  // internal tensors: skip autograd dispatch
  MPT_CHECK_CUDA(x, op);
  const int64_t H = w_hh.size(-1);
  check_weights(x, w_ih, w_hh, H, op);
  check_like(h, "h", x, {x.size(0), H}, op);
  const c10::cuda::CUDAGuard guard(x.device());
  // Profiler scopes (a thread-local flag check when no profiler runs): the cell step is
  // host-bound, and torch.profiler shows these parts only through them.
  at::Tensor gates;
  {
    RECORD_FUNCTION("mpt::lstm_cell_forward::gemms", std::vector<c10::IValue>());
    mpt::blas::Session blas(x.scalar_type(), op);  // one handle fetch for both GEMMs
    gates = blas.mm_new(x, false, w_ih, true);  // x W_ih^T
    blas.mm(gates, h, false, w_hh, true, 1.f);  // += h W_hh^T (beta = 1)
  }
  {  // (RECORD_FUNCTION declares a variable named `guard`: each scope in its own block)
    RECORD_FUNCTION("mpt::lstm_cell_forward::pointwise", std::vector<c10::IValue>());
    return pointwise_forward(gates, std::nullopt, c, b_ih, b_hh, /*ws_in_place=*/true, op);
  }
}

// need = which of (x, h, c, w_ih, w_hh, bias) want a gradient; the rest come back undefined.
std::vector<at::Tensor> lstm_cell_backward(const std::optional<at::Tensor>& dh,
                                           const std::optional<at::Tensor>& dc, const at::Tensor& x,
                                           const at::Tensor& h, const at::Tensor& c, const at::Tensor& w_ih,
                                           const at::Tensor& w_hh, const at::Tensor& ws,
                                           const at::Tensor& c_new, const std::vector<bool>& need) {
  const char* op = "lstm_cell_backward";
  MPT_CHECK(need.size() == 6, op, ": 'need' must have 6 flags (x, h, c, w_ih, w_hh, bias)");
  const at::AutoDispatchBelowADInplaceOrView no_autograd;  // internal tensors: skip autograd dispatch
  const c10::cuda::CUDAGuard guard(ws.device());
  std::vector<at::Tensor> r;
  at::Tensor dx, dh_prev, dw_ih, dw_hh, db;
  {  // the kernel also sums the bias gradient when it is needed (no separate column sum)
    RECORD_FUNCTION("mpt::lstm_cell_backward::pointwise", std::vector<c10::IValue>());
    r = pointwise_backward(dh, std::nullopt, dc, c, c_new, ws, need[2], need[5] ? &db : nullptr, op);
  }
  const at::Tensor& dg = r[0];
  {
    RECORD_FUNCTION("mpt::lstm_cell_backward::gemms", std::vector<c10::IValue>());
    mpt::blas::Session blas(ws.scalar_type(), op);  // one handle fetch for up to 4 GEMMs
    if (need[0]) dx = blas.mm_new(dg, false, w_ih, false);       // dg W_ih
    if (need[1]) dh_prev = blas.mm_new(dg, false, w_hh, false);  // dg W_hh
    if (need[3]) dw_ih = blas.mm_new(dg, true, x, false);        // dg^T x
    if (need[4]) dw_hh = blas.mm_new(dg, true, h, false);        // dg^T h
  }
  return {dx, dh_prev, r[1], dw_ih, dw_hh, db};
}

// Test hook: out (M, N) = op(a) op(b) + beta * out with the helper the LSTM GEMMs use
// (direct cuBLAS for fp16/bf16 when torch's settings allow, else ATen), on any 2-D
// tensors with unit stride on the last dim (strided views included). Returns whether
// cuBLAS was called directly, so a test can check which path ran.
bool lstm_gemm_rm(at::Tensor out, const at::Tensor& a, bool trans_a, const at::Tensor& b, bool trans_b,
                  double beta) {
  const char* op = "lstm_gemm_rm";
  const at::AutoDispatchBelowADInplaceOrView no_autograd;
  MPT_CHECK_CUDA(out, op);
  MPT_CHECK(out.dim() == 2 && a.dim() == 2 && b.dim() == 2, op, ": out, a and b must be 2-D");
  check_like(a, "a", out, a.sizes(), op);
  check_like(b, "b", out, b.sizes(), op);
  const c10::cuda::CUDAGuard guard(out.device());
  mpt::blas::Session blas(out.scalar_type(), op);
  return blas.mm(out, a, trans_a, b, trans_b, static_cast<float>(beta));
}

// ---------------------------------------------------------------- a whole layer

// x (T, B, I), h0/c0 (B, H) -> out (T, B, H), c_all (T, B, H), ws (T, B, 4H).
// All input projections are one GEMM; each step adds h_{t-1} W_hh^T in place into its
// slice of that buffer (cuBLAS beta = 1) and runs the pointwise kernel on it.
std::vector<at::Tensor> lstm_layer_forward(const at::Tensor& x, const at::Tensor& h0, const at::Tensor& c0,
                                           const at::Tensor& w_ih, const at::Tensor& w_hh,
                                           const std::optional<at::Tensor>& b_ih,
                                           const std::optional<at::Tensor>& b_hh) {
  const char* op = "lstm_layer_forward";
  const at::AutoDispatchBelowADInplaceOrView no_autograd;  // internal tensors: skip autograd dispatch
  MPT_CHECK_CUDA(x, op);
  MPT_CHECK(x.dim() == 3, op, ": input must be (T, batch, input_size), got ", x.sizes());
  const int64_t T = x.size(0), B = x.size(1), I = x.size(2), H = w_hh.size(-1);
  check_like(w_ih, "weight_ih", x, {4 * H, I}, op);
  check_like(w_hh, "weight_hh", x, {4 * H, H}, op);
  check_like(h0, "h0", x, {B, H}, op);
  check_like(c0, "c0", x, {B, H}, op);
  MPT_CHECK_CONTIGUOUS(c0, op);
  for (auto* bp : {&b_ih, &b_hh}) {
    if (!has(*bp)) continue;
    check_like(**bp, bp == &b_ih ? "b_ih" : "b_hh", x, {4 * H}, op);
    MPT_CHECK_CONTIGUOUS(**bp, op);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto opts = x.options();
  auto out = at::empty({T, B, H}, opts);
  auto c_all = at::empty({T, B, H}, opts);
  MPT_CHECK(T > 0, op, ": the sequence is empty (T = 0)");
  if (B * H == 0) return {out, c_all, at::empty({T, B, 4 * H}, opts)};
  // The input projections of all steps; step t's kernel overwrites its slice with the
  // activated gates, so this buffer is also the workspace (no second (T, B, 4H) buffer).
  mpt::blas::Session blas(x.scalar_type(), op);  // one handle fetch for the whole loop
  auto xg = blas.mm_new(x.reshape({T * B, I}), false, w_ih, true).view({T, B, 4 * H});
  const auto& ws = xg;
  // Per step xg[t] += h_{t-1} W_hh^T: straight cuBLAS on raw pointers (no Tensor per step)
  // when it may, else ATen's addmm_ on slices.
  const int64_t ld_h0 = mpt::blas::row_ld(h0), ld_whh = mpt::blas::row_ld(w_hh);
  const bool direct_step =
      blas.direct() && ld_h0 > 0 && ld_whh > 0 && std::max({B, 4 * H, ld_h0, ld_whh}) <= INT_MAX;
  auto stream = at::cuda::getCurrentCUDAStream();
  for (int64_t t = 0; t < T; ++t) {
    void* gates = step_ptr(xg, t);
    if (direct_step) {
      blas.gemm(false, true, B, 4 * H, H, t == 0 ? h0.data_ptr() : step_ptr(out, t - 1), t == 0 ? ld_h0 : H,
                w_hh.data_ptr(), ld_whh, 1.f, gates, 4 * H);
    } else {
      at::Tensor g = xg[t];  // ATen path (through the session, which then re-sets its math mode)
      blas.mm(g, t == 0 ? h0 : out[t - 1], false, w_hh, true, 1.f);
    }
    FwdPtrs p{gates, nullptr, opt_ptr(b_ih), opt_ptr(b_hh),
              t == 0 ? c0.data_ptr() : step_ptr(c_all, t - 1), 4 * H, 0,
              step_ptr(out, t), step_ptr(c_all, t), step_ptr(ws, t)};
    MPT_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), op, scalar_t, launch_fwd<scalar_t>(p, B, H, stream));
  }
  return {out, c_all, ws};
}

// d_out (T, B, H) (the gradient of every h_t, h_n's included), dc_n (B, H): either may
// be undefined (= zero). need = (x, h0, c0, w_ih, w_hh, bias).
// The loop runs one pointwise kernel (which also adds the recurrent dh) and one GEMM
// per step; the weight, input and bias gradients are then a few large GEMMs over
// all steps at once.
std::vector<at::Tensor> lstm_layer_backward(const std::optional<at::Tensor>& d_out,
                                            const std::optional<at::Tensor>& dc_n, const at::Tensor& x,
                                            const at::Tensor& h0, const at::Tensor& c0, const at::Tensor& out,
                                            const at::Tensor& c_all, const at::Tensor& ws,
                                            const at::Tensor& w_ih, const at::Tensor& w_hh,
                                            const std::vector<bool>& need) {
  const char* op = "lstm_layer_backward";
  const at::AutoDispatchBelowADInplaceOrView no_autograd;  // internal tensors: skip autograd dispatch
  MPT_CHECK(need.size() == 6, op, ": 'need' must have 6 flags (x, h0, c0, w_ih, w_hh, bias)");
  MPT_CHECK(x.dim() == 3, op, ": input must be (T, batch, input_size), got ", x.sizes());
  const int64_t T = x.size(0), B = x.size(1), I = x.size(2), H = w_hh.size(-1);
  MPT_CHECK(T > 0, op, ": the sequence is empty (T = 0)");
  MPT_CHECK_CONTIGUOUS(ws, op);
  MPT_CHECK_CONTIGUOUS(c_all, op);
  MPT_CHECK_CONTIGUOUS(out, op);
  if (has(d_out)) {
    check_like(*d_out, "d_out", x, {T, B, H}, op);
    MPT_CHECK_CONTIGUOUS(*d_out, op);
  }
  if (has(dc_n)) {
    check_like(*dc_n, "dc_n", x, {B, H}, op);
    MPT_CHECK_CONTIGUOUS(*dc_n, op);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto opts = x.options();
  auto dg = at::empty({T, B, 4 * H}, opts);
  auto dh_rec = at::empty({B, H}, opts);
  // dc is updated in place step by step; start from dc_n (copied: it is the caller's).
  at::Tensor dc_rec = has(dc_n) ? dc_n->clone() : at::empty({B, H}, opts);
  bool dc_live = has(dc_n), dh_live = false;
  mpt::blas::Session blas(x.scalar_type(), op);  // one handle fetch for the whole loop
  // Per step dh_{t-1} = dg_t W_hh: straight cuBLAS on raw pointers when it may.
  const int64_t ld_whh = mpt::blas::row_ld(w_hh);
  const bool direct_step = blas.direct() && ld_whh > 0 && std::max({B, 4 * H, ld_whh}) <= INT_MAX;
  auto stream = at::cuda::getCurrentCUDAStream();
  for (int64_t t = T - 1; t >= 0; --t) {
    BwdPtrs p{has(d_out) ? step_ptr(*d_out, t) : nullptr,
              dh_live ? dh_rec.data_ptr() : nullptr,
              dc_live ? dc_rec.data_ptr() : nullptr,
              t == 0 ? c0.data_ptr() : step_ptr(c_all, t - 1),
              step_ptr(c_all, t), step_ptr(ws, t), step_ptr(dg, t), dc_rec.data_ptr()};
    if (B * H > 0)
      MPT_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), op, scalar_t, launch_bwd<scalar_t>(p, B, H, stream));
    dc_live = true;
    if ((t > 0 || need[1]) && B * H > 0) {
      if (direct_step)
        blas.gemm(false, false, B, H, 4 * H, step_ptr(dg, t), 4 * H, w_hh.data_ptr(), ld_whh, 0.f,
                  dh_rec.data_ptr(), H);
      else
        blas.mm(dh_rec, dg[t], false, w_hh, false, 0.f);  // ATen path (the session knows)
    }
    if (t > 0 || need[1]) dh_live = true;
  }
  const auto dg2 = dg.view({T * B, 4 * H});
  at::Tensor dx, dw_ih, dw_hh, db;
  if (need[0]) dx = blas.mm_new(dg2, false, w_ih, false).view({T, B, I});
  if (need[3]) dw_ih = blas.mm_new(dg2, true, x.reshape({T * B, I}), false);
  if (need[4]) {
    dw_hh = blas.mm_new(dg[0], true, h0, false);  // the h0 term
    if (T > 1)
      blas.mm(dw_hh, dg.narrow(0, 1, T - 1).reshape({(T - 1) * B, 4 * H}), true,
              out.narrow(0, 0, T - 1).reshape({(T - 1) * B, H}), false, 1.f);
  }
  if (need[5]) db = dg2.sum(0);
  return {dx, need[1] ? dh_rec : at::Tensor(), need[2] ? dc_rec : at::Tensor(), dw_ih, dw_hh, db};
}
