// Adam / AdamW over a whole parameter list, with or without fp32 master weights.
//
// What is fused and why: one kernel reads the grad, the weight (the fp32 master, or
// the param itself), m and v, and writes the weight, m, v and, with master weights,
// the half param. Grad unscaling (grad_scale), the skip on found_inf, weight decay
// (L2 or decoupled) and the bias corrections happen inside that same pass, so a
// mixed-precision AdamW step costs 28 B/param of HBM traffic and one launch for a
// 392-tensor model, where torch needs a grads-up copy, its fused AdamW on the
// masters and a params-down copy.
//
// lr and the step counts are read on the device (lr from a tensor when given), so the
// step never syncs with the host and can be captured in a CUDA graph. A non-zero
// *found_inf makes every block return before touching memory: the step is skipped
// bit-exactly, step counts included.
//
// Update rule (torch.optim.Adam / AdamW, fp32 math):
//   g = grad / grad_scale, negated if maximize;  Adam: g += wd * w;  AdamW: w *= 1 - lr * wd
//   m += (1 - beta1) * (g - m);  v = beta2 * v + (1 - beta2) * g * g
//   w -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// Stochastic rounding (bf16-sr: bf16 params, fp32 moments, no master): the same pass and math,
// the new fp32 weight written to the bf16 param with stochastic rounding
// (stochastic_round.cuh): 22 B/param of traffic against the master step's 28, and no 4 B/param master.
#include "multi_tensor_apply.cuh"
#include "stochastic_round.cuh"

namespace mpt_mt {

struct AdamArgs {
  float lr;
  const float* lr_ptr;  // overrides lr when set
  float one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
  double log_beta1, log_beta2;
  bool decoupled, maximize;
  const float* grad_scale;
  const float* found_inf;
};

// lists: 0 grad (G), 1 param (P), 2 exp_avg (S), 3 exp_avg_sq (S), 4 step (float, one value),
//        5 fp32 master weight (MASTER only)
// ILP x V elements per thread per chunk (see adam_master_launch for the master-weight shape).
// SR: P is bf16 and the new weight is rounded stochastically (keyed by `sr` and the step).
template <typename G, typename P, typename S, bool MASTER, int ILP = 2, int V = kVec, bool SR = false>
struct AdamOp {
  static_assert(!SR || (!MASTER && std::is_same<P, at::BFloat16>::value), "stochastic rounding writes bf16 params");
  static constexpr int kILP = ILP;
  static constexpr int kVecElems = V;
  // Four fp32 streams of ILP * V floats each are live at once, beside the double
  // bias-correction math that runs while they are in flight: 8 floats per stream need
  // ~70 registers (64 spilled 120 B), i.e. 3 blocks of 256 per SM, which a blocks/SM
  // sweep on the H200 also found fastest; 16 floats need ~128, i.e. 2 blocks.
  static constexpr int kMinBlocks = ILP * V > 8 ? 2 : 3;
  static constexpr int kDepth = MASTER ? 6 : 5;
  AdamArgs a;
  mpt_sr::SrArgs sr;  // SR only

  __device__ bool skip() const { return a.found_inf != nullptr && *a.found_inf != 0.f; }

  // Queue launch (master weights): the last block advances the step counts, after every
  // block has read them, so the step needs no step_increment launch of its own.
  __device__ void last_block(const TensorListMeta<kDepth>& meta) const {
    for (int t = threadIdx.x; t < meta.ntensors; t += blockDim.x) *static_cast<float*>(meta.addr[4][t]) += 1.f;
  }

  __device__ void operator()(const TensorListMeta<kDepth>& meta, int t, int, int64_t off, int n) const {
    const G* g = static_cast<const G*>(meta.addr[0][t]) + off;
    P* p = static_cast<P*>(meta.addr[1][t]) + off;
    S* m = static_cast<S*>(meta.addr[2][t]) + off;
    S* v = static_cast<S*>(meta.addr[3][t]) + off;
    float* master = MASTER ? static_cast<float*>(meta.addr[kDepth - 1][t]) + off : nullptr;
    const bool vec = vec_aligned<G, V>(g) && vec_aligned<P, V>(p) && vec_aligned<S, V>(m) &&
                     vec_aligned<S, V>(v) && (!MASTER || vec_aligned<float, V>(master));
    // Nearly every chunk is whole and aligned: give it branch-free code.
    if (vec && n == op_chunk<AdamOp>()) update<true>(meta, t, g, p, m, v, master, n, true, off);
    else update<false>(meta, t, g, p, m, v, master, n, vec, off);
  }

  template <bool FULL>
  __device__ __forceinline__ void update(const TensorListMeta<kDepth>& meta, int t, const G* g, P* p, S* m, S* v,
                                         float* master, int n, bool vec, int64_t off) const {
    // Loads first: the step count, lr and scale reads and the double-precision bias
    // corrections below then run while the chunk's bytes are in flight.
    float rg[ILP][V], rw[ILP][V], rm[ILP][V], rv[ILP][V];
    load_frag<FULL>(rg, g, n, vec);
    if (MASTER) load_frag<FULL>(rw, master, n, vec);
    else load_frag<FULL>(rw, p, n, vec);
    load_frag<FULL>(rm, m, n, vec);
    load_frag<FULL>(rv, v, n, vec);
    const float step = *static_cast<const float*>(meta.addr[4][t]) + 1.f;
    const float lr = read_or(a.lr_ptr, a.lr);
    const float step_size = static_cast<float>(lr / bias_correction(a.log_beta1, step));
    const float bc2_sqrt = static_cast<float>(sqrt(bias_correction(a.log_beta2, step)));
    const float inv_scale = a.grad_scale != nullptr ? 1.f / *a.grad_scale : 1.f;
    const float decay = 1.f - lr * a.weight_decay;
#pragma unroll
    for (int k = 0; k < ILP; ++k) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float gr = rg[k][j] * inv_scale;
        if (a.maximize) gr = -gr;
        float w = rw[k][j];
        if (a.decoupled) w *= decay;
        else if (a.weight_decay != 0.f) gr += a.weight_decay * w;
        const float mk = rm[k][j] + a.one_minus_beta1 * (gr - rm[k][j]);
        const float vk = a.beta2 * rv[k][j] + a.one_minus_beta2 * gr * gr;
        const float denom = sqrtf(vk) / bc2_sqrt + a.eps;
        rw[k][j] = w - step_size * mk / denom;
        rm[k][j] = mk;
        rv[k][j] = vk;
      }
    }
    if (MASTER) store_frag<FULL>(master, rw, n, vec);
    if constexpr (SR)
      mpt_sr::store_frag_sr<FULL>(p, rw, n, vec, off, sr.seed, static_cast<uint32_t>(step),
                                  sr.tensor_offset + static_cast<uint32_t>(meta.tensor_base + t));
    else
      store_frag<FULL>(p, rw, n, vec);
    store_frag<FULL>(m, rm, n, vec);
    store_frag<FULL>(v, rv, n, vec);
  }
};

// The master-weight step (half params, fp32 masters and moments): 1 group of 8 elements
// per thread (16-byte half / two 16-byte fp32 accesses, 80 registers, 3 blocks/SM) in the
// queue kernel (multi_tensor_apply_queue: the resident grid takes chunks from an atomic
// counter, and its last block advances the step counts, so the step is one launch).  H200,
// 335M params, AdamW bf16: 2.30 ms, 96% of the bandwidth floor, against 2.35 ms for 2 x 8
// in the queue kernel and 2.46 ms for 2 x 8 on a fixed 16 blocks/SM grid (the wave tail of
// fixed-stride grids cost ~6%); 4 x 4 and 2 x 4 on a persistent grid and streaming cache
// hints were slower still (docs/kernels/optim.md).
template <typename T>
void adam_master_launch(const std::vector<std::vector<at::Tensor>>& lists, const AdamArgs& a, const char* name) {
  multi_tensor_apply_queue<6>(lists, 1u << 4, AdamOp<T, T, float, true, 1, 8>{a}, name);
}

AdamArgs adam_args(const at::Device& device, double lr, const std::optional<at::Tensor>& lr_tensor, double beta1,
                   double beta2, double eps, double weight_decay, bool decoupled, bool maximize,
                   const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                   const char* name) {
  AdamArgs a;
  fill_moment_args(a, name, device, lr, lr_tensor, beta1, beta2, eps, weight_decay, maximize, grad_scale, found_inf);
  a.decoupled = decoupled;
  return a;
}

void multi_tensor_adam(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& masters, double lr,
                       const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double eps,
                       double weight_decay, bool decoupled, bool maximize,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  static const char* name = "multi_tensor_adam";
  if (params.empty()) return;
  const AdamArgs a = adam_args(params[0].device(), lr, lr_tensor, beta1, beta2, eps, weight_decay, decoupled, maximize,
                               grad_scale, found_inf, name);
  const at::ScalarType pt = params[0].scalar_type();
  if (!check_moment_lists(grads, params, exp_avgs, exp_avg_sqs, steps, masters, name)) {
    MPT_DISPATCH_FLOAT_HALF_BF16(pt, name, T,
      multi_tensor_apply<5>({grads, params, exp_avgs, exp_avg_sqs, steps}, 1u << 4,
                            AdamOp<T, T, T, false>{a}, name));
  } else {
    const std::vector<std::vector<at::Tensor>> lists{grads, params, exp_avgs, exp_avg_sqs, steps, masters};
    if (pt == at::kHalf) adam_master_launch<at::Half>(lists, a, name);
    else adam_master_launch<at::BFloat16>(lists, a, name);
    return;  // the queue kernel's last block advanced the step counts
  }
  step_increment(steps, a.found_inf, name);
}

// bf16 params, bf16 grads, fp32 moments, no master: the weight is written with stochastic rounding.
void multi_tensor_adam_sr(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<at::Tensor>& steps, double lr, const std::optional<at::Tensor>& lr_tensor,
                          double beta1, double beta2, double eps, double weight_decay, bool decoupled, bool maximize,
                          const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                          int64_t seed, int64_t tensor_offset) {
  static const char* name = "multi_tensor_adam_sr";
  if (params.empty()) return;
  const AdamArgs a = adam_args(params[0].device(), lr, lr_tensor, beta1, beta2, eps, weight_decay, decoupled, maximize,
                               grad_scale, found_inf, name);
  check_sr_lists(grads, params, exp_avgs, exp_avg_sqs, steps, tensor_offset, name);
  const mpt_sr::SrArgs sr{static_cast<uint64_t>(seed), static_cast<uint32_t>(tensor_offset)};
  // The master step's launch shape (adam_master_launch: the same dtype mix of streams, one stream fewer):
  // 1 group of 8 elements per thread in the queue kernel, whose last block advances the step counts.
  multi_tensor_apply_queue<5>({grads, params, exp_avgs, exp_avg_sqs, steps}, 1u << 4,
                              AdamOp<at::BFloat16, at::BFloat16, float, false, 1, 8, true>{a, sr}, name);
}

}  // namespace mpt_mt

void multi_tensor_adam(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& masters, double lr,
                       const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double eps,
                       double weight_decay, bool decoupled, bool maximize,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  mpt_mt::multi_tensor_adam(grads, params, exp_avgs, exp_avg_sqs, steps, masters, lr, lr_tensor, beta1, beta2, eps,
                            weight_decay, decoupled, maximize, grad_scale, found_inf);
}

void multi_tensor_adam_sr(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<at::Tensor>& steps, double lr, const std::optional<at::Tensor>& lr_tensor,
                          double beta1, double beta2, double eps, double weight_decay, bool decoupled, bool maximize,
                          const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                          int64_t seed, int64_t tensor_offset) {
  mpt_mt::multi_tensor_adam_sr(grads, params, exp_avgs, exp_avg_sqs, steps, lr, lr_tensor, beta1, beta2, eps,
                               weight_decay, decoupled, maximize, grad_scale, found_inf, seed, tensor_offset);
}
