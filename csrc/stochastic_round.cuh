// Stochastic rounding of fp32 values to bf16 from a counter-based generator (the bf16-sr
// precision mode: the optimizer kernels write the bf16 weight this way, with no fp32 master).
//
// Why counter-based: the random bits of an element are a pure function of
// (seed, step, tensor index, element index), so a run is reproducible from its seed, every
// DDP rank (same seed) rounds identically and the replicas never drift, a resume continues
// the stream exactly (the step count is in the optimizer state), and no generator state has
// to live on the device or be advanced between launches (CUDA graphs capture the step as is).
//
// Generator: Philox-4x32-10 (Salmon et al., SC'11; Random123's constants, checked against its
// known-answer vectors in tests/ops/test_stochastic_round.py). Layout:
//   key     = (seed & 0xffffffff, step)
//   counter = (q & 0xffffffff, q >> 32, tensor, seed >> 32)   with q = element / 4
// one call gives the four 32-bit words of elements 4q .. 4q+3; element e uses the low 16 bits
// of word e % 4. The element index is the position in the tensor's memory order. The step is
// the optimizer step being taken (the step count before the increment, plus one).
//
// Rounding: add the 16 random bits to the low 16 bits of x's bit pattern and truncate to the
// upper 16 bits. x rounds away from zero with probability (|x| - |trunc(x)|) / ulp, so the
// expectation is x (unbiased) for every finite x whose rounding stays finite. inf stays inf;
// NaN stays NaN (its quiet bit is set: truncation alone could turn a NaN with only low
// mantissa bits into inf). mptrain/ops/reference.py implements the same bits in PyTorch.
#pragma once
#include <cstdint>

#include "multi_tensor_apply.cuh"

namespace mpt_sr {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1

struct Words {
  uint32_t x, y, z, w;
};

__host__ __device__ __forceinline__ uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t& hi) {
#ifdef __CUDA_ARCH__
  hi = __umulhi(a, b);
  return a * b;
#else
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
#endif
}

__host__ __device__ __forceinline__ Words philox4x32_10(Words c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo(kPhiloxM0, c.x, hi0);
    const uint32_t lo1 = mulhilo(kPhiloxM1, c.z, hi1);
    c = Words{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return c;
}

// What an op needs to round one tensor: the seed, the step, the tensor's index.
struct SrArgs {
  uint64_t seed;
  uint32_t tensor_offset;  // added to the tensor's position in the list (distinct ids per group)
};

// The four words of elements 4q .. 4q+3.
__host__ __device__ __forceinline__ Words random_words(uint64_t seed, uint32_t step, uint32_t tensor, uint64_t q) {
  return philox4x32_10(Words{static_cast<uint32_t>(q), static_cast<uint32_t>(q >> 32), tensor,
                             static_cast<uint32_t>(seed >> 32)},
                       static_cast<uint32_t>(seed), step);
}

// The bf16 bit pattern of x rounded with the random word r (its low 16 bits are used).
__host__ __device__ __forceinline__ uint16_t round_bits(uint32_t u, uint32_t r) {
  if ((u & 0x7F800000u) == 0x7F800000u)  // inf: exact; NaN: quiet NaN of the same sign
    return static_cast<uint16_t>((u >> 16) | ((u & 0x007FFFFFu) ? 0x0040u : 0u));
  return static_cast<uint16_t>((u + (r & 0xFFFFu)) >> 16);
}

__device__ __forceinline__ at::BFloat16 round_bf16(float x, uint32_t r) {
  return at::BFloat16(round_bits(__float_as_uint(x), r), at::BFloat16::from_bits());
}

__device__ __forceinline__ uint32_t word(const Words& w, int j) {
  return j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
}

// store_frag (multi_tensor_apply.cuh) with stochastic rounding: the thread's ILP x V elements
// of a chunk starting at element `off` of tensor `tensor` (off and every group start are
// multiples of 4, so each 4 elements take one Philox call).
template <bool FULL, int ILP, int V>
__device__ __forceinline__ void store_frag_sr(at::BFloat16* p, const float (&r)[ILP][V], int n, bool vec,
                                              int64_t off, uint64_t seed, uint32_t step, uint32_t tensor) {
  static_assert(V % 4 == 0, "stochastic rounding draws 4 elements per Philox call");
#pragma unroll
  for (int k = 0; k < ILP; ++k) {
    const int i = mpt_mt::group_start<V>(k);
    if (!FULL && !(i < n)) continue;  // the whole group lies past the end: no draw
    mpt_mt::Pack<at::BFloat16, V> pk;
#pragma unroll
    for (int h = 0; h < V / 4; ++h) {
      const Words w = random_words(seed, step, tensor, static_cast<uint64_t>(off + i) / 4 + h);
#pragma unroll
      for (int j = 0; j < 4; ++j) pk.v[4 * h + j] = round_bf16(r[k][4 * h + j], word(w, j));
    }
    if (FULL || (vec && i + V <= n)) {
      *reinterpret_cast<mpt_mt::Pack<at::BFloat16, V>*>(p + i) = pk;
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (i + j < n) p[i + j] = pk.v[j];
    }
  }
}

}  // namespace mpt_sr

namespace mpt_mt {

// The lists of a stochastic-rounding step: bf16 params and grads, fp32 state buffers (either
// list may be empty: SGD without momentum has none), fp32 step counts, tensor ids that fit 32 bits.
inline void check_sr_lists(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                           const std::vector<at::Tensor>& buf1, const std::vector<at::Tensor>& buf2,
                           const std::vector<at::Tensor>& steps, int64_t tensor_offset, const char* name) {
  MPT_CHECK(params[0].scalar_type() == at::kBFloat16, name, ": stochastic rounding writes bfloat16 params, got ",
            params[0].scalar_type());
  check_dtype(params, at::kBFloat16, name, "params");
  check_dtype(grads, at::kBFloat16, name, "grads");
  check_dtype(buf1, at::kFloat, name, "state buffers");
  check_dtype(buf2, at::kFloat, name, "state buffers");
  check_dtype(steps, at::kFloat, name, "steps");
  MPT_CHECK(tensor_offset >= 0 && tensor_offset + static_cast<int64_t>(params.size()) <= (int64_t{1} << 32), name,
            ": tensor_offset=", tensor_offset, " must be >= 0 and leave every tensor id below 2^32");
}

}  // namespace mpt_mt
