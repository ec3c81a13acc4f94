// Lab: 2-D max pooling for channels_last tensors (ResNet's 3x3/2 stem pool), forward and backward
// (dev/cuda/maxpool_bench.py builds, checks and times it; not shipped).
//
// Forward: one thread per output pixel and 16-byte vector of channels; it reads the window's vectors,
// keeps the max and its window offset (int8, kh * k + kw) per channel.  Backward: one thread per
// input pixel and vector; it gathers dy from the (at most ceil(k / s)^2) windows that cover the pixel
// and whose saved offset points at it, summing in fp32, and writes dx once: no atomics, no zero fill.
// Tie and NaN rules are ATen's: the first maximum in (kh, kw) order wins, a NaN wins over any number
// and a later NaN over an earlier one; an all -inf window points at its first in-bounds element.
#include <torch/extension.h>

#include <cmath>

#include "type_shim.h"

namespace {

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <int V>
struct alignas(V) Offs {
  int8_t v[V];
};

template <typename T, int V>
__global__ void pool_fwd(const T* __restrict__ x, T* __restrict__ y, int8_t* __restrict__ idx, int N, int H,
                         int W, int C, int Ho, int Wo, int k, int s, int p) {
  const int cv = C / V;
  const int64_t total = int64_t(N) * Ho * Wo * cv;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int c0 = int(t % cv) * V;
    int64_t r = t / cv;
    const int wo = int(r % Wo);
    r /= Wo;
    const int ho = int(r % Ho);
    const int n = int(r / Ho);
    const int hs = ho * s - p, ws = wo * s - p;
    const int kh0 = hs < 0 ? -hs : 0, kw0 = ws < 0 ? -ws : 0;
    float m[V];
    int8_t a[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      m[v] = -INFINITY;
      a[v] = int8_t(kh0 * k + kw0);
    }
    for (int kh = kh0; kh < k && hs + kh < H; ++kh) {
      const T* row = x + ((int64_t(n) * H + hs + kh) * W) * C + c0;
      for (int kw = kw0; kw < k && ws + kw < W; ++kw) {
        const Pack<T, V> xv = *reinterpret_cast<const Pack<T, V>*>(row + int64_t(ws + kw) * C);
        const int8_t o = int8_t(kh * k + kw);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float f = static_cast<float>(xv.v[v]);
          if (f > m[v] || isnan(f)) {
            m[v] = f;
            a[v] = o;
          }
        }
      }
    }
    Pack<T, V> out;
    Offs<V> off;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      out.v[v] = static_cast<T>(m[v]);
      off.v[v] = a[v];
    }
    const int64_t o = ((int64_t(n) * Ho + ho) * Wo + wo) * C + c0;
    *reinterpret_cast<Pack<T, V>*>(y + o) = out;
    *reinterpret_cast<Offs<V>*>(idx + o) = off;
  }
}

template <typename T, int V>
__global__ void pool_bwd(const T* __restrict__ dy, const int8_t* __restrict__ idx, T* __restrict__ dx, int N,
                         int H, int W, int C, int Ho, int Wo, int k, int s, int p) {
  const int cv = C / V;
  const int64_t total = int64_t(N) * H * W * cv;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int c0 = int(t % cv) * V;
    int64_t r = t / cv;
    const int w = int(r % W);
    r /= W;
    const int h = int(r % H);
    const int n = int(r / H);
    // windows ho with ho * s - p <= h <= ho * s - p + k - 1
    const int hlo = h + p - k + 1 <= 0 ? 0 : (h + p - k + 1 + s - 1) / s;
    const int hhi = min(Ho - 1, (h + p) / s);
    const int wlo = w + p - k + 1 <= 0 ? 0 : (w + p - k + 1 + s - 1) / s;
    const int whi = min(Wo - 1, (w + p) / s);
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.f;
    for (int ho = hlo; ho <= hhi; ++ho) {
      for (int wo = wlo; wo <= whi; ++wo) {
        const int8_t want = int8_t((h - (ho * s - p)) * k + (w - (wo * s - p)));
        const int64_t o = ((int64_t(n) * Ho + ho) * Wo + wo) * C + c0;
        const Offs<V> off = *reinterpret_cast<const Offs<V>*>(idx + o);
        const Pack<T, V> g = *reinterpret_cast<const Pack<T, V>*>(dy + o);
#pragma unroll
        for (int v = 0; v < V; ++v)
          if (off.v[v] == want) acc[v] += static_cast<float>(g.v[v]);
      }
    }
    Pack<T, V> out;
#pragma unroll
    for (int v = 0; v < V; ++v) out.v[v] = static_cast<T>(acc[v]);
    *reinterpret_cast<Pack<T, V>*>(dx + ((int64_t(n) * H + h) * W + w) * C + c0) = out;
  }
}

int grid_for(int64_t threads) {
  const int64_t blocks = (threads + 255) / 256;
  const int cap = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 32;
  return int(blocks < cap ? blocks : cap);
}

void check_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast), "maxpool lab: ",
              name, " must be a 4-d channels_last CUDA tensor");
}

// 16-byte vectors when the channel count and the pointers allow, else one element per thread
template <typename T>
int vec_for(int C, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(T);
  bool ok = C % V == 0;
  for (const void* q : ptrs) ok = ok && reinterpret_cast<uintptr_t>(q) % 16 == 0;
  return ok ? V : 1;
}

std::vector<at::Tensor> fwd(const at::Tensor& x, int64_t k, int64_t s, int64_t p) {
  check_input(x, "x");
  TORCH_CHECK(k >= 1 && k * k <= 127 && s >= 1 && p >= 0 && 2 * p <= k, "maxpool lab: bad k/s/p");
  const int N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int Ho = (H + 2 * p - k) / s + 1, Wo = (W + 2 * p - k) / s + 1;
  auto opts = x.options().memory_format(at::MemoryFormat::ChannelsLast);
  at::Tensor y = at::empty({N, C, Ho, Wo}, opts);
  at::Tensor idx = at::empty({N, C, Ho, Wo}, opts.dtype(at::kChar));
  if (y.numel() == 0) return {y, idx};
  const at::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  MPT_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), "maxpool lab", scalar_t, {
    const int V = vec_for<scalar_t>(C, {x.data_ptr(), y.data_ptr(), idx.data_ptr()});
    constexpr int VV = 16 / sizeof(scalar_t);
    const int64_t threads = int64_t(N) * Ho * Wo * (C / V);
    if (V == VV)
      pool_fwd<scalar_t, VV><<<grid_for(threads), 256, 0, stream>>>(
          x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), idx.data_ptr<int8_t>(), N, H, W, C, Ho, Wo, k, s, p);
    else
      pool_fwd<scalar_t, 1><<<grid_for(threads), 256, 0, stream>>>(
          x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), idx.data_ptr<int8_t>(), N, H, W, C, Ho, Wo, k, s, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, idx};
}

at::Tensor bwd(const at::Tensor& dy, const at::Tensor& idx, int64_t H, int64_t W, int64_t k, int64_t s,
               int64_t p) {
  check_input(dy, "dy");
  check_input(idx, "idx");
  TORCH_CHECK(idx.scalar_type() == at::kChar && idx.sizes() == dy.sizes(), "maxpool lab: idx must be int8 like dy");
  const int N = dy.size(0), C = dy.size(1), Ho = dy.size(2), Wo = dy.size(3);
  at::Tensor dx = at::empty({N, C, H, W}, dy.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (dx.numel() == 0) return dx;
  const at::cuda::CUDAGuard guard(dy.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  MPT_DISPATCH_FLOAT_HALF_BF16(dy.scalar_type(), "maxpool lab", scalar_t, {
    const int V = vec_for<scalar_t>(C, {dy.data_ptr(), dx.data_ptr(), idx.data_ptr()});
    constexpr int VV = 16 / sizeof(scalar_t);
    const int64_t threads = int64_t(N) * H * W * (C / V);
    if (V == VV)
      pool_bwd<scalar_t, VV><<<grid_for(threads), 256, 0, stream>>>(
          dy.data_ptr<scalar_t>(), idx.data_ptr<int8_t>(), dx.data_ptr<scalar_t>(), N, H, W, C, Ho, Wo, k, s, p);
    else
      pool_bwd<scalar_t, 1><<<grid_for(threads), 256, 0, stream>>>(
          dy.data_ptr<scalar_t>(), idx.data_ptr<int8_t>(), dx.data_ptr<scalar_t>(), N, H, W, C, Ho, Wo, k, s, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dx;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fwd", &fwd, "max pool forward (channels_last): (y, int8 window offsets)");
  m.def("bwd", &bwd, "max pool backward (channels_last) from the window offsets");
}
