// Building blocks shared by the row-wise kernels (layer_norm.cu, softmax.cu).
//
// Both families do the same shape of work: a group of TPR threads owns one row of a
// [rows, H] tensor, each thread holds NV 16-byte vectors of that row in registers,
// so every pass after the first one (mean, variance, output; or max, sum, output)
// reads registers instead of HBM.  The row is read once and written once, which is
// what puts these kernels near the bandwidth floor.
//
// Everything here is header-only device code plus the (TPR, NV) table that picks a
// row-group shape from the row length.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace mpt {

// Elements of T in one 16-byte vector.
template <typename T>
struct Vec16 {
  static constexpr int n = 16 / int(sizeof(T));
};

// ---- unpack / pack a 16-byte register vector to / from fp32 -----------------------
// Explicit bit manipulation (not reinterpret through memory) keeps the vectors in
// registers: no local-memory round trip.
__device__ __forceinline__ void unpack(const uint4& r, float (&f)[4], float*) {
  f[0] = __uint_as_float(r.x);
  f[1] = __uint_as_float(r.y);
  f[2] = __uint_as_float(r.z);
  f[3] = __uint_as_float(r.w);
}
__device__ __forceinline__ float2 h2f(uint32_t u) {
  __half2 h;
  h = *reinterpret_cast<__half2*>(&u);
  return __half22float2(h);
}
__device__ __forceinline__ void unpack(const uint4& r, float (&f)[8], at::Half*) {
  float2 a = h2f(r.x), b = h2f(r.y), c = h2f(r.z), d = h2f(r.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}
__device__ __forceinline__ void unpack(const uint4& r, float (&f)[8], at::BFloat16*) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <typename T>
__device__ __forceinline__ void unpack(const uint4& r, float (&f)[Vec16<T>::n]) {
  unpack(r, f, static_cast<T*>(nullptr));
}

__device__ __forceinline__ uint4 pack(const float (&f)[4], float*) {
  return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                    __float_as_uint(f[3]));
}
__device__ __forceinline__ uint32_t f2h2(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t f2bf2(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint4 pack(const float (&f)[8], at::Half*) {
  return make_uint4(f2h2(f[0], f[1]), f2h2(f[2], f[3]), f2h2(f[4], f[5]), f2h2(f[6], f[7]));
}
__device__ __forceinline__ uint4 pack(const float (&f)[8], at::BFloat16*) {
  return make_uint4(f2bf2(f[0], f[1]), f2bf2(f[2], f[3]), f2bf2(f[4], f[5]), f2bf2(f[6], f[7]));
}
template <typename T>
__device__ __forceinline__ uint4 pack(const float (&f)[Vec16<T>::n]) {
  return pack(f, static_cast<T*>(nullptr));
}

__device__ __forceinline__ uint4 load16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ void store16(void* p, const uint4& v) {
  *reinterpret_cast<uint4*>(p) = v;
}

// N consecutive elements of S (16-byte aligned, N * sizeof(S) a multiple of 16) as fp32.
// Used for gamma/beta, whose dtype may differ from the row's (fp32 params, half input).
template <typename S, int N>
__device__ __forceinline__ void load_floats(const S* p, float (&f)[N]) {
  constexpr int per = Vec16<S>::n;
  static_assert(N % per == 0, "load_floats: N must be a multiple of the 16-byte vector width");
#pragma unroll
  for (int c = 0; c < N / per; ++c) {
    float t[per];
    unpack<S>(load16(p + c * per), t);
#pragma unroll
    for (int k = 0; k < per; ++k) f[c * per + k] = t[k];
  }
}

// ---- reductions over a row group of TPR threads (TPR a power of two) -------------
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// All-reduce N values over the TPR threads of a group.  Groups wider than a warp go
// through shared memory: `smem` holds BLOCK/32*N floats.  Callers alternate two such
// buffers between consecutive reductions, which makes one __syncthreads per reduction
// enough (a buffer is only rewritten after every thread passed the next barrier).
// Every thread of the block must call this (it may contain a barrier).
template <int TPR, int N, typename Op>
__device__ __forceinline__ void group_allreduce(float (&v)[N], float* smem, Op op) {
  constexpr int W = TPR < 32 ? TPR : 32;
#pragma unroll
  for (int k = 0; k < N; ++k) {
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1) v[k] = op(v[k], __shfl_xor_sync(0xffffffffu, v[k], o));
  }
  if constexpr (TPR > 32) {
    constexpr int WARPS = TPR / 32;
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
#pragma unroll
      for (int k = 0; k < N; ++k) smem[warp * N + k] = v[k];
    }
    __syncthreads();
    const int first = (warp / WARPS) * WARPS;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float r = smem[first * N + k];
#pragma unroll
      for (int w = 1; w < WARPS; ++w) r = op(r, smem[(first + w) * N + k]);
      v[k] = r;
    }
  }
}

// ---- row-group shapes --------------------------------------------------------------
// Each row of `nvec` 16-byte vectors goes to a group of TPR threads holding NV vectors
// each.  Narrow rows take one warp (no barriers); wide rows take more threads rather
// than more registers per thread, so occupancy stays high enough to cover HBM latency.
// The largest shape (1024 x 4) covers 32768 bf16/fp16 or 16384 fp32 elements; longer or
// misaligned rows go to the generic kernels.
enum class RowShape { W32x1, W32x2, W32x4, W64x4, W128x4, W512x4, W1024x4, Generic };

inline RowShape pick_row_shape(int64_t nvec) {
  if (nvec <= 32) return RowShape::W32x1;
  if (nvec <= 64) return RowShape::W32x2;
  if (nvec <= 128) return RowShape::W32x4;
  if (nvec <= 256) return RowShape::W64x4;
  if (nvec <= 512) return RowShape::W128x4;
  if (nvec <= 2048) return RowShape::W512x4;
  if (nvec <= 4096) return RowShape::W1024x4;
  return RowShape::Generic;
}

// Runs the statement with constexpr TPR and NV bound to the shape's values; the caller
// handles RowShape::Generic itself (the macro does nothing for it).
#define MPT_ROW_SHAPE_SWITCH(SHAPE, ...)                                          \
  switch (SHAPE) {                                                               \
    case ::mpt::RowShape::W32x1: { constexpr int TPR = 32, NV = 1; __VA_ARGS__; break; }     \
    case ::mpt::RowShape::W32x2: { constexpr int TPR = 32, NV = 2; __VA_ARGS__; break; }     \
    case ::mpt::RowShape::W32x4: { constexpr int TPR = 32, NV = 4; __VA_ARGS__; break; }     \
    case ::mpt::RowShape::W64x4: { constexpr int TPR = 64, NV = 4; __VA_ARGS__; break; }     \
    case ::mpt::RowShape::W128x4: { constexpr int TPR = 128, NV = 4; __VA_ARGS__; break; }   \
    case ::mpt::RowShape::W512x4: { constexpr int TPR = 512, NV = 4; __VA_ARGS__; break; }   \
    case ::mpt::RowShape::W1024x4: { constexpr int TPR = 1024, NV = 4; __VA_ARGS__; break; } \
    default: break;                                                              \
  }

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace mpt
