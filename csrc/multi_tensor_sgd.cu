// SGD with momentum, dampening, Nesterov and weight decay over a whole parameter
// list, with or without fp32 master weights.
//
// What is fused and why: one kernel reads the grad, the weight (fp32 master or the
// param) and the momentum buffer, and writes the weight, the buffer and, with master
// weights, the half param: 20 B/param for bf16 params with fp32 master and momentum,
// one launch for the whole model. Unscaling (grad_scale) and the skip on found_inf
// are in the same pass; a non-zero *found_inf makes every block return before
// touching memory (the step count is not advanced either).
//
// The step count tells the kernel whether the momentum buffer is new: on the first
// step torch sets buf = grad (no dampening). Keeping that on the device (not a
// Python flag) makes a skipped first step leave the next one a first step.
//
// Update rule (torch.optim.SGD, fp32 math):
//   g = grad / grad_scale, negated if maximize;  g += wd * w
//   buf = g on the first step, else momentum * buf + (1 - dampening) * g
//   g = g + momentum * buf if nesterov else buf;  w -= lr * g
//
// Stochastic rounding (bf16-sr: bf16 params, fp32 momentum, no master): the same pass and
// math, the new fp32 weight written to the bf16 param with stochastic rounding
// (stochastic_round.cuh).
#include "multi_tensor_apply.cuh"
#include "stochastic_round.cuh"

namespace mpt_mt {

struct SgdArgs {
  float lr;
  const float* lr_ptr;
  float momentum, one_minus_dampening, weight_decay;
  bool has_momentum, nesterov, maximize;
  const float* grad_scale;
  const float* found_inf;
};

// lists: 0 grad (G), 1 param (P), 2 momentum buffer (S; a stand-in list when
//        momentum == 0, never touched then), 3 step (float, one value),
//        4 fp32 master weight (MASTER only)
// SR: P is bf16 and the new weight is rounded stochastically (keyed by `sr` and the step).
template <typename G, typename P, typename S, bool MASTER, bool SR = false>
struct SgdOp {
  static_assert(!SR || (!MASTER && std::is_same<P, at::BFloat16>::value), "stochastic rounding writes bf16 params");
  static constexpr int kILP = 2;
  static constexpr int kDepth = MASTER ? 5 : 4;
  SgdArgs a;
  mpt_sr::SrArgs sr;  // SR only

  __device__ bool skip() const { return a.found_inf != nullptr && *a.found_inf != 0.f; }

  __device__ void operator()(const TensorListMeta<kDepth>& meta, int t, int, int64_t off, int n) const {
    const G* g = static_cast<const G*>(meta.addr[0][t]) + off;
    P* p = static_cast<P*>(meta.addr[1][t]) + off;
    S* buf = static_cast<S*>(meta.addr[2][t]) + off;
    float* master = MASTER ? static_cast<float*>(meta.addr[kDepth - 1][t]) + off : nullptr;
    const bool vec = vec_aligned<G>(g) && vec_aligned<P>(p) && (!a.has_momentum || vec_aligned<S>(buf)) &&
                     (!MASTER || vec_aligned<float>(master));
    // Nearly every chunk is whole and aligned: give it branch-free code.
    if (vec && n == op_chunk<SgdOp>()) update<true>(meta, t, g, p, buf, master, n, true, off);
    else update<false>(meta, t, g, p, buf, master, n, vec, off);
  }

  // Every product and sum is rounded on its own (__fmul_rn / __fadd_rn are never
  // contracted into an FMA), exactly as the update rule above and the reference
  // write it. An FMA would differ from the rule by one fp32 ulp now and then; a half
  // momentum buffer turns that into a whole half ulp when the rounding sits on a
  // tie boundary, and the next step's momentum * buf - g cancellation magnifies it
  // to percents of a small buffer value (the nesterov/maximize test caught this).
  template <bool FULL>
  __device__ __forceinline__ void update(const TensorListMeta<kDepth>& meta, int t, const G* g, P* p, S* buf,
                                         float* master, int n, bool vec, int64_t off) const {
    const float count = *static_cast<const float*>(meta.addr[3][t]);
    const bool first = count == 0.f;
    float rg[kILP][kVec], rw[kILP][kVec], rb[kILP][kVec] = {};  // rb stays 0 on a first step
    load_frag<FULL>(rg, g, n, vec);
    if (MASTER) load_frag<FULL>(rw, master, n, vec);
    else load_frag<FULL>(rw, p, n, vec);
    if (a.has_momentum && !first) load_frag<FULL>(rb, buf, n, vec);
    const float lr = read_or(a.lr_ptr, a.lr);
    const float inv_scale = a.grad_scale != nullptr ? 1.f / *a.grad_scale : 1.f;
#pragma unroll
    for (int k = 0; k < kILP; ++k) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        float gr = __fmul_rn(rg[k][j], inv_scale);
        if (a.maximize) gr = -gr;
        if (a.weight_decay != 0.f) gr = __fadd_rn(gr, __fmul_rn(a.weight_decay, rw[k][j]));
        if (a.has_momentum) {
          const float b =
              first ? gr : __fadd_rn(__fmul_rn(a.momentum, rb[k][j]), __fmul_rn(a.one_minus_dampening, gr));
          rb[k][j] = b;
          gr = a.nesterov ? __fadd_rn(gr, __fmul_rn(a.momentum, b)) : b;
        }
        rw[k][j] = __fsub_rn(rw[k][j], __fmul_rn(lr, gr));
      }
    }
    if (MASTER) store_frag<FULL>(master, rw, n, vec);
    if constexpr (SR)
      mpt_sr::store_frag_sr<FULL>(p, rw, n, vec, off, sr.seed, static_cast<uint32_t>(count) + 1u,
                                  sr.tensor_offset + static_cast<uint32_t>(meta.tensor_base + t));
    else
      store_frag<FULL>(p, rw, n, vec);
    if (a.has_momentum) store_frag<FULL>(buf, rb, n, vec);
  }
};

SgdArgs sgd_args(const at::Device& device, double lr, const std::optional<at::Tensor>& lr_tensor, double momentum,
                 double dampening, double weight_decay, bool nesterov, bool maximize,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                 const char* name) {
  SgdArgs a;
  a.lr = static_cast<float>(lr);
  a.lr_ptr = scalar_ptr(lr_tensor, device, name, "lr");
  a.momentum = static_cast<float>(momentum);
  a.one_minus_dampening = static_cast<float>(1.0 - dampening);
  a.weight_decay = static_cast<float>(weight_decay);
  a.has_momentum = momentum != 0.0;
  a.nesterov = nesterov;
  a.maximize = maximize;
  a.grad_scale = scalar_ptr(grad_scale, device, name, "grad_scale");
  a.found_inf = scalar_ptr(found_inf, device, name, "found_inf");
  return a;
}

void multi_tensor_sgd(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& steps,
                      const std::vector<at::Tensor>& masters, double lr, const std::optional<at::Tensor>& lr_tensor,
                      double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  static const char* name = "multi_tensor_sgd";
  if (params.empty()) return;
  const SgdArgs a = sgd_args(params[0].device(), lr, lr_tensor, momentum, dampening, weight_decay, nesterov, maximize,
                             grad_scale, found_inf, name);
  const at::ScalarType pt = params[0].scalar_type();
  const bool master = !masters.empty();
  check_dtype(grads, pt, name, "grads");
  check_dtype(steps, at::kFloat, name, "steps");
  if (a.has_momentum) {
    check_dtype(momentum_buffers, master ? at::kFloat : pt, name, "momentum_buffers");
  } else {
    MPT_CHECK(momentum_buffers.empty(), name, ": momentum is 0, pass an empty momentum_buffers list");
  }
  if (!master) {
    // Without momentum the buffer list is the params again; the op never touches it.
    const std::vector<at::Tensor>& bufs = a.has_momentum ? momentum_buffers : params;
    MPT_DISPATCH_FLOAT_HALF_BF16(pt, name, T,
      multi_tensor_apply<4>({grads, params, bufs, steps}, 1u << 3, SgdOp<T, T, T, false>{a}, name));
  } else {
    MPT_CHECK(pt == at::kHalf || pt == at::kBFloat16, name,
                ": master weights are for float16/bfloat16 params, got ", pt,
                "; pass an empty master list for float32 params");
    check_dtype(masters, at::kFloat, name, "masters");
    // Without momentum the buffer list is the masters again (same dtype, same
    // instantiation); the op never touches it.
    const std::vector<at::Tensor>& bufs = a.has_momentum ? momentum_buffers : masters;
    if (pt == at::kHalf)
      multi_tensor_apply<5>({grads, params, bufs, steps, masters}, 1u << 3,
                            SgdOp<at::Half, at::Half, float, true>{a}, name);
    else
      multi_tensor_apply<5>({grads, params, bufs, steps, masters}, 1u << 3,
                            SgdOp<at::BFloat16, at::BFloat16, float, true>{a}, name);
  }
  step_increment(steps, a.found_inf, name);
}

// bf16 params and grads, fp32 momentum buffers, no master: the weight is written with stochastic rounding.
void multi_tensor_sgd_sr(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& steps,
                         double lr, const std::optional<at::Tensor>& lr_tensor, double momentum, double dampening,
                         double weight_decay, bool nesterov, bool maximize, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, int64_t seed, int64_t tensor_offset) {
  static const char* name = "multi_tensor_sgd_sr";
  if (params.empty()) return;
  const SgdArgs a = sgd_args(params[0].device(), lr, lr_tensor, momentum, dampening, weight_decay, nesterov, maximize,
                             grad_scale, found_inf, name);
  if (!a.has_momentum)
    MPT_CHECK(momentum_buffers.empty(), name, ": momentum is 0, pass an empty momentum_buffers list");
  check_sr_lists(grads, params, momentum_buffers, {}, steps, tensor_offset, name);
  const mpt_sr::SrArgs sr{static_cast<uint64_t>(seed), static_cast<uint32_t>(tensor_offset)};
  // Without momentum the buffer list is the params again; the op never touches it.
  const std::vector<at::Tensor>& bufs = a.has_momentum ? momentum_buffers : params;
  if (a.has_momentum)
    multi_tensor_apply<4>({grads, params, bufs, steps}, 1u << 3,
                          SgdOp<at::BFloat16, at::BFloat16, float, false, true>{a, sr}, name);
  else  // the stand-in list is bf16: an instantiation whose buffer type matches it (never read)
    multi_tensor_apply<4>({grads, params, bufs, steps}, 1u << 3,
                          SgdOp<at::BFloat16, at::BFloat16, at::BFloat16, false, true>{a, sr}, name);
  step_increment(steps, a.found_inf, name);
}

}  // namespace mpt_mt

void multi_tensor_sgd(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& steps,
                      const std::vector<at::Tensor>& masters, double lr, const std::optional<at::Tensor>& lr_tensor,
                      double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  mpt_mt::multi_tensor_sgd(grads, params, momentum_buffers, steps, masters, lr, lr_tensor, momentum, dampening,
                           weight_decay, nesterov, maximize, grad_scale, found_inf);
}

void multi_tensor_sgd_sr(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& steps,
                         double lr, const std::optional<at::Tensor>& lr_tensor, double momentum, double dampening,
                         double weight_decay, bool nesterov, bool maximize, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, int64_t seed, int64_t tensor_offset) {
  mpt_mt::multi_tensor_sgd_sr(grads, params, momentum_buffers, steps, lr, lr_tensor, momentum, dampening, weight_decay,
                              nesterov, maximize, grad_scale, found_inf, seed, tensor_offset);
}
