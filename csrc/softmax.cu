// Scaled, masked softmax over the last dimension, forward and backward.
//
// What is fused and why:
//  * forward: y = softmax(where(mask | causal, -inf, scale * x)) in one read of x and one
//    write of y.  Eager PyTorch spends three to five passes over the scores (scale,
//    masked_fill, softmax, and its temporaries): about 14% of the bandwidth floor.  The
//    row stays in fp32 registers between the max, sum and output passes.
//  * the boolean mask is read through its broadcast strides (e.g. [B,1,Sq,Sk] over the
//    heads, [B,1,1,Sk] padding masks), never expanded in memory; causal masking is
//    computed from indices and needs no tensor at all.
//  * a fully masked row gives zeros (and zero gradient), not NaN.
//  * backward: dx = scale * y * (dy - sum(dy * y)) from the saved output, one read of
//    y and dy and one write of dx.
//  * launch layout by row length (launch_fwd): the row_reduce.cuh table in general; for
//    16-bit rows of 33..64 vectors (512 bf16) the "lean" forward (mask / causal as
//    template arguments, masking on raw words, one FFMA + ex2 per element); for masked
//    rows of 33..64 vectors it does not take, two rows per warp sharing the mask bytes;
//    for masked rows of 129..256 vectors (2048 bf16) a persistent grid.
//  * rows that are misaligned, not a multiple of the 16-byte vector or longer than the
//    register cache (32768 half / 16384 fp32 elements) use scalar kernels that re-read
//    the row from L1/L2.
// Measured figures and the variants that lost: docs/kernels/softmax.md.
#include "launch.cuh"
#include "row_reduce.cuh"
#include "type_shim.h"

#include <type_traits>
#include <vector>

namespace {

using namespace mpt;

// Where the mask element of (row, col) lives.  Rows are the flattened [D0, D1, Sq]
// leading dims; the strides are the mask's broadcast strides (0 where broadcast).
struct MaskLayout {
  const uint8_t* ptr = nullptr;  // nullptr: no mask tensor
  int64_t s0 = 0, s1 = 0, sq_stride = 0, key_stride = 0;
  int64_t d1 = 1, sq = 1;
  int mode = 0;  // 0 none, 1 vector loads (key stride 1, aligned), 2 one byte per row (key stride 0), 3 bytewise
  // When the mask is broadcast over D1 (the heads of a [B, 1, Sq, Sk] mask), blocks walk
  // the rows in (D0, Sq, D1) order: the D1 rows sharing a mask row run back to back, so
  // the mask is read from HBM about once instead of once per head.
  bool heads_inner = false;

  bool idx32 = true;  // every row index fits 32 bits: cheaper index arithmetic

  // Row `lin` of the launch -> (row of x, query index q, mask row).  A few integer
  // divisions per row, in 32 bits whenever the sizes allow (64-bit division is slow).
  template <typename I>
  __device__ __forceinline__ void locate_as(int64_t lin, int64_t& row, int64_t& q, const uint8_t*& mrow) const {
    const I l = I(lin), n1 = I(d1), nq = I(sq);
    I i0, i1, iq;
    if (heads_inner) {
      i1 = l % n1;
      const I t = l / n1;
      iq = t % nq;
      i0 = t / nq;
    } else {
      iq = l % nq;
      const I t = l / nq;
      i1 = t % n1;
      i0 = t / n1;
    }
    row = (int64_t(i0) * d1 + int64_t(i1)) * sq + int64_t(iq);
    q = int64_t(iq);
    mrow = mode != 0 ? ptr + int64_t(i0) * s0 + int64_t(i1) * s1 + int64_t(iq) * sq_stride : nullptr;
  }
  __device__ __forceinline__ void locate(int64_t lin, int64_t& row, int64_t& q, const uint8_t*& mrow) const {
    if (idx32) locate_as<uint32_t>(lin, row, q, mrow);
    else locate_as<uint64_t>(lin, row, q, mrow);
  }
};

// Mask bits of VEC consecutive columns starting at `col` (16-byte-vector kernels).
template <int VEC>
__device__ __forceinline__ void mask_bits(const MaskLayout& m, const uint8_t* mrow, int col, bool (&b)[VEC]) {
  if (m.mode == 1) {
    if constexpr (VEC == 8) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(mrow + col));
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        b[k] = (u.x >> (8 * k)) & 0xffu;
        b[k + 4] = (u.y >> (8 * k)) & 0xffu;
      }
    } else {
      const uint32_t u = __ldg(reinterpret_cast<const unsigned int*>(mrow + col));
#pragma unroll
      for (int k = 0; k < VEC; ++k) b[k] = (u >> (8 * k)) & 0xffu;
    }
  } else if (m.mode == 2) {
    const bool v = __ldg(mrow) != 0;
#pragma unroll
    for (int k = 0; k < VEC; ++k) b[k] = v;
  } else if (m.mode == 3) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) b[k] = __ldg(mrow + col + k) != 0;
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) b[k] = false;
  }
}

constexpr float kLog2e = 1.4426950408889634f;

template <typename T, int TPR, int NV, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, MaskLayout m, int64_t rows, int S,
                   float scale, bool causal) {
  constexpr int VEC = Vec16<T>::n, RPB = BLOCK / TPR;
  __shared__ float red[2][BLOCK / 32];
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int64_t lin = int64_t(blockIdx.x) * RPB + g;
  const bool valid = lin < rows;
  const int nvec = S / VEC;
  int64_t row, q;
  const uint8_t* mrow;
  m.locate(valid ? lin : 0, row, q, mrow);

  float v[NV][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = i * TPR + lane;
    if (valid && j < nvec) {
      unpack<T>(load16(x + row * S + j * VEC), v[i]);
      bool mb[VEC];
      if (mrow) mask_bits<VEC>(m, mrow, j * VEC, mb);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const bool masked = (mrow && mb[k]) || (causal && j * VEC + k > q);
        v[i][k] = masked ? -INFINITY : v[i][k] * scale;
      }
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[i][k] = -INFINITY;
    }
  }
  float mx[1] = {-INFINITY};
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) mx[0] = fmaxf(mx[0], v[i][k]);
  group_allreduce<TPR, 1>(mx, red[0], MaxOp());
  // A fully masked row has max -inf; keep it finite so exp gives exact zeros.
  const float mref = mx[0] == -INFINITY ? 0.f : mx[0];
  float sum[1] = {0.f};
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v[i][k] = exp2f((v[i][k] - mref) * kLog2e);
      sum[0] += v[i][k];
    }
  group_allreduce<TPR, 1>(sum, red[1], SumOp());
  if (!valid) return;
  const float inv = sum[0] > 0.f ? 1.f / sum[0] : 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = i * TPR + lane;
    if (j < nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[i][k] *= inv;
      store16(y + row * S + j * VEC, pack<T>(v[i]));
    }
  }
}

template <typename T, int TPR, int NV, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, int64_t rows,
                   int S, float scale) {
  constexpr int VEC = Vec16<T>::n, RPB = BLOCK / TPR;
  __shared__ float red[BLOCK / 32];
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * RPB + g;
  const bool valid = row < rows;
  const int nvec = S / VEC;
  uint4 ry[NV], rd[NV];
  float dot[1] = {0.f};
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = i * TPR + lane;
    const bool ok = valid && j < nvec;
    ry[i] = ok ? load16(y + row * S + j * VEC) : make_uint4(0, 0, 0, 0);
    rd[i] = ok ? load16(dy + row * S + j * VEC) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float a[VEC], b[VEC];
    unpack<T>(ry[i], a);
    unpack<T>(rd[i], b);
#pragma unroll
    for (int k = 0; k < VEC; ++k) dot[0] += a[k] * b[k];
  }
  group_allreduce<TPR, 1>(dot, red, SumOp());
  if (!valid) return;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = i * TPR + lane;
    if (j < nvec) {
      float a[VEC], b[VEC];
      unpack<T>(ry[i], a);
      unpack<T>(rd[i], b);
#pragma unroll
      for (int k = 0; k < VEC; ++k) a[k] = scale * a[k] * (b[k] - dot[0]);
      store16(dx + row * S + j * VEC, pack<T>(a));
    }
  }
}

// ---- persistent forward: masked rows of 129..256 vectors -----------------------------
// One launch of about as many blocks as fit on the GPU; each row group walks rows
// lin, lin + stride, ...  Row groups of at most one warp only (no barriers: groups may
// run different trip counts).  At masked 2048 bf16 it beat the one-shot row kernel
// (H200, graph-timed fwd+bwd).  No next-row prefetch: at 8 vectors per lane the next
// row's registers do not fit beside the current one's.

// Up to 8 mask bytes (one per element, 0/1) of the VEC columns at `col`, raw.
template <int VEC>
__device__ __forceinline__ uint2 mask_raw(const MaskLayout& m, const uint8_t* mrow, int col) {
  if (m.mode == 1) {
    if constexpr (VEC == 8) return __ldg(reinterpret_cast<const uint2*>(mrow + col));
    else return make_uint2(__ldg(reinterpret_cast<const unsigned int*>(mrow + col)), 0u);
  }
  bool b[VEC];
  mask_bits<VEC>(m, mrow, col, b);
  uint2 r = make_uint2(0u, 0u);
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    if (k < 4) r.x |= uint32_t(b[k]) << (8 * k);
    else r.y |= uint32_t(b[k]) << (8 * (k - 4));
  }
  return r;
}

template <typename T, int NV, int TPR>
struct FwdRow {
  uint4 x[NV];
  uint2 mk[NV];
  int64_t row, q;
  bool valid;
};

template <typename T, int TPR, int NV>
__device__ __forceinline__ void fwd_load(FwdRow<T, NV, TPR>& r, const T* x, const MaskLayout& m, int64_t lin,
                                         int64_t rows, int S, int lane) {
  constexpr int VEC = Vec16<T>::n;
  const int nvec = S / VEC;
  const uint8_t* mrow;
  r.valid = lin < rows;
  m.locate(r.valid ? lin : 0, r.row, r.q, mrow);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = i * TPR + lane;
    const bool ok = r.valid && j < nvec;
    r.x[i] = ok ? load16(x + r.row * S + j * VEC) : make_uint4(0, 0, 0, 0);
    r.mk[i] = (ok && mrow) ? mask_raw<VEC>(m, mrow, j * VEC) : make_uint2(0u, 0u);
  }
}

template <typename T, int TPR, int NV>
__device__ __forceinline__ void fwd_finish(const FwdRow<T, NV, TPR>& r, T* y, int S, float scale, bool causal,
                                           int lane) {
  constexpr int VEC = Vec16<T>::n;
  const int nvec = S / VEC;
  float v[NV][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = i * TPR + lane;
    unpack<T>(r.x[i], v[i]);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const uint32_t byte = (k < 4 ? r.mk[i].x >> (8 * k) : r.mk[i].y >> (8 * (k - 4))) & 0xffu;
      const bool masked = j >= nvec || byte != 0u || (causal && j * VEC + k > r.q);
      v[i][k] = masked ? -INFINITY : v[i][k] * scale;
    }
  }
  float mx[1] = {-INFINITY};
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) mx[0] = fmaxf(mx[0], v[i][k]);
  group_allreduce<TPR, 1>(mx, nullptr, MaxOp());
  const float mref = mx[0] == -INFINITY ? 0.f : mx[0];
  float sum[1] = {0.f};
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v[i][k] = exp2f((v[i][k] - mref) * kLog2e);
      sum[0] += v[i][k];
    }
  group_allreduce<TPR, 1>(sum, nullptr, SumOp());
  if (!r.valid) return;
  const float inv = sum[0] > 0.f ? 1.f / sum[0] : 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = i * TPR + lane;
    if (j < nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[i][k] *= inv;
      store16(y + r.row * S + j * VEC, pack<T>(v[i]));
    }
  }
}

template <typename T, int TPR, int NV, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_fwd_persist(const T* __restrict__ x, T* __restrict__ y, MaskLayout m, int64_t rows, int S, float scale,
                    bool causal) {
  static_assert(TPR <= 32, "persistent kernels: at most one warp per row (no barriers)");
  constexpr int RPB = BLOCK / TPR;
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int64_t stride = int64_t(gridDim.x) * RPB;
  // Whole warps stay together (shuffles need every lane): a half-warp pair shares a
  // trip count by rounding the start down to the warp's first row.
  const int64_t lin0 = int64_t(blockIdx.x) * RPB + g;
  const int64_t warp_first = int64_t(blockIdx.x) * RPB + (threadIdx.x / 32) * (32 / TPR);
  const int64_t iters = rows > warp_first ? (rows - warp_first + stride - 1) / stride : 0;
  FwdRow<T, NV, TPR> cur;
  fwd_load<T, TPR, NV>(cur, x, m, lin0, rows, S, lane);
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t lin = lin0 + it * stride;
    fwd_finish<T, TPR, NV>(cur, y, S, scale, causal, lane);
    fwd_load<T, TPR, NV>(cur, x, m, lin + stride, rows, S, lane);
  }
}

// Two rows per warp for masked rows of 33..64 vectors where the lean forward does not
// apply (fp32 storage, byte-per-row masks, scale <= 0): one warp per row, R consecutive
// launch rows per warp.  With a [B, 1, Sq, Sk] mask the launch walks heads innermost, so
// those R rows usually share a mask row: its bytes are loaded once for all of them
// (reused when the mask row pointer is the same, reloaded otherwise).  All R rows' x loads
// are issued before the first reduction: R times the bytes in flight per warp of the
// one-row kernel.
template <typename T, int NV, int R, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_fwd_multirow(const T* __restrict__ x, T* __restrict__ y, MaskLayout m, int64_t rows, int S, float scale,
                     bool causal) {
  constexpr int VEC = Vec16<T>::n, WARPS = BLOCK / 32;
  const int lane = threadIdx.x % 32;
  const int64_t lin0 = (int64_t(blockIdx.x) * WARPS + threadIdx.x / 32) * R;
  const int nvec = S / VEC;
  int64_t row[R], q[R];
  bool valid[R];
  uint4 raw[R][NV];
  uint2 mk[R][NV];
  const uint8_t* prev = nullptr;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const uint8_t* mrow;
    valid[r] = lin0 + r < rows;
    m.locate(valid[r] ? lin0 + r : 0, row[r], q[r], mrow);
    const bool reuse = r > 0 && mrow == prev;
    prev = mrow;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int j = i * 32 + lane;
      const bool ok = valid[r] && j < nvec;
      raw[r][i] = ok ? load16(x + row[r] * S + j * VEC) : make_uint4(0, 0, 0, 0);
      if (reuse) mk[r][i] = mk[r > 0 ? r - 1 : 0][i];
      else mk[r][i] = (ok && mrow) ? mask_raw<VEC>(m, mrow, j * VEC) : make_uint2(0u, 0u);
    }
  }
  float v[R][NV][VEC];
  float mx[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    mx[r] = -INFINITY;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int j = i * 32 + lane;
      unpack<T>(raw[r][i], v[r][i]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const uint32_t byte = (k < 4 ? mk[r][i].x >> (8 * k) : mk[r][i].y >> (8 * (k - 4))) & 0xffu;
        const bool masked = j >= nvec || byte != 0u || (causal && j * VEC + k > q[r]);
        v[r][i][k] = masked ? -INFINITY : v[r][i][k] * scale;
        mx[r] = fmaxf(mx[r], v[r][i][k]);
      }
    }
  }
  group_allreduce<32, R>(mx, nullptr, MaxOp());
  float sum[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float mref = mx[r] == -INFINITY ? 0.f : mx[r];  // fully masked row: exact zeros
    sum[r] = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i)
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        v[r][i][k] = exp2f((v[r][i][k] - mref) * kLog2e);
        sum[r] += v[r][i][k];
      }
  }
  group_allreduce<32, R>(sum, nullptr, SumOp());
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (!valid[r]) continue;
    const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int j = i * 32 + lane;
      if (j < nvec) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[r][i][k] *= inv;
        store16(y + row[r] * S + j * VEC, pack<T>(v[r][i]));
      }
    }
  }
}

// ---- lean forward for 16-bit rows of 33..64 vectors (512 bf16/fp16) -----------------
// One row per warp, 2 vectors per lane, with fewer instructions per element, because the
// forward at 512 spends its time in each warp's serial load -> reduce -> exp -> store
// chain, not in bytes in flight (4 rows per warp, with more bytes in flight per SM, was
// 15 points slower; 2 rows per warp and a persistent variant lost to it too):
// the persistent "stream", both removed):
//  * mask and causal are template parameters (no per-element runtime tests);
//  * masking happens on the raw 16-bit words, before unpacking: the 8 mask bytes of a
//    vector become per-byte sign bits (any nonzero byte counts), prmt's sign-replicate
//    mode spreads them to 16-bit lanes and one lop3 writes -inf where masked; causal adds
//    a suffix of masked bytes per vector (a few integer ops per 8 elements);
//  * scale > 0 is required (host check): the max of the raw row is then the max of the
//    scaled one, and exp(scale*(x - max)) = ex2(x*c - max*c), c = scale*log2(e): one FFMA
//    and one MUFU.EX2 (ftz: outputs below 2^-126 flush to 0) per element.
template <typename T>
struct NegInf2;  // two -inf of T in one 32-bit word
template <>
struct NegInf2<at::BFloat16> {
  static constexpr uint32_t bits = 0xff80ff80u;
};
template <>
struct NegInf2<at::Half> {
  static constexpr uint32_t bits = 0xfc00fc00u;
};

// Byte permute (PTX prmt, generic mode): selector nibbles with bit 3 set replicate the
// sign bit of the selected byte over the output byte.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(0u), "r"(sel));
  return d;
}
// Bit 7 of each byte set iff that byte is nonzero (a bool byte other than 0/1 counts as
// true, as in torch); no carry crosses bytes.
__device__ __forceinline__ uint32_t nonzero_msb(uint32_t u) {
  return (((u & 0x7f7f7f7fu) + 0x7f7f7f7fu) | u) & 0x80808080u;
}
__device__ __forceinline__ float ex2_ftz(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

// R rows' raw loads: x (2 vectors per lane; -inf words where the lane or row is out of
// range) and, with MASKED, their mask bytes (shared with the previous row when the mask
// row is the same: consecutive heads of a [B, 1, Sq, Sk] mask under the heads-inner walk).
template <int R, bool MASKED>
struct LeanRows {
  uint4 x[R][2];
  uint2 mk[MASKED ? R : 1][2];
  int64_t row[R];
  int q[R];  // query index, clamped to 2^30 (>= every key index: S <= 2^30)
  bool valid[R];
};

template <typename T, int R, bool MASKED>
__device__ __forceinline__ void lean_load(LeanRows<R, MASKED>& b, const T* x, const MaskLayout& m, int64_t lin0,
                                          int64_t rows, int S, int lane) {
  constexpr uint32_t NI = NegInf2<T>::bits;
  const int nvec = S / 8;
  const uint8_t* prev = nullptr;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const uint8_t* mrow;
    int64_t q;
    b.valid[r] = lin0 + r < rows;
    m.locate(b.valid[r] ? lin0 + r : 0, b.row[r], q, mrow);
    b.q[r] = q < (int64_t(1) << 30) ? int(q) : (1 << 30);
    const bool reuse = r > 0 && mrow == prev;
    prev = mrow;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int j = i * 32 + lane;
      const bool ok = b.valid[r] && j < nvec;
      b.x[r][i] = ok ? load16(x + b.row[r] * S + j * 8) : make_uint4(NI, NI, NI, NI);
      if constexpr (MASKED) {
        if (reuse) b.mk[r][i] = b.mk[r > 0 ? r - 1 : 0][i];
        else b.mk[r][i] = ok ? __ldg(reinterpret_cast<const uint2*>(mrow + j * 8)) : make_uint2(0u, 0u);
      }
    }
  }
}

template <typename T, int R, bool MASKED, bool CAUSAL>
__device__ __forceinline__ void lean_finish(const LeanRows<R, MASKED>& b, T* y, int S, float c, int lane) {
  constexpr uint32_t NI = NegInf2<T>::bits;
  const int nvec = S / 8;
  float v[R][2][8];
  float mx[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    mx[r] = -INFINITY;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint4 w = b.x[r][i];
      if constexpr (MASKED || CAUSAL) {
        uint32_t lo = 0u, hi = 0u;  // sign bit per byte = element masked
        if constexpr (MASKED) {
          lo = nonzero_msb(b.mk[r][i].x);
          hi = nonzero_msb(b.mk[r][i].y);
        }
        if constexpr (CAUSAL) {
          // Keys k > q are masked: the vector's first `keep` elements stay.
          const int kq = b.q[r] - (i * 32 + lane) * 8 + 1;
          const int keep = kq < 0 ? 0 : (kq > 8 ? 8 : kq);
          lo |= keep >= 4 ? 0u : 0x80808080u << (8 * keep);
          hi |= keep >= 8 ? 0u : (keep <= 4 ? 0x80808080u : 0x80808080u << (8 * (keep - 4)));
        }
        const uint32_t m0 = prmt(lo, 0x9988u), m1 = prmt(lo, 0xbbaau);
        const uint32_t m2 = prmt(hi, 0x9988u), m3 = prmt(hi, 0xbbaau);
        w.x = (w.x & ~m0) | (NI & m0);
        w.y = (w.y & ~m1) | (NI & m1);
        w.z = (w.z & ~m2) | (NI & m2);
        w.w = (w.w & ~m3) | (NI & m3);
      }
      unpack<T>(w, v[r][i]);
#pragma unroll
      for (int k = 0; k < 8; ++k) mx[r] = fmaxf(mx[r], v[r][i][k]);
    }
  }
  group_allreduce<32, R>(mx, nullptr, MaxOp());
  float sum[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float mc = (mx[r] == -INFINITY ? 0.f : mx[r]) * c;  // fully masked row: exact zeros
    sum[r] = 0.f;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        v[r][i][k] = ex2_ftz(fmaf(v[r][i][k], c, -mc));
        sum[r] += v[r][i][k];
      }
  }
  group_allreduce<32, R>(sum, nullptr, SumOp());
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (!b.valid[r]) continue;
    const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int j = i * 32 + lane;
      if (j < nvec) {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[r][i][k] *= inv;
        store16(y + b.row[r] * S + j * 8, pack<T>(v[r][i]));
      }
    }
  }
}

// One batch of R rows per warp, one-shot grid (lean1: R = 1).
template <typename T, int R, int BLOCK, bool MASKED, bool CAUSAL>
__global__ void __launch_bounds__(BLOCK)
softmax_fwd_lean(const T* __restrict__ x, T* __restrict__ y, MaskLayout m, int64_t rows, int S, float c) {
  const int lane = threadIdx.x % 32;
  const int64_t lin0 = (int64_t(blockIdx.x) * (BLOCK / 32) + threadIdx.x / 32) * R;
  LeanRows<R, MASKED> b;
  lean_load<T, R, MASKED>(b, x, m, lin0, rows, S, lane);
  lean_finish<T, R, MASKED, CAUSAL>(b, y, S, c, lane);
}

// ---- generic kernels: any length, any alignment, scalar loads, re-reads ---------------

template <typename T, int TPR, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_fwd_generic(const T* __restrict__ x, T* __restrict__ y, MaskLayout m, int64_t rows, int S,
                    float scale, bool causal) {
  constexpr int RPB = BLOCK / TPR;
  __shared__ float red[2][BLOCK / 32];
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int64_t lin = int64_t(blockIdx.x) * RPB + g;
  const bool valid = lin < rows;
  int64_t row, q;
  const uint8_t* mrow;
  m.locate(valid ? lin : 0, row, q, mrow);
  const T* xr = x + row * S;
  auto value = [&](int c) {
    const bool masked = (mrow && mrow[c * m.key_stride]) || (causal && c > q);
    return masked ? -INFINITY : static_cast<float>(xr[c]) * scale;
  };
  float mx[1] = {-INFINITY};
  if (valid)
    for (int c = lane; c < S; c += TPR) mx[0] = fmaxf(mx[0], value(c));
  group_allreduce<TPR, 1>(mx, red[0], MaxOp());
  const float mref = mx[0] == -INFINITY ? 0.f : mx[0];
  float sum[1] = {0.f};
  if (valid)
    for (int c = lane; c < S; c += TPR) sum[0] += exp2f((value(c) - mref) * kLog2e);
  group_allreduce<TPR, 1>(sum, red[1], SumOp());
  if (!valid) return;
  const float inv = sum[0] > 0.f ? 1.f / sum[0] : 0.f;
  for (int c = lane; c < S; c += TPR) y[row * S + c] = static_cast<T>(exp2f((value(c) - mref) * kLog2e) * inv);
}

template <typename T, int TPR, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_bwd_generic(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, int64_t rows,
                    int S, float scale) {
  constexpr int RPB = BLOCK / TPR;
  __shared__ float red[BLOCK / 32];
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * RPB + g;
  const bool valid = row < rows;
  float dot[1] = {0.f};
  if (valid)
    for (int c = lane; c < S; c += TPR)
      dot[0] += static_cast<float>(y[row * S + c]) * static_cast<float>(dy[row * S + c]);
  group_allreduce<TPR, 1>(dot, red, SumOp());
  if (!valid) return;
  for (int c = lane; c < S; c += TPR) {
    const float a = static_cast<float>(y[row * S + c]);
    dx[row * S + c] = static_cast<T>(scale * a * (static_cast<float>(dy[row * S + c]) - dot[0]));
  }
}

// ============================== host side ==============================================

constexpr const char* kFwd = "mptrain scaled_masked_softmax forward";
constexpr const char* kBwd = "mptrain scaled_masked_softmax backward";

// Describes `m` (already expanded to x's shape) as MaskLayout; false when its strides do
// not fit (more than two non-mergeable leading dims, or a key stride other than 0/1).
bool describe_mask(const at::Tensor& m, MaskLayout& ml) {
  const int nd = m.dim();
  const auto sz = m.sizes();
  const auto st = m.strides();
  ml.key_stride = sz[nd - 1] == 1 ? 0 : st[nd - 1];
  if (ml.key_stride != 0 && ml.key_stride != 1) return false;
  ml.sq_stride = (nd >= 2 && sz[nd - 2] != 1) ? st[nd - 2] : 0;
  // Merge the leading dims (all but the last two) into at most two (d0, d1).
  std::vector<std::pair<int64_t, int64_t>> lead;  // (size, stride), size > 1
  for (int d = 0; d < nd - 2; ++d) {
    if (sz[d] == 1) continue;
    if (!lead.empty() && lead.back().second == st[d] * sz[d]) {
      lead.back() = {lead.back().first * sz[d], st[d]};
    } else {
      lead.push_back({sz[d], st[d]});
    }
  }
  if (lead.size() > 2) return false;
  while (lead.size() < 2) lead.insert(lead.begin(), {1, 0});
  ml.s0 = lead[0].second;
  ml.d1 = lead[1].first;
  ml.s1 = lead[1].second;
  ml.ptr = reinterpret_cast<const uint8_t*>(m.data_ptr());
  return true;
}

// The forward's launch layout, by row length in 16-byte vectors (aligned rows; the H200
// measurements behind each choice are in docs/kernels/softmax.md):
//  * Lean: 16-bit rows of 33..64 vectors with a vector-loadable mask or none and
//    0 < scale < inf (softmax_fwd_lean: 99.5% masked / 100.6% causal of the floor at
//    512x512x512 bf16 fwd+bwd, against 92.1% / 90.4% for the next best);
//  * Pair: other masked rows of 33..64 vectors (softmax_fwd_multirow, two rows per warp);
//  * Persist: masked rows of 129..256 vectors (softmax_fwd_persist, one warp per row, 8
//    vectors per lane);
//  * Rows: everything else that is aligned and fits the register cache (row_reduce.cuh's
//    table, softmax_fwd_kernel).  The backward always takes the table (softmax_bwd_kernel):
//    persistent and multi-row backwards were no faster.
enum class FwdLayout { Lean, Pair, Persist, Rows, Generic };

FwdLayout pick_fwd_layout(bool aligned, int vec, int64_t nvec, const MaskLayout& ml, float scale) {
  if (!aligned || pick_row_shape(nvec) == RowShape::Generic) return FwdLayout::Generic;
  const bool row512 = nvec > 32 && nvec <= 64;
  if (vec == 8 && row512 && (ml.mode == 0 || ml.mode == 1) && scale > 0.f && scale < INFINITY)
    return FwdLayout::Lean;
  const bool masked = ml.ptr != nullptr;
  if (masked && row512) return FwdLayout::Pair;
  if (masked && nvec > 128 && nvec <= 256) return FwdLayout::Persist;
  return FwdLayout::Rows;
}

// Launches the lean forward with the mask and causal flags as template arguments.
template <typename T>
void launch_lean(const T* xp, T* yp, const MaskLayout& ml, int64_t rows, int S, float scale, bool causal,
                 cudaStream_t stream) {
  constexpr int BLOCK = 128;
  const float c = scale * kLog2e;
  auto go = [&](auto masked, auto is_causal) {
    constexpr bool M = decltype(masked)::value, C = decltype(is_causal)::value;
    constexpr int RPB = BLOCK / 32;
    softmax_fwd_lean<T, 1, BLOCK, M, C><<<(rows + RPB - 1) / RPB, BLOCK, 0, stream>>>(xp, yp, ml, rows, S, c);
    MPT_CHECK_LAUNCH(kFwd);
  };
  using Y = std::true_type;
  using N = std::false_type;
  const bool masked = ml.mode == 1;
  if (masked && causal) go(Y{}, Y{});
  else if (masked) go(Y{}, N{});
  else if (causal) go(N{}, Y{});
  else go(N{}, N{});
}

// Sets the mask's access mode and walk order for this launch.
void prepare_mask(MaskLayout& ml, int vec, int64_t rows) {
  if (ml.ptr) {
    if (ml.key_stride == 0) {
      ml.mode = 2;
    } else {
      const bool vec_ok = reinterpret_cast<uintptr_t>(ml.ptr) % vec == 0 && ml.s0 % vec == 0 &&
                          ml.s1 % vec == 0 && ml.sq_stride % vec == 0;
      ml.mode = vec_ok ? 1 : 3;
    }
    ml.heads_inner = ml.s1 == 0 && ml.d1 > 1;
  }
  ml.idx32 = rows <= int64_t(UINT32_MAX);
}

template <typename T>
void launch_fwd(const at::Tensor& x, at::Tensor& y, MaskLayout ml, int64_t rows, int S, float scale, bool causal) {
  constexpr int VEC = Vec16<T>::n;
  auto stream = at::cuda::getCurrentCUDAStream();
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  prepare_mask(ml, VEC, rows);
  const bool aligned = S % VEC == 0 && aligned16(xp) && aligned16(yp);
  switch (pick_fwd_layout(aligned, VEC, S / VEC, ml, scale)) {
    case FwdLayout::Lean:
      if constexpr (VEC == 8) launch_lean<T>(xp, yp, ml, rows, S, scale, causal, stream);
      break;
    case FwdLayout::Pair: {
      constexpr int BLOCK = 128, R = 2, ROWS_PER_BLOCK = BLOCK / 32 * R;
      softmax_fwd_multirow<T, 2, R, BLOCK><<<(rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK, BLOCK, 0, stream>>>(
          xp, yp, ml, rows, S, scale, causal);
      MPT_CHECK_LAUNCH(kFwd);
      break;
    }
    case FwdLayout::Persist: {
      constexpr int BLOCK = 128, RPB = BLOCK / 32;
      auto kernel = softmax_fwd_persist<T, 32, 8, BLOCK>;
      static const int64_t cap = resident_blocks(kernel, BLOCK);
      kernel<<<balanced_grid((rows + RPB - 1) / RPB, cap), BLOCK, 0, stream>>>(xp, yp, ml, rows, S, scale, causal);
      MPT_CHECK_LAUNCH(kFwd);
      break;
    }
    case FwdLayout::Rows:
      MPT_ROW_SHAPE_SWITCH(pick_row_shape(S / VEC), {
        constexpr int BLOCK = TPR < 128 ? 128 : TPR;
        constexpr int RPB = BLOCK / TPR;
        softmax_fwd_kernel<T, TPR, NV, BLOCK><<<(rows + RPB - 1) / RPB, BLOCK, 0, stream>>>(xp, yp, ml, rows, S,
                                                                                            scale, causal);
        MPT_CHECK_LAUNCH(kFwd);
      });
      break;
    default:
      if (S <= 1024)
        softmax_fwd_generic<T, 32, 128><<<(rows + 3) / 4, 128, 0, stream>>>(xp, yp, ml, rows, S, scale, causal);
      else
        softmax_fwd_generic<T, 512, 512><<<rows, 512, 0, stream>>>(xp, yp, ml, rows, S, scale, causal);
      MPT_CHECK_LAUNCH(kFwd);
  }
}

template <typename T>
void launch_bwd(const at::Tensor& dy, const at::Tensor& y, at::Tensor& dx, int64_t rows, int S, float scale) {
  constexpr int VEC = Vec16<T>::n;
  auto stream = at::cuda::getCurrentCUDAStream();
  const T* dyp = reinterpret_cast<const T*>(dy.data_ptr());
  const T* yp = reinterpret_cast<const T*>(y.data_ptr());
  T* dxp = reinterpret_cast<T*>(dx.data_ptr());
  const bool aligned = S % VEC == 0 && aligned16(dyp) && aligned16(yp) && aligned16(dxp);
  const RowShape shape = aligned ? pick_row_shape(S / VEC) : RowShape::Generic;
  if (shape != RowShape::Generic) {
    MPT_ROW_SHAPE_SWITCH(shape, {
      constexpr int BLOCK = TPR < 128 ? 128 : TPR;
      constexpr int RPB = BLOCK / TPR;
      softmax_bwd_kernel<T, TPR, NV, BLOCK><<<(rows + RPB - 1) / RPB, BLOCK, 0, stream>>>(dyp, yp, dxp, rows, S, scale);
      MPT_CHECK_LAUNCH(kBwd);
    });
  } else if (S <= 1024) {
    softmax_bwd_generic<T, 32, 128><<<(rows + 3) / 4, 128, 0, stream>>>(dyp, yp, dxp, rows, S, scale);
    MPT_CHECK_LAUNCH(kBwd);
  } else {
    softmax_bwd_generic<T, 512, 512><<<rows, 512, 0, stream>>>(dyp, yp, dxp, rows, S, scale);
    MPT_CHECK_LAUNCH(kBwd);
  }
}

void check_x(const char* name, const at::Tensor& x) {
  MPT_CHECK_CUDA(x, name);
  MPT_CHECK_CONTIGUOUS(x, name);
  MPT_CHECK(x.dim() >= 1, name, ": input must have at least one dimension");
  MPT_CHECK(x.size(-1) <= (int64_t(1) << 30), name, ": last dimension ", x.size(-1), " is too long (max 2^30)");
}

}  // namespace

// y = softmax(where(mask | causal, -inf, scale * x), dim=-1), fully masked rows -> 0.
// mask: bool, broadcastable to x (True = masked out).  causal masks key k > query q
// (top-left aligned, like torch's scaled_dot_product_attention(is_causal=True)), with q
// the index in x's second-to-last dimension.
at::Tensor scaled_masked_softmax_forward(const at::Tensor& x, const std::optional<at::Tensor>& mask,
                                         double scale, bool causal) {
  check_x(kFwd, x);
  MPT_CHECK(!causal || x.dim() >= 2, kFwd, ": causal=True needs an input with at least 2 dims (..., queries, keys), got ",
              x.sizes());
  const at::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  if (x.numel() == 0) return y;
  const int64_t S = x.size(-1), rows = x.numel() / S;
  MaskLayout ml;
  ml.sq = x.dim() >= 2 ? x.size(-2) : 1;
  at::Tensor m;  // keeps a materialized mask alive during the launch
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    MPT_CHECK(m.scalar_type() == at::kBool, kFwd, ": mask must be a bool tensor (True = masked out), got ",
                m.scalar_type());
    MPT_CHECK(m.device() == x.device(), kFwd, ": mask on ", m.device(), " but input on ", x.device());
    MPT_CHECK(m.dim() <= x.dim() && at::infer_size(m.sizes(), x.sizes()) == x.sizes(), kFwd, ": mask of shape ",
                m.sizes(), " does not broadcast to the input's shape ", x.sizes());
    m = m.expand(x.sizes());
    if (!describe_mask(m, ml)) {
      m = m.contiguous();
      MPT_CHECK(describe_mask(m, ml), kFwd, ": internal error: contiguous mask not describable");
    }
  }
  MPT_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), kFwd, scalar_t,
    launch_fwd<scalar_t>(x, y, ml, rows, static_cast<int>(S), static_cast<float>(scale), causal));
  return y;
}

// dx = scale * y * (dy - sum(dy * y, dim=-1)) from the forward output y.
at::Tensor scaled_masked_softmax_backward(const at::Tensor& dy, const at::Tensor& y, double scale) {
  check_x(kBwd, y);
  MPT_CHECK_CUDA(dy, kBwd);
  MPT_CHECK_CONTIGUOUS(dy, kBwd);
  MPT_CHECK(dy.sizes() == y.sizes() && dy.scalar_type() == y.scalar_type(), kBwd,
              ": grad_output must match the output's shape and dtype, got ", dy.sizes(), " ", dy.scalar_type(),
              " vs ", y.sizes(), " ", y.scalar_type());
  const at::cuda::CUDAGuard guard(y.device());
  at::Tensor dx = at::empty_like(y);
  if (y.numel() == 0) return dx;
  const int64_t S = y.size(-1), rows = y.numel() / S;
  MPT_DISPATCH_FLOAT_HALF_BF16(y.scalar_type(), kBwd, scalar_t,
    launch_bwd<scalar_t>(dy, y, dx, rows, static_cast<int>(S), static_cast<float>(scale)));
  return dx;
}
