// 2-D max pooling of channels_last tensors, forward and backward (torch.ops.mptrain.max_pool2d).
//
// Why not ATen's kernels or inductor's lowering: at ResNet-50's stem pool (3x3/2 over
// 256x64x112x112 fp16) ATen's channels_last forward / backward run at 26% / 11% of the
// bandwidth floor, and inductor's backward, which recomputes the window offsets it gathers
// from, took 1.45 ms of a 34.9 ms training step (docs/kernels/pool.md).
//
// Layout: x is [N, H, W, C] in memory (channels_last).  Each thread owns one vector of V
// channels (16 bytes when C and the pointers allow, else one element) of:
// * forward: one output pixel; it reads its window, keeps per channel the maximum and the
//   window offset (int8, kh * KW + kw) of the element it came from;
// * backward, (3x3, stride 2) and (2x2, stride 2): one stride x stride tile of input pixels;
//   it reads each window that covers the tile once (at most 2 x 2 of them for these shapes),
//   credits dy to the tile's pixels the saved offsets point at, sums in fp32 and writes each dx
//   once.  A thread per input pixel would read 2.25 windows per pixel instead of 1 per pixel;
// * backward, other windows: one input pixel, looping over the windows that cover it.
// No atomics, no zero fill, deterministic: each pixel's sum runs over its windows in (ho, wo)
// order.  Tie and NaN rules are ATen's CPU kernels': the first maximum in (kh, kw) order wins,
// a NaN wins over any number and a later NaN over an earlier one, and a window of -inf only
// points at its first in-bounds element.
//
// Indexing is 32-bit: the host launches the batch in chunks of fewer than 2^31 threads, and a
// flat thread index splits into (n, row, col, channel vector) with ATen's IntDivider (a
// multiply-high and a shift per division; a 64-bit division is a long emulated sequence).
#include "entry_points.h"
#include "type_shim.h"

#include <ATen/cuda/detail/IntegerDivider.cuh>

#include <algorithm>
#include <climits>
#include <cmath>

namespace {

using at::cuda::detail::IntDivider;

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <int V>
struct alignas(V) Offsets {
  int8_t v[V];
};

struct PoolShape {
  int H, W, C, Ho, Wo;
  int kh, kw, sh, sw, ph, pw;
};

// Splits a flat index over [n, rows, cols, C / V] (rows and cols: pixels or tiles).
struct PixelDivider {
  IntDivider<unsigned> vectors, cols, rows;
};

PixelDivider pixel_divider(int rows, int cols, int vectors) {
  return {IntDivider<unsigned>(unsigned(vectors)), IntDivider<unsigned>(unsigned(cols)),
          IntDivider<unsigned>(unsigned(rows))};
}

// The thread's (n, row, col, first channel).
struct Pixel {
  int n, r, c, c0;
};

template <int V>
__device__ __forceinline__ Pixel pixel_of(unsigned t, const PixelDivider& d) {
  const auto a = d.vectors.divmod(t);
  const auto b = d.cols.divmod(a.div);
  const auto c = d.rows.divmod(b.div);
  return {int(c.div), int(c.mod), int(b.mod), int(a.mod) * V};
}

#define MPT_POOL_THREADS(t, total) \
  for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < (total); t += gridDim.x * blockDim.x)

// KH, KW, SH, SW > 0: that window shape at compile time; 0: the runtime shape in `s`.
template <typename T, int V, int KH, int KW, int SH, int SW>
__global__ void max_pool_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, int8_t* __restrict__ offsets,
                                    PoolShape s, PixelDivider d, unsigned total) {
  const int kh = KH ? KH : s.kh, kw = KW ? KW : s.kw, sh = SH ? SH : s.sh, sw = SW ? SW : s.sw;
  MPT_POOL_THREADS(t, total) {
    const Pixel o = pixel_of<V>(t, d);
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

// The windows along one axis that cover any of the input indices [first, last]: [lo, hi]
// (empty when lo > hi).
__device__ __forceinline__ void covering(int first, int last, int k, int stride, int pad, int n_out, int& lo,
                                         int& hi) {
  const int start = first + pad - k + 1;  // the window starting here is the first to reach `first`
  lo = start <= 0 ? 0 : (start + stride - 1) / stride;
  hi = min(n_out - 1, (last + pad) / stride);
}

template <typename T, int V>
__device__ __forceinline__ void store(T* dst, const float (&acc)[V]) {
  Pack<T, V> out;
#pragma unroll
  for (int v = 0; v < V; ++v) out.v[v] = static_cast<T>(acc[v]);
  *reinterpret_cast<Pack<T, V>*>(dst) = out;
}

// One thread per SH x SW tile of input pixels (rows, cols of `d`: tiles) and vector.
template <typename T, int V, int KH, int KW, int SH, int SW>
__global__ void max_pool_bwd_tile_kernel(const T* __restrict__ dy, const int8_t* __restrict__ offsets,
                                         T* __restrict__ dx, PoolShape s, PixelDivider d, unsigned total) {
  // windows covering one tile along an axis, at most: a tile spans SH rows, a window KH
  constexpr int MH = (KH + SH - 2) / SH + 1, MW = (KW + SW - 2) / SW + 1;
  MPT_POOL_THREADS(t, total) {
    const Pixel p = pixel_of<V>(t, d);
    const int r0 = p.r * SH, q0 = p.c * SW;  // the tile's first input row and column
    int hlo, hhi, wlo, whi;
    covering(r0, r0 + SH - 1, KH, SH, s.ph, s.Ho, hlo, hhi);
    covering(q0, q0 + SW - 1, KW, SW, s.pw, s.Wo, wlo, whi);
    const int64_t plane = int64_t(p.n) * s.Ho * s.Wo * s.C + p.c0;
    // every load first, then the compares
    Offsets<V> off[MH][MW];
    Pack<T, V> g[MH][MW];
#pragma unroll
    for (int i = 0; i < MH; ++i)
#pragma unroll
      for (int j = 0; j < MW; ++j)
        if (hlo + i <= hhi && wlo + j <= whi) {
          const int64_t at = plane + (int64_t(hlo + i) * s.Wo + wlo + j) * s.C;
          off[i][j] = *reinterpret_cast<const Offsets<V>*>(offsets + at);
          g[i][j] = *reinterpret_cast<const Pack<T, V>*>(dy + at);
        }
    float acc[SH][SW][V];
#pragma unroll
    for (int a = 0; a < SH; ++a)
#pragma unroll
      for (int b = 0; b < SW; ++b)
#pragma unroll
        for (int v = 0; v < V; ++v) acc[a][b][v] = 0.f;
#pragma unroll
    for (int i = 0; i < MH; ++i)
#pragma unroll
      for (int j = 0; j < MW; ++j) {
        if (hlo + i > hhi || wlo + j > whi) continue;
        // the tile's origin in the window's (kh, kw) coordinates
        const int dh = r0 - ((hlo + i) * SH - s.ph), dw = q0 - ((wlo + j) * SW - s.pw);
#pragma unroll
        for (int a = 0; a < SH; ++a)
#pragma unroll
          for (int b = 0; b < SW; ++b) {
            const int kh = dh + a, kw = dw + b;
            if (kh < 0 || kh >= KH || kw < 0 || kw >= KW) continue;
            const int8_t want = int8_t(kh * KW + kw);
#pragma unroll
            for (int v = 0; v < V; ++v)
              if (off[i][j].v[v] == want) acc[a][b][v] += static_cast<float>(g[i][j].v[v]);
          }
      }
    // the tile's pixels past the image's edge (odd H or W) are never pointed at: not written
#pragma unroll
    for (int a = 0; a < SH; ++a)
#pragma unroll
      for (int b = 0; b < SW; ++b)
        if (r0 + a < s.H && q0 + b < s.W)
          store<T, V>(dx + ((int64_t(p.n) * s.H + r0 + a) * s.W + q0 + b) * s.C + p.c0, acc[a][b]);
  }
}

// One thread per input pixel and vector, any window: a loop over the covering windows.
template <typename T, int V>
__global__ void max_pool_bwd_kernel(const T* __restrict__ dy, const int8_t* __restrict__ offsets, T* __restrict__ dx,
                                    PoolShape s, PixelDivider d, unsigned total) {
  MPT_POOL_THREADS(t, total) {
    const Pixel p = pixel_of<V>(t, d);
    int hlo, hhi, wlo, whi;
    covering(p.r, p.r, s.kh, s.sh, s.ph, s.Ho, hlo, hhi);
    covering(p.c, p.c, s.kw, s.sw, s.pw, s.Wo, wlo, whi);
    const int64_t plane = int64_t(p.n) * s.Ho * s.Wo * s.C + p.c0;
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.f;
    for (int ho = hlo; ho <= hhi; ++ho)
      for (int wo = wlo; wo <= whi; ++wo) {
        const int8_t want = int8_t((p.r - (ho * s.sh - s.ph)) * s.kw + (p.c - (wo * s.sw - s.pw)));
        const int64_t at = plane + (int64_t(ho) * s.Wo + wo) * s.C;
        const Offsets<V> off = *reinterpret_cast<const Offsets<V>*>(offsets + at);
        const Pack<T, V> g = *reinterpret_cast<const Pack<T, V>*>(dy + at);
#pragma unroll
        for (int v = 0; v < V; ++v)
          if (off.v[v] == want) acc[v] += static_cast<float>(g.v[v]);
      }
    store<T, V>(dx + ((int64_t(p.n) * s.H + p.r) * s.W + p.c) * s.C + p.c0, acc);
  }
}

#undef MPT_POOL_THREADS

int grid_for(int64_t threads) {
  const int64_t blocks = (threads + 255) / 256;
  const int64_t cap = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return int(blocks < cap ? blocks : cap);
}

// Calls launch(n0, count) over the batch in chunks of images whose threads (per_image each)
// number fewer than 2^31, the range of the kernels' 32-bit indices.
template <typename Launch>
void over_batch(const char* op, int64_t N, int64_t per_image, Launch&& launch) {
  MPT_CHECK(per_image < INT_MAX, op, ": one image needs ", per_image,
            " threads; at most 2^31 - 1 are supported (use torch.nn.functional.max_pool2d)");
  const int64_t chunk = std::max<int64_t>(1, INT_MAX / per_image);
  for (int64_t n0 = 0; n0 < N; n0 += chunk) launch(n0, std::min(chunk, N - n0));
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

PoolShape make_shape(int64_t C, int64_t H, int64_t W, int64_t Ho, int64_t Wo, at::IntArrayRef k,
                     at::IntArrayRef stride, at::IntArrayRef pad) {
  return {int(H), int(W), int(C), int(Ho), int(Wo), int(k[0]), int(k[1]),
          int(stride[0]), int(stride[1]), int(pad[0]), int(pad[1])};
}

template <typename T, int V>
void launch_fwd(const char* op, const T* x, T* y, int8_t* offsets, int64_t N, const PoolShape& s,
                cudaStream_t stream) {
  const PixelDivider d = pixel_divider(s.Ho, s.Wo, s.C / V);
  const int64_t per_image = int64_t(s.Ho) * s.Wo * (s.C / V);
  const int64_t in_image = int64_t(s.H) * s.W * s.C, out_image = int64_t(s.Ho) * s.Wo * s.C;
  over_batch(op, N, per_image, [&](int64_t n0, int64_t n) {
    const unsigned total = unsigned(n * per_image);
    const int grid = grid_for(total);
    const T* xs = x + n0 * in_image;
    T* ys = y + n0 * out_image;
    int8_t* os = offsets + n0 * out_image;
    if (s.kh == 3 && s.kw == 3 && s.sh == 2 && s.sw == 2)
      max_pool_fwd_kernel<T, V, 3, 3, 2, 2><<<grid, 256, 0, stream>>>(xs, ys, os, s, d, total);
    else if (s.kh == 2 && s.kw == 2 && s.sh == 2 && s.sw == 2)
      max_pool_fwd_kernel<T, V, 2, 2, 2, 2><<<grid, 256, 0, stream>>>(xs, ys, os, s, d, total);
    else
      max_pool_fwd_kernel<T, V, 0, 0, 0, 0><<<grid, 256, 0, stream>>>(xs, ys, os, s, d, total);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename T, int V>
void launch_bwd(const char* op, const T* dy, const int8_t* offsets, T* dx, int64_t N, const PoolShape& s,
                cudaStream_t stream) {
  const bool tile = s.sh == 2 && s.sw == 2 && s.kh == s.kw && (s.kh == 3 || s.kh == 2);
  // tiled: rows and cols of the thread grid are stride x stride tiles of the input
  const int rows = tile ? (s.H + 1) / 2 : s.H, cols = tile ? (s.W + 1) / 2 : s.W;
  const PixelDivider d = pixel_divider(rows, cols, s.C / V);
  const int64_t per_image = int64_t(rows) * cols * (s.C / V);
  const int64_t in_image = int64_t(s.H) * s.W * s.C, out_image = int64_t(s.Ho) * s.Wo * s.C;
  over_batch(op, N, per_image, [&](int64_t n0, int64_t n) {
    const unsigned total = unsigned(n * per_image);
    const int grid = grid_for(total);
    const T* dys = dy + n0 * out_image;
    const int8_t* os = offsets + n0 * out_image;
    T* dxs = dx + n0 * in_image;
    if (tile && s.kh == 3)
      max_pool_bwd_tile_kernel<T, V, 3, 3, 2, 2><<<grid, 256, 0, stream>>>(dys, os, dxs, s, d, total);
    else if (tile)
      max_pool_bwd_tile_kernel<T, V, 2, 2, 2, 2><<<grid, 256, 0, stream>>>(dys, os, dxs, s, d, total);
    else
      max_pool_bwd_kernel<T, V><<<grid, 256, 0, stream>>>(dys, os, dxs, s, d, total);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
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
  const PoolShape s = make_shape(C, H, W, Ho, Wo, k, stride, pad);
  MPT_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), op, scalar_t, {
    constexpr int V = 16 / sizeof(scalar_t);
    if (vectorizable<scalar_t>(C, {x.data_ptr(), y.data_ptr(), offsets.data_ptr()}))
      launch_fwd<scalar_t, V>(op, x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), offsets.data_ptr<int8_t>(), N, s,
                               stream);
    else
      launch_fwd<scalar_t, 1>(op, x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), offsets.data_ptr<int8_t>(), N, s,
                               stream);
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
  const PoolShape s = make_shape(C, H, W, Ho, Wo, k, stride, pad);
  MPT_DISPATCH_FLOAT_HALF_BF16(dy.scalar_type(), op, scalar_t, {
    constexpr int V = 16 / sizeof(scalar_t);
    if (vectorizable<scalar_t>(C, {dy.data_ptr(), dx.data_ptr(), offsets.data_ptr()}))
      launch_bwd<scalar_t, V>(op, dy.data_ptr<scalar_t>(), offsets.data_ptr<int8_t>(), dx.data_ptr<scalar_t>(), N, s,
                               stream);
    else
      launch_bwd<scalar_t, 1>(op, dy.data_ptr<scalar_t>(), offsets.data_ptr<int8_t>(), dx.data_ptr<scalar_t>(), N, s,
                               stream);
  });
  return dx;
}
