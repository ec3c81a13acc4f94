// LayerNorm and RMSNorm, forward and backward, over the last `H` elements of a row.
//
// What is fused and why:
//  * forward (ln_fwd_kernel): one read of x, one write of y.  The row stays in registers
//    between the mean, variance and output passes (two-pass variance in fp32: exact, no
//    Welford), and mean / rstd (fp32) are saved for backward.  torch's kernel is far from
//    the bandwidth floor on these shapes (18-36% at 16384x1024..4096 bf16).  Rows of one
//    warp (<= 128 vectors) take two rows per warp, so a warp keeps twice the bytes in flight.
//  * backward: one read of x and dy, one write of dx.  The same kernel accumulates the
//    dgamma / dbeta partial sums: each thread always owns the same columns, so it sums
//    dy*xhat and dy over every row it visits in fp32 registers; a persistent grid keeps
//    the [blocks, H] partial buffer small, and the partials are reduced in a fixed order
//    (deterministic, no float atomics).
//  * backward of rows <= 128 vectors (<= 1024 bf16), ln_bwd_split_kernel: one 16-byte
//    vector per thread and ceil(nvec/32) warps per row, so the per-thread accumulators are
//    small and the registers go to 4 rows of x and dy loaded ahead.  Its last blocks sum
//    the partials themselves (fold_finish), so the backward is one kernel.
//  * longer rows (ln_bwd_kernel): a row group of up to 512 threads with 2-4 vectors each,
//    the next row's x / dy loaded before the current row is reduced where registers allow;
//    a small second kernel (ln_param_finish) reduces the partials.
//  * on sm_90+ the forward, backward and finish kernels are launched with programmatic
//    dependent launch (launch.cuh), so each one's launch and block start-up overlap the
//    previous kernel's tail.
//  * storage fp32 / fp16 / bf16; gamma / beta either the input's dtype or fp32 (the
//    `*-master` precisions keep normalization weights in fp32 under half activations).
//  * rows that are misaligned (storage offset), not a multiple of the 16-byte vector or
//    longer than the register cache take the generic kernels: scalar loads and re-reads
//    (served by L1/L2), and a separate column reduction for dgamma / dbeta.
// Measured figures and the variants that lost: docs/kernels/norm.md.
#include "launch.cuh"
#include "new_tensor.h"
#include "row_reduce.cuh"
#include "type_shim.h"

#include <tuple>
#include <utility>
#include <vector>

namespace {

using namespace mpt;

// The forward zeroes the backward's finish counter (see fold_finish): the counter is a word
// of the statistics buffer this forward returns, so every forward hands its backward a
// private, zeroed counter without a memset launch (which would sit between the forward and
// the backward and break their programmatic launch edge).
__device__ __forceinline__ void zero_fold_counter(unsigned* work) {
  if (work != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *work = 0u;
}

// Named barrier `id` (1..15) over `nthreads` threads (a multiple of 32).
__device__ __forceinline__ void group_barrier(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

// ============================== forward ================================================

// R rows per row group (R = 2 where a row is one warp's, i.e. <= 128 vectors; 1 for wider
// row groups): all R rows' vectors are loaded before the first reduction, so a warp keeps
// R times the bytes in flight and the R rows' shuffle reductions interleave.  Why: with
// one row per warp the kernel is latency-bound (one row's loads per warp, then reductions
// and stores with nothing in flight; ncu at 16384x1024 bf16: DRAM reads at ~1.6 TB/s).
// R = 4 needs ~113 registers, which halves the resident warps, and was slower.
template <typename T, typename W, int TPR, int NV, int BLOCK, int R>
__global__ void __launch_bounds__(BLOCK)
ln_fwd_kernel(const T* __restrict__ x, const W* __restrict__ gamma, const W* __restrict__ beta,
              T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
              unsigned* __restrict__ work, int64_t rows, int H, float eps, bool rms) {
  constexpr int VEC = Vec16<T>::n, GPB = BLOCK / TPR;
  __shared__ float red[2][BLOCK / 32 * R];
  pdl_launch_dependents();
  pdl_wait();  // before any load: the previous kernel may be the one writing x
  zero_fold_counter(work);
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int64_t row0 = (int64_t(blockIdx.x) * GPB + g) * R;
  const int nvec = H / VEC;

  uint4 raw[R][NV];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const bool valid = row0 + r < rows;
    const T* xr = x + (row0 + r) * H;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int j = i * TPR + lane;
      raw[r][i] = (valid && j < nvec) ? load16(xr + j * VEC) : make_uint4(0, 0, 0, 0);
    }
  }
  // Padding slots hold zeros: they add nothing to the sum, and are skipped for the
  // variance (where x - mean would not be zero).
  float mu[R];
#pragma unroll
  for (int r = 0; r < R; ++r) mu[r] = 0.f;
  if (!rms) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        float f[VEC];
        unpack<T>(raw[r][i], f);
#pragma unroll
        for (int k = 0; k < VEC; ++k) mu[r] += f[k];
      }
    }
    group_allreduce<TPR, R>(mu, red[0], SumOp());
#pragma unroll
    for (int r = 0; r < R; ++r) mu[r] /= H;
  }
  float q[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    q[r] = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (i * TPR + lane < nvec) {
        float f[VEC];
        unpack<T>(raw[r][i], f);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float d = f[k] - mu[r];
          q[r] += d * d;
        }
      }
    }
  }
  group_allreduce<TPR, R>(q, red[1], SumOp());
  float rs[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    rs[r] = rsqrtf(q[r] / H + eps);
    if (lane == 0 && row0 + r < rows) {
      if (mean_out) mean_out[row0 + r] = mu[r];
      rstd_out[row0 + r] = rs[r];
    }
  }
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = i * TPR + lane;
    if (j >= nvec) continue;
    float gw[VEC], bw[VEC];
    if (gamma) load_floats<W, VEC>(gamma + j * VEC, gw);
    if (beta) load_floats<W, VEC>(beta + j * VEC, bw);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r >= rows) continue;
      float f[VEC];
      unpack<T>(raw[r][i], f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        float o = (f[k] - mu[r]) * rs[r];
        if (gamma) o *= gw[k];
        if (beta) o += bw[k];
        f[k] = o;
      }
      store16(y + (row0 + r) * H + j * VEC, pack<T>(f));
    }
  }
}

// Any H, any alignment: scalar loads, three passes over the row (the re-reads hit L1/L2).
template <typename T, typename W, int TPR, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
ln_fwd_generic(const T* __restrict__ x, const W* __restrict__ gamma, const W* __restrict__ beta,
               T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
               unsigned* __restrict__ work, int64_t rows, int H, float eps, bool rms) {
  constexpr int RPB = BLOCK / TPR;
  __shared__ float red[2][BLOCK / 32];
  zero_fold_counter(work);
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * RPB + g;
  const bool valid = row < rows;
  const T* xr = x + row * H;
  float mu = 0.f;
  if (!rms) {
    float s[1] = {0.f};
    if (valid)
      for (int c = lane; c < H; c += TPR) s[0] += static_cast<float>(xr[c]);
    group_allreduce<TPR, 1>(s, red[0], SumOp());
    mu = s[0] / H;
  }
  float q[1] = {0.f};
  if (valid)
    for (int c = lane; c < H; c += TPR) {
      const float d = static_cast<float>(xr[c]) - mu;
      q[0] += d * d;
    }
  group_allreduce<TPR, 1>(q, red[1], SumOp());
  const float rs = rsqrtf(q[0] / H + eps);
  if (!valid) return;
  if (lane == 0) {
    if (mean_out) mean_out[row] = mu;
    rstd_out[row] = rs;
  }
  T* yr = y + row * H;
  for (int c = lane; c < H; c += TPR) {
    float o = (static_cast<float>(xr[c]) - mu) * rs;
    if (gamma) o *= static_cast<float>(gamma[c]);
    if (beta) o += static_cast<float>(beta[c]);
    yr[c] = static_cast<T>(o);
  }
}

// ============================== backward ===============================================
//   xhat = (x - mean) * rstd          (RMSNorm: mean = 0)
//   g    = dy * gamma
//   dx   = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm: no mean(g) term)
//   dgamma = sum_rows dy * xhat,  dbeta = sum_rows dy
//
// kExactGd: g = dy * gamma is rounded to fp32 (__fmul_rn) in both passes.  Left to the
// compiler, the second pass's `g - mean(g)` may become fma(dy, gamma, -mean(g)), which
// keeps the product's rounding error that mean(g) has: at H = 1 (dx exactly 0) that left
// |dx| ~ rstd * ulp(g) ~ 1e-4 instead of 0.

// x, dy and the saved statistics of one row (zeros past the end).  Issued together so
// the next row's loads, statistics included, are in flight while this row is reduced.
template <typename T, int NV, int TPR>
__device__ __forceinline__ void load_rows(uint4 (&a)[NV], uint4 (&b)[NV], float& mu, float& rs, const T* pa,
                                          const T* pb, const float* mean, const float* rstd, int64_t row,
                                          int64_t rows, int H, int lane) {
  constexpr int VEC = Vec16<T>::n;
  const int nvec = H / VEC;
  const bool valid = row < rows;
  mu = (valid && mean) ? mean[row] : 0.f;  // mean is nullptr for RMSNorm
  rs = valid ? rstd[row] : 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = i * TPR + lane;
    const bool ok = valid && j < nvec;
    a[i] = ok ? load16(pa + row * H + j * VEC) : make_uint4(0, 0, 0, 0);
    b[i] = ok ? load16(pb + row * H + j * VEC) : make_uint4(0, 0, 0, 0);
  }
}

// Writes this block's row of the [grid, H] dgamma / dbeta partials: the RPB = BLOCK/TPR
// row groups (which own the same columns) are combined in shared memory one group after
// the other, so the order is fixed (deterministic).  `acc`: 2*TPR*NV*VEC floats of shared
// memory, unused (may be null) when RPB == 1.  Every thread of the block must call it.
template <int TPR, int NV, int VEC, int BLOCK>
__device__ __forceinline__ void store_block_partial(const float (&dg)[NV][VEC], const float (&db)[NV][VEC],
                                                    float* dg_part, float* db_part, int H, float* acc) {
  constexpr int RPB = BLOCK / TPR, MAXH = TPR * NV * VEC;
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR, nvec = H / VEC;
  float* dgo = dg_part ? dg_part + int64_t(blockIdx.x) * H : nullptr;
  float* dbo = db_part ? db_part + int64_t(blockIdx.x) * H : nullptr;
  if constexpr (RPB == 1) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int j = i * TPR + lane;
      if (j < nvec) {
#pragma unroll
        for (int k = 0; k < VEC; k += 4) {
          if (dgo) *reinterpret_cast<float4*>(dgo + j * VEC + k) = make_float4(dg[i][k], dg[i][k + 1], dg[i][k + 2], dg[i][k + 3]);
          if (dbo) *reinterpret_cast<float4*>(dbo + j * VEC + k) = make_float4(db[i][k], db[i][k + 1], db[i][k + 2], db[i][k + 3]);
        }
      }
    }
  } else {
    for (int gg = 0; gg < RPB; ++gg) {
      if (g == gg) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int j = i * TPR + lane;
          if (j < nvec) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              const int c = j * VEC + k;
              acc[c] = (gg == 0 ? 0.f : acc[c]) + dg[i][k];
              acc[MAXH + c] = (gg == 0 ? 0.f : acc[MAXH + c]) + db[i][k];
            }
          }
        }
      }
      __syncthreads();
    }
    for (int c = threadIdx.x; c < H; c += BLOCK) {
      if (dgo) dgo[c] = acc[c];
      if (dbo) dbo[c] = acc[MAXH + c];
    }
  }
}

// Sums partial rows [0, P) of columns [tile * COLS, tile * COLS + COLS) and writes
// dgamma / dbeta there.  Block: COLS columns x LANES = BLOCK / COLS partial lanes; `s` is
// [2][LANES][COLS + 1] floats of shared memory.  The lanes' sums meet in a fixed-order tree
// (deterministic).  COLS = 8 below 2048 columns: H / 8 blocks, so a 1024-wide row fills
// 128 SMs instead of 32, and each thread has only P / 64 partials to load (one L2 round
// trip at P = 256); 32-column tiles already make 64+ blocks from 2048 columns on.
// BAR: 0 syncs the whole block (__syncthreads); 1..15, a named barrier over the first
// BLOCK threads only (fold_finish in a block wider than BLOCK).  The partials are read
// through L2 (__ldcg): in fold_finish other blocks of the same grid wrote them.
template <typename W, int BLOCK, int COLS, int BAR = 0>
__device__ __forceinline__ void param_finish_tile(const float* dg_part, const float* db_part, int P, int H, int tile,
                                                  W* dgamma, W* dbeta, float* s) {
  constexpr int LANES = BLOCK / COLS, SP = COLS + 1;
  auto sync = [] {
    if constexpr (BAR == 0) __syncthreads();
    else group_barrier(BAR, BLOCK);
  };
  static_assert(BLOCK % COLS == 0 && (LANES & (LANES - 1)) == 0, "finish: LANES must be a power of two");
  const int tx = threadIdx.x % COLS, ty = threadIdx.x / COLS;
  const int c = tile * COLS + tx;
  // The partials were just written (L2-resident): issue U loads before summing them, so
  // a thread waits about one L2 latency per U partials instead of one per partial.  The
  // summation order stays fixed (deterministic).
  constexpr int U = 8;
  float a = 0.f, b = 0.f;
  if (c < H)
    for (int p0 = ty; p0 < P; p0 += LANES * U) {
      float va[U], vb[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + LANES * u;
        va[u] = (dg_part && p < P) ? __ldcg(dg_part + int64_t(p) * H + c) : 0.f;
        vb[u] = (db_part && p < P) ? __ldcg(db_part + int64_t(p) * H + c) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        a += va[u];
        b += vb[u];
      }
    }
  s[ty * SP + tx] = a;
  s[(LANES + ty) * SP + tx] = b;
  sync();
#pragma unroll
  for (int h = LANES / 2; h > 0; h >>= 1) {
    if (ty < h) {
      s[ty * SP + tx] += s[(ty + h) * SP + tx];
      s[(LANES + ty) * SP + tx] += s[(LANES + ty + h) * SP + tx];
    }
    sync();
  }
  if (ty == 0 && c < H) {
    if (dgamma) dgamma[c] = static_cast<W>(s[tx]);
    if (dbeta) dbeta[c] = static_cast<W>(s[LANES * SP + tx]);
  }
  sync();  // `s` is reused by the next tile
}

// ---- dgamma / dbeta finished inside the split backward (fold_finish) ----------------
// Why: a separate finish kernel costs ~5 us at 16384x1024 (mostly launch, ramp and tail)
// against a ~40 us floor for the whole forward + backward.  Here the last F blocks to
// finish their rows sum the partials themselves, one 8-column tile each
// (F = min(grid, tiles)), while the rest of the grid exits.
// Protocol, on one counter word `work` (zeroed by the forward, see zero_fold_counter):
//  * every block makes its partial row visible (__threadfence) and takes a ticket with
//    atomicInc(work, P + F - 1) -- the first P tickets are 0 .. P - 1;
//  * tickets P - F .. P - 1 become finishers: they wait until all P blocks have arrived
//    (counter >= P), then sum their tiles in the same fixed order as ln_param_finish
//    (deterministic; the tree is NT = 256 lanes wide here, so the rounding differs from
//    the 512-thread finish kernel's);
//  * each finisher then bumps the counter once more; atomicInc wraps the last bump
//    (old == P + F - 1) to 0, so the counter is zero again for a second backward over the
//    same saved statistics (retain_graph) without any reset launch.
// Waiting inside a grid is safe here: the split grid never exceeds one resident wave
// (balanced_grid caps it at the occupancy bound), every block calls
// pdl_launch_dependents() first, so no dependent kernel can take an SM slot before all of
// this grid's blocks are resident, and only the last F arrivals wait.  Two backwards may
// not run concurrently over one forward's statistics (different streams): they would
// share the counter.  Autograd never does that; the functional op documents it.
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <typename W, int BLOCK>
__device__ __forceinline__ void fold_finish(const float* dg_part, const float* db_part, int H, unsigned* work,
                                            W* dgamma, W* dbeta) {
  constexpr int NT = 256, COLS = 8;  // finisher threads per block, columns per tile
  static_assert(BLOCK >= NT, "fold_finish: the block must have at least 256 threads");
  __shared__ unsigned ticket;
  __shared__ float s[2 * (NT / COLS) * (COLS + 1)];
  const unsigned P = gridDim.x, tiles = (H + COLS - 1) / COLS;
  const unsigned F = P < tiles ? P : tiles;
  __threadfence();  // this thread's partial stores, before the block's arrival is counted
  __syncthreads();
  if (threadIdx.x == 0) ticket = atomicInc(work, P + F - 1);
  __syncthreads();
  const unsigned t = ticket;
  if (t < P - F) return;
  if (threadIdx.x == 0)
    while (ld_acquire_gpu(work) < P) __nanosleep(32);
  __syncthreads();
  if (threadIdx.x >= NT) return;
  for (unsigned tile = t - (P - F); tile < tiles; tile += F)
    param_finish_tile<W, NT, COLS, (BLOCK == NT ? 0 : 1)>(dg_part, db_part, static_cast<int>(P), H,
                                                           static_cast<int>(tile), dgamma, dbeta, s);
  if (threadIdx.x == 0) atomicInc(work, P + F - 1);
}

// The backward of rows of 129..2048 vectors: a row group of TPR threads with NV vectors
// each; PREFETCH loads the next row's x / dy and statistics before the current row is
// reduced.  Writes this block's [H] dgamma / dbeta partial row; ln_param_finish sums them.
template <typename T, typename W, int TPR, int NV, int BLOCK, int MINB, bool PREFETCH>
__global__ void __launch_bounds__(BLOCK, MINB)
ln_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
              const float* __restrict__ rstd, const W* __restrict__ gamma, T* __restrict__ dx,
              float* dg_part, float* db_part, int64_t rows, int H, bool rms) {
  constexpr int VEC = Vec16<T>::n, RPB = BLOCK / TPR;
  __shared__ float red[2][BLOCK / 32 * 2];
  pdl_launch_dependents();
  pdl_wait();
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int nvec = H / VEC;
  const float inv_h = 1.f / H;

  float dg[NV][VEC], db[NV][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dg[i][k] = db[i][k] = 0.f;

  // Same trip count for every thread of the block (the reductions have barriers);
  // rows past the end load zeros, which contribute nothing to dgamma / dbeta.
  const int64_t stride = int64_t(gridDim.x) * RPB;
  const int64_t iters = (rows + stride - 1) / stride;
  int64_t row = int64_t(blockIdx.x) * RPB + g;
  uint4 cx[NV], cdy[NV];
  float mu, rs;
  load_rows<T, NV, TPR>(cx, cdy, mu, rs, x, dy, mean, rstd, row, rows, H, lane);

  for (int64_t it = 0; it < iters; ++it, row += stride) {
    uint4 nx[NV], ndy[NV];
    float nmu, nrs;
    if constexpr (PREFETCH) load_rows<T, NV, TPR>(nx, ndy, nmu, nrs, x, dy, mean, rstd, row + stride, rows, H, lane);
    const bool valid = row < rows;

    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int j = i * TPR + lane;
      if (j < nvec) {
        float xf[VEC], df[VEC], gw[VEC];
        unpack<T>(cx[i], xf);
        unpack<T>(cdy[i], df);
        if (gamma) load_floats<W, VEC>(gamma + j * VEC, gw);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xh = (xf[k] - mu) * rs;
          const float gd = gamma ? __fmul_rn(df[k], gw[k]) : df[k];  // no FMA contraction: see kExactGd
          s[0] += gd;
          s[1] += gd * xh;
          dg[i][k] += df[k] * xh;
          db[i][k] += df[k];
        }
      }
    }
    group_allreduce<TPR, 2>(s, red[it & 1], SumOp());
    const float c1 = rms ? 0.f : s[0] * inv_h, c2 = s[1] * inv_h;
    if (valid) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int j = i * TPR + lane;
        if (j < nvec) {
          float xf[VEC], df[VEC], gw[VEC];
          unpack<T>(cx[i], xf);
          unpack<T>(cdy[i], df);
          if (gamma) load_floats<W, VEC>(gamma + j * VEC, gw);
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float xh = (xf[k] - mu) * rs;
            const float gd = gamma ? __fmul_rn(df[k], gw[k]) : df[k];  // no FMA contraction: see kExactGd
            xf[k] = rs * (gd - c1 - xh * c2);
          }
          store16(dx + row * H + j * VEC, pack<T>(xf));
        }
      }
    }
    if constexpr (PREFETCH) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        cx[i] = nx[i];
        cdy[i] = ndy[i];
      }
      mu = nmu;
      rs = nrs;
    } else {
      load_rows<T, NV, TPR>(cx, cdy, mu, rs, x, dy, mean, rstd, row + stride, rows, H, lane);
    }
  }
  if (dg_part == nullptr && db_part == nullptr) return;
  if constexpr (RPB == 1) {
    store_block_partial<TPR, NV, VEC, BLOCK>(dg, db, dg_part, db_part, H, nullptr);
  } else {
    __shared__ float acc[2 * TPR * NV * VEC];
    store_block_partial<TPR, NV, VEC, BLOCK>(dg, db, dg_part, db_part, H, acc);
  }
}

// ---- split rows: the backward of rows <= 128 vectors ---------------------------------
// One 16-byte vector of x and of dy per thread per row (NV = 1): a row of <= 128 vectors
// (1024 bf16) is spread over TPR = 32 * ceil(nvec / 32) threads (768 bf16: 3 warps, 1024:
// 4), so the per-thread cost of the dgamma / dbeta accumulators and gamma is small, and
// the registers left go to DEPTH = 4 rows of x / dy loaded ahead.  Why: ln_bwd_kernel
// holds 1-2 rows per row group at ~120 registers (~32 KB in flight per SM, and not
// continuously), under what HBM needs (Little's law: ~4.25 TB/s x ~0.9 us / 132 SMs
// ~ 29 KB of reads in flight *at all times*).  In flight per SM at DEPTH 4: 16-18 warps
// x 4 rows x 32 B per lane (~60 KB).
// The row slots rotate by unrolling the row loop DEPTH + 1 times (slot indices are
// compile-time), since copying a prefetched register would wait for its load.
// A row group's warps meet at a named barrier (id 1 + group, TPR threads), not at
// __syncthreads, so the groups of a block drift independently.
struct SplitRow {  // one row's x / dy vector and statistics, as loaded
  uint4 x, dy;
  float mu, rs;
};

template <typename T, typename W, int TPR, int BLOCK, int DEPTH>
struct SplitBwd {
  static constexpr int VEC = Vec16<T>::n, G = BLOCK / TPR, WPG = TPR / 32, SLOTS = DEPTH + 1;
  static_assert(BLOCK % TPR == 0 && TPR % 32 == 0, "split: BLOCK must be whole row groups of whole warps");
  static_assert(G <= 15, "split: at most 15 row groups per block (named barriers 1..15)");
  static_assert(SLOTS >= 2 && SLOTS <= 8, "split: DEPTH 1..7");

  const T* dy;
  const T* x;
  const float* mean;
  const float* rstd;
  const W* gamma;
  T* dx;
  int64_t rows, stride;
  int H, lane, g;
  bool rms, has_col;  // has_col: this thread's vector lies inside the row
  float inv_h;
  float gw[VEC];  // gamma (1 without weight: __fmul_rn(d, 1) == d)
  float dg[VEC], db[VEC];
  SplitRow buf[SLOTS];
  float (*red)[G][WPG][2];  // [2][G][WPG][2] shared, double-buffered by iteration parity

  // gamma as fp32 (1 without weight: __fmul_rn(d, 1) == d; 0 past the row, unused there).
  __device__ __forceinline__ void load_gamma() {
    if (gamma && has_col) {
      load_floats<W, VEC>(gamma + lane * VEC, gw);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) gw[i] = gamma ? 0.f : 1.f;
    }
  }

  __device__ __forceinline__ void load(SplitRow& s, int64_t row) const {
    const bool ok = row < rows;
    s.mu = (ok && mean) ? mean[row] : 0.f;  // mean is nullptr for RMSNorm
    s.rs = ok ? rstd[row] : 0.f;
    const bool v = ok && has_col;
    s.x = v ? load16(x + row * H + lane * VEC) : make_uint4(0, 0, 0, 0);
    s.dy = v ? load16(dy + row * H + lane * VEC) : make_uint4(0, 0, 0, 0);
  }

  // Row `row` sits in slot S; first refill the slot freed by the previous row with the
  // row DEPTH strides ahead.
  template <int S>
  __device__ __forceinline__ void step(int64_t row, int par) {
    load(buf[(S + DEPTH) % SLOTS], row + DEPTH * stride);
    const SplitRow& c = buf[S];
    float xf[VEC], df[VEC];
    unpack<T>(c.x, xf);
    unpack<T>(c.dy, df);
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float xh = (xf[k] - c.mu) * c.rs;
      const float gd = __fmul_rn(df[k], gw[k]);  // no FMA contraction: see kExactGd
      s0 += gd;
      s1 += gd * xh;
      dg[k] += df[k] * xh;
      db[k] += df[k];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s0 += __shfl_xor_sync(0xffffffffu, s0, o);
      s1 += __shfl_xor_sync(0xffffffffu, s1, o);
    }
    if constexpr (WPG > 1) {
      const int w = lane / 32;
      if (lane % 32 == 0) {
        red[par][g][w][0] = s0;
        red[par][g][w][1] = s1;
      }
      group_barrier(1 + g, TPR);
      s0 = red[par][g][0][0];
      s1 = red[par][g][0][1];
#pragma unroll
      for (int k = 1; k < WPG; ++k) {  // fixed order: every thread gets the same sums
        s0 += red[par][g][k][0];
        s1 += red[par][g][k][1];
      }
    }
    const float c1 = rms ? 0.f : s0 * inv_h, c2 = s1 * inv_h;
    if (has_col) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float xh = (xf[k] - c.mu) * c.rs;
        const float gd = __fmul_rn(df[k], gw[k]);
        xf[k] = c.rs * (gd - c1 - xh * c2);
      }
      store16(dx + row * H + lane * VEC, pack<T>(xf));
    }
  }
};

template <typename T, typename W, int TPR, int BLOCK, int MINB, int DEPTH>
__global__ void __launch_bounds__(BLOCK, MINB)
ln_bwd_split_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                    const float* __restrict__ rstd, const W* __restrict__ gamma, T* __restrict__ dx,
                    float* dg_part, float* db_part, int64_t rows, int H, bool rms, unsigned* work, W* dgamma,
                    W* dbeta) {
  using K = SplitBwd<T, W, TPR, BLOCK, DEPTH>;
  constexpr int VEC = K::VEC, G = K::G;
  __shared__ float red[2][G][K::WPG][2];
  pdl_launch_dependents();
  pdl_wait();
  K k;
  k.dy = dy;
  k.x = x;
  k.mean = mean;
  k.rstd = rstd;
  k.gamma = gamma;
  k.dx = dx;
  k.rows = rows;
  k.stride = int64_t(gridDim.x) * G;
  k.H = H;
  k.g = threadIdx.x / TPR;
  k.lane = threadIdx.x % TPR;
  k.rms = rms;
  k.has_col = k.lane < H / VEC;
  k.inv_h = 1.f / H;
  k.red = red;
  k.load_gamma();
#pragma unroll
  for (int i = 0; i < VEC; ++i) k.dg[i] = k.db[i] = 0.f;
  int64_t row = int64_t(blockIdx.x) * G + k.g;
#pragma unroll
  for (int s = 0; s < DEPTH; ++s) k.load(k.buf[s], row + s * k.stride);

  // Every thread of a group sees the same rows, so the group's barriers match up.
  // Unrolled SLOTS times: slot S holds the S-th row of each round.
  int par = 0;
  while (row < rows) {
#define MPT_SPLIT_STEP(S)                                   \
  if constexpr (S < K::SLOTS) {                             \
    if (row >= rows) break;                                 \
    k.template step<S>(row, par);                           \
    row += k.stride;                                        \
    par ^= 1;                                               \
  }
    MPT_SPLIT_STEP(0)
    MPT_SPLIT_STEP(1)
    MPT_SPLIT_STEP(2)
    MPT_SPLIT_STEP(3)
    MPT_SPLIT_STEP(4)
    MPT_SPLIT_STEP(5)
    MPT_SPLIT_STEP(6)
    MPT_SPLIT_STEP(7)
#undef MPT_SPLIT_STEP
  }
  if (dg_part == nullptr && db_part == nullptr) return;
  float dg[1][VEC], db[1][VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    dg[0][i] = k.dg[i];
    db[0][i] = k.db[i];
  }
  if constexpr (G == 1) {
    store_block_partial<TPR, 1, VEC, BLOCK>(dg, db, dg_part, db_part, H, nullptr);
  } else {
    __shared__ float acc[2 * TPR * VEC];
    store_block_partial<TPR, 1, VEC, BLOCK>(dg, db, dg_part, db_part, H, acc);
  }
  if (work != nullptr) fold_finish<W, BLOCK>(dg_part, db_part, H, work, dgamma, dbeta);
}

// dx for any H / alignment: the row sums in one pass, dx in a second (re-read from L1/L2).
template <typename T, typename W, int TPR, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
ln_bwd_dx_generic(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                  const float* __restrict__ rstd, const W* __restrict__ gamma, T* __restrict__ dx,
                  int64_t rows, int H, bool rms) {
  constexpr int RPB = BLOCK / TPR;
  __shared__ float red[BLOCK / 32 * 2];
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * RPB + g;
  const bool valid = row < rows;
  const float mu = (valid && !rms) ? mean[row] : 0.f;
  const float rs = valid ? rstd[row] : 0.f;
  const T* xr = x + row * H;
  const T* dr = dy + row * H;
  float s[2] = {0.f, 0.f};
  if (valid)
    for (int c = lane; c < H; c += TPR) {
      const float xh = (static_cast<float>(xr[c]) - mu) * rs;
      float gd = static_cast<float>(dr[c]);
      if (gamma) gd = __fmul_rn(gd, static_cast<float>(gamma[c]));
      s[0] += gd;
      s[1] += gd * xh;
    }
  group_allreduce<TPR, 2>(s, red, SumOp());
  if (!valid) return;
  const float c1 = rms ? 0.f : s[0] / H, c2 = s[1] / H;
  T* o = dx + row * H;
  for (int c = lane; c < H; c += TPR) {
    const float xh = (static_cast<float>(xr[c]) - mu) * rs;
    float gd = static_cast<float>(dr[c]);
    if (gamma) gd = __fmul_rn(gd, static_cast<float>(gamma[c]));
    o[c] = static_cast<T>(rs * (gd - c1 - xh * c2));
  }
}

// dgamma / dbeta partials for the generic path: block (32 columns x 8 row lanes) sums a
// chunk of `rpp` rows; blockIdx.y is the chunk, written as partial row blockIdx.y.
template <typename T>
__global__ void __launch_bounds__(256)
ln_param_part_generic(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                      const float* __restrict__ rstd, float* __restrict__ dg_part,
                      float* __restrict__ db_part, int64_t rows, int H, int64_t rpp, bool rms) {
  __shared__ float s[2][8][33];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int c = blockIdx.x * 32 + tx;
  const int64_t r0 = int64_t(blockIdx.y) * rpp;
  const int64_t r1 = r0 + rpp < rows ? r0 + rpp : rows;
  float a = 0.f, b = 0.f;
  if (c < H)
    for (int64_t r = r0 + ty; r < r1; r += 8) {
      const float mu = rms ? 0.f : mean[r];
      const float d = static_cast<float>(dy[r * H + c]);
      a += d * (static_cast<float>(x[r * H + c]) - mu) * rstd[r];
      b += d;
    }
  s[0][ty][tx] = a;
  s[1][ty][tx] = b;
  __syncthreads();
  if (ty == 0 && c < H) {
    for (int k = 1; k < 8; ++k) {
      a += s[0][k][tx];
      b += s[1][k][tx];
    }
    if (dg_part) dg_part[int64_t(blockIdx.y) * H + c] = a;
    if (db_part) db_part[int64_t(blockIdx.y) * H + c] = b;
  }
}

// Sums the [P, H] fp32 partials over P in a fixed order and writes dgamma / dbeta in
// the parameters' dtype.  Block: COLS columns x 512 / COLS partial lanes, a block per tile.
template <typename W, int COLS>
__global__ void __launch_bounds__(512)
ln_param_finish(const float* __restrict__ dg_part, const float* __restrict__ db_part, int P, int H,
                W* __restrict__ dgamma, W* __restrict__ dbeta) {
  __shared__ float s[2 * (512 / COLS) * (COLS + 1)];
  pdl_launch_dependents();
  pdl_wait();
  param_finish_tile<W, 512, COLS>(dg_part, db_part, P, H, blockIdx.x, dgamma, dbeta, s);
}

// ============================== host side ==============================================

constexpr const char* kFwd = "mptrain layer_norm forward";
constexpr const char* kBwd = "mptrain layer_norm backward";

template <typename W>
const W* opt_ptr(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<const W*>(t.data_ptr()) : nullptr;
}

// Programmatic dependent launch for the forward, backward and finish kernels wherever the
// device and the binary support it (launch.cuh): +1-2 points of the bandwidth floor at
// every measured shape on the H200, never slower.
bool use_pdl() { return pdl_supported(ln_param_finish<float, 8>); }

// ---- forward ----
template <typename T, typename W, int TPR, int NV, int R>
void launch_fwd_rows(const T* xp, const W* gp, const W* bp, T* yp, float* mean, float* rstd, unsigned* work,
                     int64_t rows, int H, float eps, bool rms, cudaStream_t stream, bool pdl) {
  constexpr int BLOCK = TPR < 128 ? 128 : TPR;
  constexpr int RPB = BLOCK / TPR * R;
  const int64_t grid = (rows + RPB - 1) / RPB;
  launch_kernel(ln_fwd_kernel<T, W, TPR, NV, BLOCK, R>, grid, BLOCK, 0, stream, pdl, xp, gp, bp, yp, mean,
                rstd, work, rows, H, eps, rms);
  MPT_CHECK_LAUNCH(kFwd);
}

template <typename T, typename W>
void launch_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& y,
                float* mean, float* rstd, unsigned* work, int64_t rows, int H, float eps, bool rms) {
  constexpr int VEC = Vec16<T>::n;
  auto stream = at::cuda::getCurrentCUDAStream();
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const W* gp = opt_ptr<W>(w);
  const W* bp = opt_ptr<W>(b);
  const bool aligned = H % VEC == 0 && aligned16(xp) && aligned16(yp) && aligned16(gp) && aligned16(bp);
  const RowShape shape = aligned ? pick_row_shape(H / VEC) : RowShape::Generic;
  const bool pdl = use_pdl();
  if (shape != RowShape::Generic) {
    MPT_ROW_SHAPE_SWITCH(shape, {
      constexpr int R = TPR == 32 ? 2 : 1;  // two rows per warp where a row is one warp's
      launch_fwd_rows<T, W, TPR, NV, R>(xp, gp, bp, yp, mean, rstd, work, rows, H, eps, rms, stream, pdl);
    });
  } else if (H <= 1024) {
    const int64_t grid = (rows + 3) / 4;
    ln_fwd_generic<T, W, 32, 128><<<grid, 128, 0, stream>>>(xp, gp, bp, yp, mean, rstd, work, rows, H, eps, rms);
    MPT_CHECK_LAUNCH(kFwd);
  } else {
    ln_fwd_generic<T, W, 512, 512><<<rows, 512, 0, stream>>>(xp, gp, bp, yp, mean, rstd, work, rows, H, eps, rms);
    MPT_CHECK_LAUNCH(kFwd);
  }
}

// ---- backward ----
// By row length in 16-byte vectors (aligned rows):
//  * <= 128 (1024 bf16): ln_bwd_split_kernel (launch_bwd_split4), which also finishes
//    dgamma / dbeta itself when the forward's counter is passed in;
//  * 129..2048: ln_bwd_kernel in 512-thread blocks, one per SM, the (TPR, NV) shapes
//    below: NV = 2 with the next row prefetched up to 1024 vectors (the accumulators plus
//    two rows of vectors fit the registers: 112-127, no spills), NV = 4 without prefetch
//    above (128 registers, ~70 B spilled: only H in 8193..16384 half / 4097..8192 fp32);
//  * longer or misaligned rows: the generic kernels.
enum class BwdShape { Split, W128x2, W256x2, W512x2, W512x4, Generic };
BwdShape pick_bwd_shape(int64_t nvec) {
  if (nvec <= 128) return BwdShape::Split;
  if (nvec <= 256) return BwdShape::W128x2;
  if (nvec <= 512) return BwdShape::W256x2;
  if (nvec <= 1024) return BwdShape::W512x2;
  if (nvec <= 2048) return BwdShape::W512x4;
  return BwdShape::Generic;
}

// Column-tile width of the finish kernel: 8 below 2048 columns (more blocks for short
// rows: H200 bwd alone 70.1% / 83.4% of the floor at 1024 / 768 against 67.9% / 83.0%
// with 32), 32 from there (76.6% against 77.8% with 8 at 4096).
int finish_cols(int H) { return H < 2048 ? 8 : 32; }

// Everything one backward launch of the row-cached kernels needs.
template <typename T, typename W>
struct BwdArgs {
  const T* dy;
  const T* x;
  const float* mean;
  const float* rstd;
  const W* gamma;
  T* dx;
  bool want_dg, want_db;
  int64_t rows;
  int H;
  bool rms;
  at::TensorOptions fopts;
  at::Tensor* dg_part;  // [grid, H] fp32 partials, allocated by the launch
  at::Tensor* db_part;
  W* dgamma;  // filled by the split kernel itself when `work` is set
  W* dbeta;
  cudaStream_t stream;
  bool pdl;
  unsigned* work;  // the forward's zeroed finish counter: the split kernel finishes dgamma / dbeta itself

  void alloc_partials(int64_t grid) const {
    if (want_dg) *dg_part = new_cuda({grid, H}, at::kFloat, fopts.device());
    if (want_db) *db_part = new_cuda({grid, H}, at::kFloat, fopts.device());
  }
  float* dgq() const { return want_dg ? dg_part->data_ptr<float>() : nullptr; }
  float* dbq() const { return want_db ? db_part->data_ptr<float>() : nullptr; }
};

// One backward launch of the row-cached kernel on a persistent grid; leaves [grid, H]
// partials for ln_param_finish.
template <typename T, typename W, int TPR, int NV, bool PREFETCH>
void launch_bwd_cached(const BwdArgs<T, W>& a) {
  constexpr int BLOCK = 512, MINB = 1, RPB = BLOCK / TPR;
  auto kernel = ln_bwd_kernel<T, W, TPR, NV, BLOCK, MINB, PREFETCH>;
  static const int per_sm = blocks_per_sm(kernel, BLOCK);
  const int64_t grid = balanced_grid((a.rows + RPB - 1) / RPB, int64_t(num_sms()) * per_sm);
  a.alloc_partials(grid);
  launch_kernel(kernel, grid, BLOCK, 0, a.stream, a.pdl, a.dy, a.x, a.mean, a.rstd, a.gamma, a.dx, a.dgq(), a.dbq(),
                a.rows, a.H, a.rms);
  MPT_CHECK_LAUNCH(kBwd);
}

// The split kernel for rows of TPR / 32 warps (one vector per thread).
template <typename T, typename W, int TPR, int BLOCK, int MINB, int DEPTH>
void launch_bwd_split(const BwdArgs<T, W>& a) {
  constexpr int G = BLOCK / TPR;
  auto kernel = ln_bwd_split_kernel<T, W, TPR, BLOCK, MINB, DEPTH>;
  static const int per_sm = blocks_per_sm(kernel, BLOCK);
  const int64_t grid = balanced_grid((a.rows + G - 1) / G, int64_t(num_sms()) * per_sm);
  a.alloc_partials(grid);
  launch_kernel(kernel, grid, BLOCK, 0, a.stream, a.pdl, a.dy, a.x, a.mean, a.rstd, a.gamma, a.dx, a.dgq(),
                a.dbq(), a.rows, a.H, a.rms, a.work, a.dgamma, a.dbeta);
  MPT_CHECK_LAUNCH(kBwd);
}

// DEPTH 4: blocks of 256 threads (8 / 4 / 2 row groups of 1 / 2 / 4 warps), two per SM
// (<= 128 registers); 3-warp rows (768 bf16): one block of 480 (5 groups of 3 warps) per
// SM (288 x 2 per SM spilled at its 113 registers).  ptxas (sm_90a, bf16): ~118 registers
// at DEPTH 4, no spills.
template <typename T, typename W, int WPG>
void launch_bwd_split4_wpg(const BwdArgs<T, W>& a) {
  constexpr int TPR = 32 * WPG;
  if constexpr (WPG == 3) launch_bwd_split<T, W, TPR, 480, 1, 4>(a);
  else launch_bwd_split<T, W, TPR, 256, 2, 4>(a);
}

template <typename T, typename W>
void launch_bwd_split4(int64_t nvec, const BwdArgs<T, W>& a) {
  if (nvec <= 32) launch_bwd_split4_wpg<T, W, 1>(a);
  else if (nvec <= 64) launch_bwd_split4_wpg<T, W, 2>(a);
  else if (nvec <= 96) launch_bwd_split4_wpg<T, W, 3>(a);
  else launch_bwd_split4_wpg<T, W, 4>(a);
}

// Misaligned or very long rows: dx row by row, then dgamma / dbeta partials by a
// column-reduction kernel over row chunks (into `dg_part` / `db_part`).
template <typename T, typename W>
void launch_bwd_generic(const BwdArgs<T, W>& a) {
  auto stream = a.stream;
  if (a.H <= 1024) {
    ln_bwd_dx_generic<T, W, 32, 128><<<(a.rows + 3) / 4, 128, 0, stream>>>(a.dy, a.x, a.mean, a.rstd, a.gamma, a.dx,
                                                                           a.rows, a.H, a.rms);
  } else {
    ln_bwd_dx_generic<T, W, 512, 512><<<a.rows, 512, 0, stream>>>(a.dy, a.x, a.mean, a.rstd, a.gamma, a.dx, a.rows,
                                                                  a.H, a.rms);
  }
  MPT_CHECK_LAUNCH(kBwd);
  if (!a.want_dg && !a.want_db) return;
  // Enough row chunks to fill the GPU, each at least 8 rows.
  const int64_t col_blocks = (a.H + 31) / 32;
  int64_t parts = std::max<int64_t>(1, int64_t(num_sms()) * 8 / col_blocks);
  parts = std::min<int64_t>(parts, std::max<int64_t>(1, (a.rows + 7) / 8));
  const int64_t rpp = (a.rows + parts - 1) / parts;
  parts = (a.rows + rpp - 1) / rpp;
  a.alloc_partials(parts);
  ln_param_part_generic<T><<<dim3(col_blocks, parts), 256, 0, stream>>>(a.dy, a.x, a.mean, a.rstd, a.dgq(), a.dbq(),
                                                                        a.rows, a.H, rpp, a.rms);
  MPT_CHECK_LAUNCH(kBwd);
}

template <typename T, typename W>
void launch_bwd(const at::Tensor& dy, const at::Tensor& x, const float* mean, const float* rstd,
                const at::Tensor& w, at::Tensor& dx, at::Tensor& dgamma, at::Tensor& dbeta,
                int64_t rows, int H, bool rms, unsigned* work) {
  constexpr int VEC = Vec16<T>::n;
  auto stream = at::cuda::getCurrentCUDAStream();
  const T* dyp = reinterpret_cast<const T*>(dy.data_ptr());
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  T* dxp = reinterpret_cast<T*>(dx.data_ptr());
  const W* gp = opt_ptr<W>(w);
  const bool want_dg = dgamma.defined(), want_db = dbeta.defined();
  at::Tensor dg_part, db_part;
  const bool aligned = H % VEC == 0 && aligned16(dyp) && aligned16(xp) && aligned16(dxp) && aligned16(gp);
  const BwdShape shape = aligned ? pick_bwd_shape(H / VEC) : BwdShape::Generic;
  const bool fold = shape == BwdShape::Split && work != nullptr && (want_dg || want_db);
  const bool pdl = use_pdl();
  W* dgp = want_dg ? reinterpret_cast<W*>(dgamma.data_ptr()) : nullptr;
  W* dbp = want_db ? reinterpret_cast<W*>(dbeta.data_ptr()) : nullptr;
  const BwdArgs<T, W> a{dyp, xp, mean, rstd, gp, dxp, want_dg, want_db, rows, H, rms, x.options().dtype(at::kFloat),
                        &dg_part, &db_part, dgp, dbp, stream, pdl, fold ? work : nullptr};
  switch (shape) {
    case BwdShape::Split: launch_bwd_split4<T, W>(H / VEC, a); break;
    case BwdShape::W128x2: launch_bwd_cached<T, W, 128, 2, true>(a); break;
    case BwdShape::W256x2: launch_bwd_cached<T, W, 256, 2, true>(a); break;
    case BwdShape::W512x2: launch_bwd_cached<T, W, 512, 2, true>(a); break;
    case BwdShape::W512x4: launch_bwd_cached<T, W, 512, 4, false>(a); break;
    default: launch_bwd_generic<T, W>(a); break;
  }
  if ((!want_dg && !want_db) || fold) return;
  const int P = static_cast<int>((want_dg ? dg_part : db_part).size(0));
  // PDL here too: the finish kernel's blocks launch while the backward drains (the generic
  // path's kernels are plain launches, and a PDL launch after a plain one simply waits).
  float* dgq = want_dg ? dg_part.data_ptr<float>() : nullptr;
  float* dbq = want_db ? db_part.data_ptr<float>() : nullptr;
  if (finish_cols(H) == 8)
    launch_kernel(ln_param_finish<W, 8>, (H + 7) / 8, 512, 0, stream, pdl, dgq, dbq, P, H, dgp, dbp);
  else
    launch_kernel(ln_param_finish<W, 32>, (H + 31) / 32, 512, 0, stream, pdl, dgq, dbq, P, H, dgp, dbp);
  MPT_CHECK_LAUNCH(kBwd);
}
// Checks shared by forward and backward; returns the number of rows.
int64_t check_inputs(const char* name, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                     int64_t H, bool rms) {
  MPT_CHECK_CUDA(x, name);
  MPT_CHECK_CONTIGUOUS(x, name);
  MPT_CHECK(H >= 1 && H <= (int64_t(1) << 30), name, ": normalized size must be in [1, 2^30], got ", H);
  MPT_CHECK(x.numel() % H == 0, name, ": input with ", x.numel(),
              " elements is not a whole number of rows of the normalized size ", H);
  MPT_CHECK(!(rms && b.defined()), name, ": RMSNorm has no bias; pass bias=None");
  const auto wdt = w.defined() ? w.scalar_type() : (b.defined() ? b.scalar_type() : x.scalar_type());
  MPT_CHECK(wdt == x.scalar_type() || wdt == at::kFloat, name, ": weight/bias dtype ", wdt,
              " must be float32 or the input's dtype ", x.scalar_type(), "; cast the parameters");
  for (const at::Tensor* t : {&w, &b}) {
    if (!t->defined()) continue;
    MPT_CHECK(t->device() == x.device(), name, ": weight/bias on ", t->device(), " but input on ", x.device());
    MPT_CHECK(t->is_contiguous(), name, ": weight/bias must be contiguous");
    MPT_CHECK(t->numel() == H, name, ": weight/bias has ", t->numel(), " elements, expected the normalized size ", H);
    MPT_CHECK(t->scalar_type() == wdt, name, ": weight dtype ", w.scalar_type(), " and bias dtype ",
                b.scalar_type(), " differ; cast them to one dtype");
  }
  return x.numel() / H;
}

at::Tensor value_or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

}  // namespace

namespace {

// The forward into a new y and a new stats buffer [mean (rows; none for RMSNorm) | rstd
// (rows) | counter word]: one allocation for the three, addressed by pointer (no views:
// this is the host path of every norm call).
std::tuple<at::Tensor, at::Tensor> forward_stats(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                                                 int64_t hidden, double eps, bool rms) {
  const int64_t rows = check_inputs(kFwd, x, w, b, hidden, rms);
  const at::cuda::CUDAGuard guard(x.device());
  at::Tensor y = new_cuda(x.sizes(), x);
  const int64_t nmean = rms ? 0 : rows;
  at::Tensor stats = new_cuda({nmean + rows + 1}, at::kFloat, x.device());
  float* sp = stats.data_ptr<float>();
  unsigned* wp = reinterpret_cast<unsigned*>(sp + nmean + rows);
  if (rows == 0) {
    stats.zero_();  // the counter word
    return {y, stats};
  }
  const bool w32 = (w.defined() ? w : b).defined() && (w.defined() ? w : b).scalar_type() == at::kFloat;
  const int H = static_cast<int>(hidden);
  float* mp = rms ? nullptr : sp;
  MPT_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), kFwd, scalar_t,
    if (w32) launch_fwd<scalar_t, float>(x, w, b, y, mp, sp + nmean, wp, rows, H, float(eps), rms);
    else launch_fwd<scalar_t, scalar_t>(x, w, b, y, mp, sp + nmean, wp, rows, H, float(eps), rms));
  return {y, stats};
}

// The backward from the forward's statistics by address (mean may be null for RMSNorm;
// work null: a separate kernel finishes dweight / dbias).  Checks dy; the caller checked
// the statistics.
std::vector<at::Tensor> backward_from(const at::Tensor& dy, const at::Tensor& x, const float* mp, const float* rp,
                                      unsigned* wp, const at::Tensor& w, const at::Tensor& b, int64_t rows,
                                      int64_t hidden, bool rms) {
  MPT_CHECK_CUDA(dy, kBwd);
  MPT_CHECK_CONTIGUOUS(dy, kBwd);
  MPT_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), kBwd,
              ": grad_output must match the input's shape and dtype, got ", dy.sizes(), " ", dy.scalar_type(),
              " vs ", x.sizes(), " ", x.scalar_type());
  const at::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = new_cuda(x.sizes(), x);
  at::Tensor dw = w.defined() ? new_cuda(w.sizes(), w) : at::Tensor();
  at::Tensor dbias = b.defined() ? new_cuda(b.sizes(), b) : at::Tensor();
  if (rows == 0) {
    if (dw.defined()) dw.zero_();
    if (dbias.defined()) dbias.zero_();
    return {dx, dw, dbias};
  }
  const bool w32 = (w.defined() ? w : b).defined() && (w.defined() ? w : b).scalar_type() == at::kFloat;
  const int H = static_cast<int>(hidden);
  MPT_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), kBwd, scalar_t,
    if (w32) launch_bwd<scalar_t, float>(dy, x, mp, rp, w, dx, dw, dbias, rows, H, rms, wp);
    else launch_bwd<scalar_t, scalar_t>(dy, x, mp, rp, w, dx, dw, dbias, rows, H, rms, wp));
  return {dx, dw, dbias};
}

}  // namespace

// Returns {y, stats}: the op's forward (ops_cuda.cpp).  x: contiguous [rows, H] (any
// leading shape), weight/bias: H elements in x's dtype or fp32.  stats (fp32) =
// [mean (rows, LayerNorm only) | rstd (rows) | counter word]; the counter, zeroed by the
// forward kernel, is the backward's ticket for its in-kernel dgamma / dbeta finish.
std::tuple<at::Tensor, at::Tensor> layer_norm_forward_stats(const at::Tensor& x,
                                                            const std::optional<at::Tensor>& weight,
                                                            const std::optional<at::Tensor>& bias, int64_t hidden,
                                                            double eps, bool rms) {
  return forward_stats(x, value_or_undefined(weight), value_or_undefined(bias), hidden, eps, rms);
}

// Returns {dx, dweight, dbias} from the forward's stats buffer; dweight / dbias are
// undefined when the parameter was absent.  Two backwards over one forward's stats must not
// run concurrently on different streams (they share the counter word).
std::vector<at::Tensor> layer_norm_backward_stats(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& stats,
                                                  const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias, int64_t hidden, bool rms) {
  const at::Tensor w = value_or_undefined(weight), b = value_or_undefined(bias);
  const int64_t rows = check_inputs(kBwd, x, w, b, hidden, rms), nmean = rms ? 0 : rows;
  MPT_CHECK(stats.scalar_type() == at::kFloat && stats.dim() == 1 && stats.numel() == nmean + rows + 1 &&
                stats.is_contiguous() && stats.device() == x.device(),
            kBwd, ": stats must be the fp32 [", nmean + rows + 1, "] tensor on ", x.device(),
            " returned by the forward for this input, got ", stats.scalar_type(), " ", stats.sizes(), " on ",
            stats.device());
  float* sp = stats.data_ptr<float>();
  return backward_from(dy, x, rms ? nullptr : sp, sp + nmean, reinterpret_cast<unsigned*>(sp + nmean + rows), w, b,
                       rows, hidden, rms);
}

// The extension's own functions (benchmarks and tests call them): the same kernels with
// mean, rstd and the counter as separate tensors.
// Returns {y, mean, rstd, work}; mean is empty for RMSNorm; the three are views of the
// forward's stats buffer.
std::vector<at::Tensor> layer_norm_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                           const std::optional<at::Tensor>& bias, int64_t hidden,
                                           double eps, bool rms) {
  auto [y, stats] = forward_stats(x, value_or_undefined(weight), value_or_undefined(bias), hidden, eps, rms);
  const int64_t rows = x.numel() / hidden, nmean = rms ? 0 : rows;  // hidden >= 1: checked
  return {y, stats.narrow(0, 0, nmean), stats.narrow(0, nmean, rows), stats.narrow(0, nmean + rows, 1).view(at::kInt)};
}

// Returns {dx, dweight, dbias}; mean may be empty for RMSNorm.  work: the forward's
// counter word, or None (then a separate kernel finishes dweight / dbias).
std::vector<at::Tensor> layer_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                            const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
                                            const std::optional<at::Tensor>& bias, int64_t hidden, bool rms,
                                            const std::optional<at::Tensor>& work) {
  const at::Tensor w = value_or_undefined(weight), b = value_or_undefined(bias);
  const int64_t rows = check_inputs(kBwd, x, w, b, hidden, rms);
  MPT_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == rows && rstd.is_contiguous(), kBwd,
              ": rstd must be the contiguous fp32 [rows] tensor saved by forward");
  MPT_CHECK(rms || (mean.scalar_type() == at::kFloat && mean.numel() == rows && mean.is_contiguous()), kBwd,
              ": mean must be the contiguous fp32 [rows] tensor saved by forward");
  unsigned* wp = nullptr;
  if (work.has_value() && work->defined()) {
    MPT_CHECK(work->scalar_type() == at::kInt && work->numel() == 1 && work->device() == x.device(), kBwd,
                ": work must be the one-element int32 tensor returned by layer_norm_forward on ", x.device(),
                ", got ", work->scalar_type(), " with ", work->numel(), " elements on ", work->device(),
                "; pass None to finish dweight / dbias in a separate kernel");
    wp = reinterpret_cast<unsigned*>(work->data_ptr<int32_t>());
  }
  return backward_from(dy, x, rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), wp, w, b, rows, hidden,
                       rms);
}
