// LAMB (You et al., 2019) over a whole parameter list, with or without fp32 master
// weights.
//
// What is fused and why: LAMB needs each tensor's weight norm and update norm
// before it can apply the update, so it takes two list-wide passes around a norm:
//   stage 1  reads grad, weight, m, v; writes m, v and the Adam-style update u (fp32)
//   norms    ||w|| and ||u|| per tensor (multi_tensor_l2norm, deterministic)
//   stage 2  reads w and u; writes w (and the half param with master weights)
// Each pass is one launch for the whole list. Unscaling and the found_inf skip are
// inside the passes (every pass returns at once on a non-zero *found_inf, the step
// count included), lr and the step counts are read on the device.
//
// Update rule (fp32 math):
//   g = grad / grad_scale, negated if maximize
//   m += (1 - beta1) * (g - m);  v = beta2 * v + (1 - beta2) * g * g
//   u = (m / bc1) / (sqrt(v / bc2) + eps) + wd * w   with bc = 1 - beta^t (1 without bias_correction)
//   r = ||w|| / ||u|| when both are non-zero, else 1;  w -= lr * r * u
//
// Stochastic rounding (bf16-sr: bf16 params, fp32 moments, no master): the same passes and
// math; stage 2 writes the bf16 param with stochastic rounding (stochastic_round.cuh).
#include "multi_tensor_apply.cuh"
#include "stochastic_round.cuh"

namespace mpt_mt {

struct LambArgs {
  float lr;
  const float* lr_ptr;
  float one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
  double log_beta1, log_beta2;
  bool bias_correction, maximize;
  const float* grad_scale;
  const float* found_inf;
};

// lists: 0 grad (G), 1 weight (W: the fp32 master or the param), 2 exp_avg (S),
//        3 exp_avg_sq (S), 4 step (float, one value), 5 update (float, scratch)
template <typename G, typename W, typename S>
struct LambStage1Op {
  static constexpr int kILP = 2;
  LambArgs a;

  __device__ bool skip() const { return a.found_inf != nullptr && *a.found_inf != 0.f; }

  __device__ void operator()(const TensorListMeta<6>& meta, int t, int, int64_t off, int n) const {
    const G* g = static_cast<const G*>(meta.addr[0][t]) + off;
    const W* w = static_cast<const W*>(meta.addr[1][t]) + off;
    S* m = static_cast<S*>(meta.addr[2][t]) + off;
    S* v = static_cast<S*>(meta.addr[3][t]) + off;
    float* u = static_cast<float*>(meta.addr[5][t]) + off;
    const float step = *static_cast<const float*>(meta.addr[4][t]) + 1.f;
    const float bc1 = a.bias_correction ? static_cast<float>(bias_correction(a.log_beta1, step)) : 1.f;
    const float bc2 = a.bias_correction ? static_cast<float>(bias_correction(a.log_beta2, step)) : 1.f;
    const float inv_scale = a.grad_scale != nullptr ? 1.f / *a.grad_scale : 1.f;
    const bool vec = vec_aligned<G>(g) && vec_aligned<W>(w) && vec_aligned<S>(m) && vec_aligned<S>(v) &&
                     vec_aligned<float>(u);

    float rg[kILP][kVec], rw[kILP][kVec], rm[kILP][kVec], rv[kILP][kVec];
    load_frag(rg, g, n, vec);
    load_frag(rw, w, n, vec);
    load_frag(rm, m, n, vec);
    load_frag(rv, v, n, vec);
#pragma unroll
    for (int k = 0; k < kILP; ++k) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        float gr = rg[k][j] * inv_scale;
        if (a.maximize) gr = -gr;
        const float mk = rm[k][j] + a.one_minus_beta1 * (gr - rm[k][j]);
        const float vk = a.beta2 * rv[k][j] + a.one_minus_beta2 * gr * gr;
        rm[k][j] = mk;
        rv[k][j] = vk;
        rg[k][j] = (mk / bc1) / (sqrtf(vk / bc2) + a.eps) + a.weight_decay * rw[k][j];
      }
    }
    store_frag(m, rm, n, vec);
    store_frag(v, rv, n, vec);
    store_frag(u, rg, n, vec);
  }
};

// lists: 0 weight (W), 1 update (float), 2 half param (P, MASTER only) or step (float, one value; SR only)
// SR: W is the bf16 param, written with stochastic rounding (keyed by `sr` and the step).
template <typename W, typename P, bool MASTER, bool SR = false>
struct LambStage2Op {
  static_assert(!SR || (!MASTER && std::is_same<W, at::BFloat16>::value), "stochastic rounding writes bf16 params");
  static constexpr int kILP = 2;
  static constexpr int kDepth = MASTER || SR ? 3 : 2;
  LambArgs a;
  const float* w_norm;  // per tensor of the whole list
  const float* u_norm;
  mpt_sr::SrArgs sr;  // SR only

  __device__ bool skip() const { return a.found_inf != nullptr && *a.found_inf != 0.f; }

  __device__ void operator()(const TensorListMeta<kDepth>& meta, int t, int, int64_t off, int n) const {
    W* w = static_cast<W*>(meta.addr[0][t]) + off;
    const float* u = static_cast<const float*>(meta.addr[1][t]) + off;
    P* p = MASTER ? static_cast<P*>(meta.addr[kDepth - 1][t]) + off : nullptr;
    const float count = SR ? *static_cast<const float*>(meta.addr[2][t]) : 0.f;
    const float wn = w_norm[meta.tensor_base + t], un = u_norm[meta.tensor_base + t];
    const float ratio = (wn > 0.f && un > 0.f) ? wn / un : 1.f;
    const float step = read_or(a.lr_ptr, a.lr) * ratio;
    const bool vec = vec_aligned<W>(w) && vec_aligned<float>(u) && (!MASTER || vec_aligned<P>(p));

    float rw[kILP][kVec], ru[kILP][kVec];
    load_frag(rw, w, n, vec);
    load_frag(ru, u, n, vec);
#pragma unroll
    for (int k = 0; k < kILP; ++k)
#pragma unroll
      for (int j = 0; j < kVec; ++j) rw[k][j] -= step * ru[k][j];
    if constexpr (SR)
      mpt_sr::store_frag_sr<false>(w, rw, n, vec, off, sr.seed, static_cast<uint32_t>(count) + 1u,
                                   sr.tensor_offset + static_cast<uint32_t>(meta.tensor_base + t));
    else
      store_frag(w, rw, n, vec);
    if (MASTER) store_frag(p, rw, n, vec);
  }
};

// Stage 1 (the fp32 updates from the moments) and the per-tensor norms stage 2 scales by.
struct LambStage1 {
  std::vector<at::Tensor> updates;
  at::Tensor w_norm, u_norm;
};

template <typename G, typename W, typename S>
LambStage1 lamb_stage1(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& weights,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& steps, const LambArgs& a, const char* name) {
  LambStage1 r;
  r.updates.reserve(weights.size());
  for (const auto& w : weights) r.updates.push_back(at::empty_like(w, w.options().dtype(at::kFloat)));
  multi_tensor_apply<6>({grads, weights, exp_avgs, exp_avg_sqs, steps, r.updates}, 1u << 4,
                        LambStage1Op<G, W, S>{a}, name);
  r.w_norm = multi_tensor_l2norm(weights, true)[1];
  r.u_norm = multi_tensor_l2norm(r.updates, true)[1];
  return r;
}

template <typename G, typename W, typename S, typename P, bool MASTER>
void lamb_impl(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& weights,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& params, const LambArgs& a,
               const char* name) {
  const LambStage1 s1 = lamb_stage1<G, W, S>(grads, weights, exp_avgs, exp_avg_sqs, steps, a, name);
  const std::vector<at::Tensor>& updates = s1.updates;
  const at::Tensor& w_norm = s1.w_norm;
  const at::Tensor& u_norm = s1.u_norm;
  if (MASTER)
    multi_tensor_apply<3>({weights, updates, params}, 0,
                          LambStage2Op<W, P, true>{a, w_norm.data_ptr<float>(), u_norm.data_ptr<float>()}, name);
  else
    multi_tensor_apply<2>({weights, updates}, 0,
                          LambStage2Op<W, P, false>{a, w_norm.data_ptr<float>(), u_norm.data_ptr<float>()}, name);
}

// bf16 params and grads, fp32 moments, no master: stage 2 writes the weight with stochastic rounding.
void lamb_sr_impl(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                  const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                  const std::vector<at::Tensor>& steps, const LambArgs& a, const mpt_sr::SrArgs& sr,
                  const char* name) {
  using BF = at::BFloat16;
  const LambStage1 s1 = lamb_stage1<BF, BF, float>(grads, params, exp_avgs, exp_avg_sqs, steps, a, name);
  multi_tensor_apply<3>({params, s1.updates, steps}, 1u << 2,
                        LambStage2Op<BF, BF, false, true>{a, s1.w_norm.data_ptr<float>(), s1.u_norm.data_ptr<float>(),
                                                          sr},
                        name);
}

void multi_tensor_lamb_sr(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<at::Tensor>& steps, double lr, const std::optional<at::Tensor>& lr_tensor,
                          double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
                          bool maximize, const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf, int64_t seed, int64_t tensor_offset) {
  static const char* name = "multi_tensor_lamb_sr";
  if (params.empty()) return;
  LambArgs a;
  fill_moment_args(a, name, params[0].device(), lr, lr_tensor, beta1, beta2, eps, weight_decay, maximize, grad_scale,
                   found_inf);
  a.bias_correction = bias_correction;
  check_sr_lists(grads, params, exp_avgs, exp_avg_sqs, steps, tensor_offset, name);
  lamb_sr_impl(grads, params, exp_avgs, exp_avg_sqs, steps, a,
               mpt_sr::SrArgs{static_cast<uint64_t>(seed), static_cast<uint32_t>(tensor_offset)}, name);
  step_increment(steps, a.found_inf, name);
}

void multi_tensor_lamb(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& masters, double lr,
                       const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double eps,
                       double weight_decay, bool bias_correction, bool maximize,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  static const char* name = "multi_tensor_lamb";
  if (params.empty()) return;
  LambArgs a;
  fill_moment_args(a, name, params[0].device(), lr, lr_tensor, beta1, beta2, eps, weight_decay, maximize, grad_scale,
                   found_inf);
  a.bias_correction = bias_correction;
  const at::ScalarType pt = params[0].scalar_type();
  if (!check_moment_lists(grads, params, exp_avgs, exp_avg_sqs, steps, masters, name)) {
    MPT_DISPATCH_FLOAT_HALF_BF16(pt, name, T,
      lamb_impl<T, T, T, T, false>(grads, params, exp_avgs, exp_avg_sqs, steps, params, a, name));
  } else if (pt == at::kHalf) {
    lamb_impl<at::Half, float, float, at::Half, true>(grads, masters, exp_avgs, exp_avg_sqs, steps, params, a, name);
  } else {
    lamb_impl<at::BFloat16, float, float, at::BFloat16, true>(grads, masters, exp_avgs, exp_avg_sqs, steps, params, a,
                                                             name);
  }
  step_increment(steps, a.found_inf, name);
}

}  // namespace mpt_mt

void multi_tensor_lamb(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& masters, double lr,
                       const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double eps,
                       double weight_decay, bool bias_correction, bool maximize,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  mpt_mt::multi_tensor_lamb(grads, params, exp_avgs, exp_avg_sqs, steps, masters, lr, lr_tensor, beta1, beta2, eps,
                            weight_decay, bias_correction, maximize, grad_scale, found_inf);
}

void multi_tensor_lamb_sr(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<at::Tensor>& steps, double lr, const std::optional<at::Tensor>& lr_tensor,
                          double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
                          bool maximize, const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf, int64_t seed, int64_t tensor_offset) {
  mpt_mt::multi_tensor_lamb_sr(grads, params, exp_avgs, exp_avg_sqs, steps, lr, lr_tensor, beta1, beta2, eps,
                               weight_decay, bias_correction, maximize, grad_scale, found_inf, seed, tensor_offset);
}
