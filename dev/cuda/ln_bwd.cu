// Lab: where the split LayerNorm backward's time goes beyond the stream, and two ways to
// shorten its dgamma / dbeta finish, against the shipped kernel (csrc/layer_norm.cu).
//
// Why: at 16384x1024 bf16 the backward takes 34.2 us against 26.4 us for torch's x + dy
// (the same 6 B/elem), and ncu put the split loop alone at 28.7 us.  The rest is the end of
// the kernel: every block writes a [H] partial row of dgamma / dbeta, then the last F blocks
// to arrive sum the P = grid partial rows (fold_finish).  Kinds:
//   1  lab kernel = the shipped one (same loop, partials, fold with U = 8): the sanity row
//   2  shipped kernel, partials written, no finish (work = nullptr)
//   3  shipped kernel, no partials, no finish: the loop and dx alone
//   4  fold finish loading every partial a lane sums in one round (U = 16 covers P <= 512)
//   5, 6, 7  cluster of CL = 2, 4, 8 blocks: the blocks of a cluster sum their partial rows
//      through distributed shared memory (fixed order) before one of them is written, so the
//      finishers read P / CL rows
// Deterministic in every kind (fixed summation orders).  Built by dev/cuda/ln_bwd_bench.py;
// bf16 x / dy / weights, rows of 768 or 1024.  Never imported by mptrain.
#include <cooperative_groups.h>
#include <torch/extension.h>

#include "layer_norm.cu"

namespace {
using namespace mpt;
namespace cg = cooperative_groups;
using bf16 = at::BFloat16;

// param_finish_tile with the loads-per-round U as a parameter (the shipped one has U = 8).
template <typename W, int BLOCK, int COLS, int U, int BAR>
__device__ __forceinline__ void finish_tile(const float* dg_part, const float* db_part, int P, int H, int tile,
                                            W* dgamma, W* dbeta, float* s) {
  constexpr int LANES = BLOCK / COLS, SP = COLS + 1;
  auto sync = [] {
    if constexpr (BAR == 0) __syncthreads();
    else group_barrier(BAR, BLOCK);
  };
  const int tx = threadIdx.x % COLS, ty = threadIdx.x / COLS;
  const int c = tile * COLS + tx;
  float a = 0.f, b = 0.f;
  if (c < H)
    for (int p0 = ty; p0 < P; p0 += LANES * U) {
      float va[U], vb[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + LANES * u;
        va[u] = p < P ? __ldcg(dg_part + int64_t(p) * H + c) : 0.f;
        vb[u] = p < P ? __ldcg(db_part + int64_t(p) * H + c) : 0.f;
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
    dgamma[c] = static_cast<W>(s[tx]);
    dbeta[c] = static_cast<W>(s[LANES * SP + tx]);
  }
  sync();
}

// fold_finish with the partial rows (P) apart from the arrivals (gridDim.x): every block
// arrives, P = gridDim.x / CL rows exist.
template <typename W, int BLOCK, int U>
__device__ __forceinline__ void fold_finish_rows(const float* dg_part, const float* db_part, int H, unsigned P,
                                                 unsigned* work, W* dgamma, W* dbeta) {
  constexpr int NT = 256, COLS = 8;
  __shared__ unsigned ticket;
  __shared__ float s[2 * (NT / COLS) * (COLS + 1)];
  const unsigned A = gridDim.x, tiles = (H + COLS - 1) / COLS;
  const unsigned F = A < tiles ? A : tiles;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) ticket = atomicInc(work, A + F - 1);
  __syncthreads();
  const unsigned t = ticket;
  if (t < A - F) return;
  if (threadIdx.x == 0)
    while (ld_acquire_gpu(work) < A) __nanosleep(32);
  __syncthreads();
  if (threadIdx.x >= NT) return;
  for (unsigned tile = t - (A - F); tile < tiles; tile += F)
    finish_tile<W, NT, COLS, U, (BLOCK == NT ? 0 : 1)>(dg_part, db_part, static_cast<int>(P), H,
                                                        static_cast<int>(tile), dgamma, dbeta, s);
  if (threadIdx.x == 0) atomicInc(work, A + F - 1);
}

// The shipped split loop; then CL == 1: the block's partial row to global (as shipped);
// CL > 1: the block's row sum into shared memory, and rank r of the cluster sums columns
// [r H / CL, (r + 1) H / CL) over the cluster's CL blocks (rank order) into row cluster_id.
template <typename T, typename W, int TPR, int BLOCK, int MINB, int DEPTH, int CL, int U>
__global__ void __launch_bounds__(BLOCK, MINB)
ln_bwd_lab(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
           const float* __restrict__ rstd, const W* __restrict__ gamma, T* __restrict__ dx, float* dg_part,
           float* db_part, int64_t rows, int H, bool rms, unsigned* work, W* dgamma, W* dbeta) {
  using K = SplitBwd<T, W, TPR, BLOCK, DEPTH>;
  constexpr int VEC = K::VEC, G = K::G, MAXH = TPR * VEC;
  static_assert(G > 1, "lab: two or more row groups per block");
  __shared__ float red[2][G][K::WPG][2];
  __shared__ float acc[2 * MAXH];
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
  k.rms = rms;  // a run-time flag, as in the shipped kernel, so that both compile the same row arithmetic
  k.has_col = k.lane < H / VEC;
  k.inv_h = 1.f / H;
  k.red = red;
  k.load_gamma();
#pragma unroll
  for (int i = 0; i < VEC; ++i) k.dg[i] = k.db[i] = 0.f;
  int64_t row = int64_t(blockIdx.x) * G + k.g;
#pragma unroll
  for (int s = 0; s < DEPTH; ++s) k.load(k.buf[s], row + s * k.stride);
  int par = 0;
  while (row < rows) {
#define LAB_STEP(S)                                         \
  if constexpr (S < K::SLOTS) {                             \
    if (row >= rows) break;                                 \
    k.template step<S>(row, par);                           \
    row += k.stride;                                        \
    par ^= 1;                                               \
  }
    LAB_STEP(0)
    LAB_STEP(1)
    LAB_STEP(2)
    LAB_STEP(3)
    LAB_STEP(4)
    LAB_STEP(5)
    LAB_STEP(6)
    LAB_STEP(7)
#undef LAB_STEP
  }
  float dg[1][VEC], db[1][VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    dg[0][i] = k.dg[i];
    db[0][i] = k.db[i];
  }
  if constexpr (CL == 1) {
    store_block_partial<TPR, 1, VEC, BLOCK>(dg, db, dg_part, db_part, H, acc);
    fold_finish_rows<W, BLOCK, U>(dg_part, db_part, H, gridDim.x, work, dgamma, dbeta);
  } else {
    // the block's row sum in `acc` (null partial pointers: shared memory only)
    store_block_partial<TPR, 1, VEC, BLOCK>(dg, db, nullptr, nullptr, H, acc);
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    const unsigned r = cluster.block_rank(), cid = blockIdx.x / CL;
    const int per = (H + CL - 1) / CL, c0 = r * per, c1 = min(H, c0 + per);
    for (int c = c0 + threadIdx.x; c < c1; c += BLOCK) {
      float a = 0.f, b = 0.f;
#pragma unroll
      for (int q = 0; q < CL; ++q) {
        const float* o = cluster.map_shared_rank(acc, q);
        a += o[c];
        b += o[MAXH + c];
      }
      dg_part[int64_t(cid) * H + c] = a;
      db_part[int64_t(cid) * H + c] = b;
    }
    cluster.sync();  // the other blocks' shared memory stays alive until every rank has read it
    fold_finish_rows<W, BLOCK, U>(dg_part, db_part, H, gridDim.x / CL, work, dgamma, dbeta);
  }
}

template <typename Kernel>
int64_t lab_grid(Kernel kernel, int block, int cl, int64_t groups) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, 0));
  int64_t cap = int64_t(num_sms()) * per_sm;
  if (cl > 1) {  // whole clusters, and no more than can be resident at once (the finish waits in the grid)
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(cap / cl * cl));
    cfg.blockDim = dim3(block);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cl;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    cap = std::min<int64_t>(cap, int64_t(clusters) * cl);
  }
  int64_t grid = balanced_grid(groups, cap);
  return (grid + cl - 1) / cl * cl <= cap ? (grid + cl - 1) / cl * cl : cap / cl * cl;
}

template <typename Kernel, typename... Args>
void lab_launch(Kernel kernel, int64_t grid, int block, int cl, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(block);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = cl;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = cl > 1 ? 2 : 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

#define LAB_SHAPE(H, ...)                                                                      \
  if (H == 1024) {                                                                             \
    constexpr int TPR = 128, BLOCK = 256, MINB = 2;                                            \
    __VA_ARGS__;                                                                               \
  } else if (H == 768) {                                                                       \
    constexpr int TPR = 96, BLOCK = 480, MINB = 1;                                             \
    __VA_ARGS__;                                                                               \
  } else {                                                                                     \
    TORCH_CHECK(false, "ln_bwd lab: rows of 768 or 1024 bf16");                                \
  }

#define LAB_KIND(kind, ...)                                                                    \
  switch (kind) {                                                                              \
    case 1: { constexpr int CL = 1, U = 8; __VA_ARGS__; break; }                               \
    case 4: { constexpr int CL = 1, U = 16; __VA_ARGS__; break; }                              \
    case 5: { constexpr int CL = 2, U = 8; __VA_ARGS__; break; }                               \
    case 6: { constexpr int CL = 4, U = 8; __VA_ARGS__; break; }                               \
    case 7: { constexpr int CL = 8, U = 8; __VA_ARGS__; break; }                               \
    default: TORCH_CHECK(false, "ln_bwd lab: kind 1..7");                                      \
  }

// Returns {dx, dgamma, dbeta, grid}; dgamma / dbeta are garbage for kinds 2 and 3 (no finish).
std::vector<at::Tensor> bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                            const at::Tensor& w, const at::Tensor& work, int64_t kind) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "ln_bwd lab: bf16");
  const int H = static_cast<int>(x.size(-1));
  const int64_t rows = x.numel() / H;
  auto dx = at::empty_like(x);
  auto dg = at::empty({H}, w.options()), dbeta = at::empty({H}, w.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  auto fo = x.options().dtype(at::kFloat);
  const bf16* dyp = (const bf16*)dy.data_ptr();
  const bf16* xp = (const bf16*)x.data_ptr();
  const bf16* wp = (const bf16*)w.data_ptr();
  unsigned* wk = (unsigned*)work.data_ptr();
  int64_t grid = 0;
  LAB_SHAPE(H, {
    constexpr int G = BLOCK / TPR;
    const int64_t groups = (rows + G - 1) / G;
    if (kind == 2 || kind == 3) {
      auto kernel = ln_bwd_split_kernel<bf16, bf16, TPR, BLOCK, MINB, 4>;
      grid = lab_grid(kernel, BLOCK, 1, groups);
      auto dgp = at::empty({grid, H}, fo), dbp = at::empty({grid, H}, fo);
      float* pg = kind == 2 ? dgp.data_ptr<float>() : nullptr;
      float* pb = kind == 2 ? dbp.data_ptr<float>() : nullptr;
      lab_launch(kernel, grid, BLOCK, 1, stream, dyp, xp, mean.data_ptr<float>(), rstd.data_ptr<float>(), wp,
                 (bf16*)dx.data_ptr(), pg, pb, rows, H, false, (unsigned*)nullptr, (bf16*)dg.data_ptr(),
                 (bf16*)dbeta.data_ptr());
    } else {
      LAB_KIND(kind, {
        auto kernel = ln_bwd_lab<bf16, bf16, TPR, BLOCK, MINB, 4, CL, U>;
        grid = lab_grid(kernel, BLOCK, CL, groups);
        auto dgp = at::empty({grid / CL, H}, fo), dbp = at::empty({grid / CL, H}, fo);
        lab_launch(kernel, grid, BLOCK, CL, stream, dyp, xp, mean.data_ptr<float>(), rstd.data_ptr<float>(), wp,
                   (bf16*)dx.data_ptr(), dgp.data_ptr<float>(), dbp.data_ptr<float>(), rows, H, false, wk,
                   (bf16*)dg.data_ptr(), (bf16*)dbeta.data_ptr());
      });
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx, dg, dbeta, at::full({1}, grid, x.options().dtype(at::kLong).device(at::kCPU))};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bwd", &bwd);
  m.def("shipped_fwd", &layer_norm_forward);
  m.def("shipped_bwd", &layer_norm_backward);
}
