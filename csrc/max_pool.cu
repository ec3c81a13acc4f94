// 2-D max pooling of channels_last tensors, forward and backward (torch.ops.mptrain.max_pool2d).
//
// Why not ATen's kernels or inductor's lowering: at ResNet-50's stem pool (3x3/2 over
// 256x64x112x112 fp16) ATen's channels_last forward / backward run at 26% / 11% of the
// bandwidth floor, and inductor's backward, which recomputes the window offsets it gathers
// from, took 1.45 ms of a 34.9 ms training step (docs/kernels/pool.md).
//
// Layout: x is [N, H, W, C] in memory (channels_last).  Each thread owns one pixel and one
// vector of V channels (16 bytes when C and the pointers allow, else one element):
// * forward: one thread per output pixel; it reads its window, keeps per channel the maximum
//   and the window offset (int8, kh * KW + kw) of the element it came from;
// * backward: one thread per input pixel; it gathers dy from the windows that cover the pixel
//   and whose saved offset points at it, sums in fp32 and writes dx once (no atomics, no zero
//   fill, deterministic).  The (3x3, stride 2) and (2x2, stride 2) windows are compile-time
//   shapes, so every load of a thread is issued before the first compare; others run a loop.
// Tie and NaN rules are ATen's CPU kernels': the first maximum in (kh, kw) order wins, a NaN
// wins over any number and a later NaN over an earlier one, and a window of -inf only points
// at its first in-bounds element.
#include "entry_points.h"
#include "type_shim.h"

#include <cmath>

namespace {

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <int V>
struct alignas(V) Offsets {
  int8_t v[V];
};

struct PoolShape {
  int N, H, W, C, Ho, Wo;
  int kh, kw, sh, sw, ph, pw;
};

// The thread's (n, row, col, first channel) in an [N, rows, cols, C] tensor of C / V vectors.
struct Pixel {
  int n, r, c, c0;
};

template <int V>
__device__ __forceinline__ Pixel pixel_of(int64_t t, int rows, int cols, int C) {
  const int cv = C / V;
  Pixel p;
  p.c0 = int(t % cv) * V;
  int64_t q = t / cv;
  p.c = int(q % cols);
  q /= cols;
  p.r = int(q % rows);
  p.n = int(q / rows);
  return p;
}

// KH, KW, SH, SW > 0: that window shape at compile time; 0: the runtime shape in `s`.
template <typename T, int V, int KH, int KW, int SH, int SW>
__global__ void max_pool_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, int8_t* __restrict__ offsets,
                                    PoolShape s) {
  const int kh = KH ? KH : s.kh, kw = KW ? KW : s.kw, sh = SH ? SH : s.sh, sw = SW ? SW : s.sw;
  const int64_t total = int64_t(s.N) * s.Ho * s.Wo * (s.C / V);
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const Pixel o = pixel_of<V>(t, s.Ho, s.Wo, s.C);
    const int h0 = o.r * sh - s.ph, w0 = o.c * sw - s.pw;
    const int i0 = h0 < 0 ? -h0 : 0, j0 = w0 < 0 ? -w0 : 0;  // first in-bounds tap
    float m[V];
    int8_t a[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      m[v] = -INFINITY;
      a[v] = int8_t(i0 * kw + j0);
    }
    const T* base = x + int64_t(o.n) * s.H * s.W * s.C + o.c0;
#pragma unroll
    for (int i = 0; i < kh; ++i) {  // a compile-time trip count when KH is: fully unrolled
      const int h = h0 + i;
      if (h < 0 || h >= s.H) continue;
#pragma unroll
      for (int j = 0; j < kw; ++j) {
        const int w = w0 + j;
        if (w < 0 || w >= s.W) continue;
        const Pack<T, V> xv = *reinterpret_cast<const Pack<T, V>*>(base + (int64_t(h) * s.W + w) * s.C);
        const int8_t off = int8_t(i * kw + j);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float f = static_cast<float>(xv.v[v]);
          if (f > m[v] || isnan(f)) {
            m[v] = f;
            a[v] = off;
          }
        }
      }
    }
    Pack<T, V> out;
    Offsets<V> off;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      out.v[v] = static_cast<T>(m[v]);  // one of the inputs: exact
      off.v[v] = a[v];
    }
    const int64_t at = ((int64_t(o.n) * s.Ho + o.r) * s.Wo + o.c) * s.C + o.c0;
    *reinterpret_cast<Pack<T, V>*>(y + at) = out;
    *reinterpret_cast<Offsets<V>*>(offsets + at) = off;
  }
}

// The windows along one axis that cover input index i: [lo, hi] (empty when lo > hi).
__device__ __forceinline__ void covering(int i, int k, int stride, int pad, int n_out, int& lo, int& hi) {
  const int first = i + pad - k + 1;
  lo = first <= 0 ? 0 : (first + stride - 1) / stride;
  hi = min(n_out - 1, (i + pad) / stride);
}

// MH, MW > 0: at most that many windows cover a pixel along each axis (ceil(k / stride)), so
// the loads are unrolled; 0: a loop over the runtime range.
template <typename T, int V, int MH, int MW>
__global__ void max_pool_bwd_kernel(const T* __restrict__ dy, const int8_t* __restrict__ offsets, T* __restrict__ dx,
                                    PoolShape s) {
  const int64_t total = int64_t(s.N) * s.H * s.W * (s.C / V);
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const Pixel p = pixel_of<V>(t, s.H, s.W, s.C);
    int hlo, hhi, wlo, whi;
    covering(p.r, s.kh, s.sh, s.ph, s.Ho, hlo, hhi);
    covering(p.c, s.kw, s.sw, s.pw, s.Wo, wlo, whi);
    const int64_t plane = int64_t(p.n) * s.Ho * s.Wo * s.C + p.c0;
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.f;
    auto gather = [&](int ho, int wo) {
      const int8_t want = int8_t((p.r - (ho * s.sh - s.ph)) * s.kw + (p.c - (wo * s.sw - s.pw)));
      const int64_t at = plane + (int64_t(ho) * s.Wo + wo) * s.C;
      const Offsets<V> off = *reinterpret_cast<const Offsets<V>*>(offsets + at);
      const Pack<T, V> g = *reinterpret_cast<const Pack<T, V>*>(dy + at);
#pragma unroll
      for (int v = 0; v < V; ++v)
        if (off.v[v] == want) acc[v] += static_cast<float>(g.v[v]);
    };
    if constexpr (MH > 0 && MW > 0) {
#pragma unroll
      for (int i = 0; i < MH; ++i)
#pragma unroll
        for (int j = 0; j < MW; ++j)
          if (hlo + i <= hhi && wlo + j <= whi) gather(hlo + i, wlo + j);
    } else {
      for (int ho = hlo; ho <= hhi; ++ho)
        for (int wo = wlo; wo <= whi; ++wo) gather(ho, wo);
    }
    Pack<T, V> out;
#pragma unroll
    for (int v = 0; v < V; ++v) out.v[v] = static_cast<T>(acc[v]);
    *reinterpret_cast<Pack<T, V>*>(dx + ((int64_t(p.n) * s.H + p.r) * s.W + p.c) * s.C + p.c0) = out;
  }
}

int grid_for(int64_t threads) {
  const int64_t blocks = (threads + 255) / 256;
  const int64_t cap = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return int(blocks < cap ? blocks : cap);
}

// 16-byte vectors when the channel count and every pointer allow them
template <typename T>
bool vectorizable(int C, std::initializer_list<const void*> ptrs) {
  bool ok = C % (16 / sizeof(T)) == 0;
  for (const void* q : ptrs) ok = ok && reinterpret_cast<uintptr_t>(q) % 16 == 0;
  return ok;
}

void check_pool_args(const char* op, const at::Tensor& t, const char* name, at::IntArrayRef k, at::IntArrayRef stride,
                     at::IntArrayRef pad) {
  MPT_CHECK(t.is_cuda() && t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast), op, ": ", name,
            " must be a 4-d channels_last CUDA tensor, got ", t.sizes(), " on ", t.device(),
            " (x.contiguous(memory_format=torch.channels_last))");
  MPT_CHECK(k.size() == 2 && stride.size() == 2 && pad.size() == 2, op,
            ": kernel_size, stride and padding must have 2 values each");
  MPT_CHECK(k[0] >= 1 && k[1] >= 1 && k[0] * k[1] <= 127, op, ": kernel_size=", k,
            " must be positive with at most 127 elements (offsets are int8)");
  MPT_CHECK(stride[0] >= 1 && stride[1] >= 1, op, ": stride=", stride, " must be positive");
  MPT_CHECK(pad[0] >= 0 && pad[1] >= 0 && 2 * pad[0] <= k[0] && 2 * pad[1] <= k[1], op, ": padding=", pad,
            " must be at most half of kernel_size=", k);
}

PoolShape make_shape(int64_t N, int64_t C, int64_t H, int64_t W, int64_t Ho, int64_t Wo, at::IntArrayRef k,
                     at::IntArrayRef stride, at::IntArrayRef pad) {
  return {int(N), int(H), int(W), int(C), int(Ho), int(Wo), int(k[0]), int(k[1]),
          int(stride[0]), int(stride[1]), int(pad[0]), int(pad[1])};
}

template <typename T, int V>
void launch_fwd(const T* x, T* y, int8_t* offsets, const PoolShape& s, cudaStream_t stream) {
  const int grid = grid_for(int64_t(s.N) * s.Ho * s.Wo * (s.C / V));
  if (s.kh == 3 && s.kw == 3 && s.sh == 2 && s.sw == 2)
    max_pool_fwd_kernel<T, V, 3, 3, 2, 2><<<grid, 256, 0, stream>>>(x, y, offsets, s);
  else if (s.kh == 2 && s.kw == 2 && s.sh == 2 && s.sw == 2)
    max_pool_fwd_kernel<T, V, 2, 2, 2, 2><<<grid, 256, 0, stream>>>(x, y, offsets, s);
  else
    max_pool_fwd_kernel<T, V, 0, 0, 0, 0><<<grid, 256, 0, stream>>>(x, y, offsets, s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int V>
void launch_bwd(const T* dy, const int8_t* offsets, T* dx, const PoolShape& s, cudaStream_t stream) {
  const int grid = grid_for(int64_t(s.N) * s.H * s.W * (s.C / V));
  const int mh = (s.kh + s.sh - 1) / s.sh, mw = (s.kw + s.sw - 1) / s.sw;
  if (mh == 2 && mw == 2)
    max_pool_bwd_kernel<T, V, 2, 2><<<grid, 256, 0, stream>>>(dy, offsets, dx, s);
  else if (mh == 1 && mw == 1)
    max_pool_bwd_kernel<T, V, 1, 1><<<grid, 256, 0, stream>>>(dy, offsets, dx, s);
  else
    max_pool_bwd_kernel<T, V, 0, 0><<<grid, 256, 0, stream>>>(dy, offsets, dx, s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::vector<at::Tensor> max_pool2d_forward(const at::Tensor& x, at::IntArrayRef k, at::IntArrayRef stride,
                                           at::IntArrayRef pad) {
  const char* op = "mptrain::max_pool2d";
  check_pool_args(op, x, "input", k, stride, pad);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t Ho = (H + 2 * pad[0] - k[0]) / stride[0] + 1, Wo = (W + 2 * pad[1] - k[1]) / stride[1] + 1;
  MPT_CHECK(Ho >= 1 && Wo >= 1, op, ": the output would be empty: input ", x.sizes(), ", kernel_size=", k,
            ", padding=", pad);
  const auto opts = x.options().memory_format(at::MemoryFormat::ChannelsLast);
  at::Tensor y = at::empty({N, C, Ho, Wo}, opts);
  at::Tensor offsets = at::empty({N, C, Ho, Wo}, opts.dtype(at::kChar));
  if (y.numel() == 0) return {y, offsets};
  const at::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const PoolShape s = make_shape(N, C, H, W, Ho, Wo, k, stride, pad);
  MPT_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), op, scalar_t, {
    constexpr int V = 16 / sizeof(scalar_t);
    if (vectorizable<scalar_t>(C, {x.data_ptr(), y.data_ptr(), offsets.data_ptr()}))
      launch_fwd<scalar_t, V>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), offsets.data_ptr<int8_t>(), s, stream);
    else
      launch_fwd<scalar_t, 1>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), offsets.data_ptr<int8_t>(), s, stream);
  });
  return {y, offsets};
}

at::Tensor max_pool2d_backward(const at::Tensor& dy, const at::Tensor& offsets, at::IntArrayRef input_size,
                               at::IntArrayRef k, at::IntArrayRef stride, at::IntArrayRef pad) {
  const char* op = "mptrain::max_pool2d_backward";
  check_pool_args(op, dy, "grad_out", k, stride, pad);
  check_pool_args(op, offsets, "offsets", k, stride, pad);
  MPT_CHECK(offsets.scalar_type() == at::kChar && offsets.sizes().equals(dy.sizes()), op,
            ": offsets must be the int8 tensor mptrain::max_pool2d returned with this output, got ",
            offsets.scalar_type(), " ", offsets.sizes(), " for grad_out ", dy.sizes());
  MPT_CHECK(input_size.size() == 2, op, ": input_size must be [H, W]");
  const int64_t N = dy.size(0), C = dy.size(1), Ho = dy.size(2), Wo = dy.size(3);
  const int64_t H = input_size[0], W = input_size[1];
  MPT_CHECK((H + 2 * pad[0] - k[0]) / stride[0] + 1 == Ho && (W + 2 * pad[1] - k[1]) / stride[1] + 1 == Wo, op,
            ": input_size=", input_size, " does not pool to grad_out's ", dy.sizes());
  at::Tensor dx = at::empty({N, C, H, W}, dy.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (dx.numel() == 0) return dx;
  const at::cuda::CUDAGuard guard(dy.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const PoolShape s = make_shape(N, C, H, W, Ho, Wo, k, stride, pad);
  MPT_DISPATCH_FLOAT_HALF_BF16(dy.scalar_type(), op, scalar_t, {
    constexpr int V = 16 / sizeof(scalar_t);
    if (vectorizable<scalar_t>(C, {dy.data_ptr(), dx.data_ptr(), offsets.data_ptr()}))
      launch_bwd<scalar_t, V>(dy.data_ptr<scalar_t>(), offsets.data_ptr<int8_t>(), dx.data_ptr<scalar_t>(), s, stream);
    else
      launch_bwd<scalar_t, 1>(dy.data_ptr<scalar_t>(), offsets.data_ptr<int8_t>(), dx.data_ptr<scalar_t>(), s, stream);
  });
  return dx;
}
