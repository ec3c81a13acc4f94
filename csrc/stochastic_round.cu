// Stochastic rounding of a float32 tensor to bfloat16 (torch.ops.mptrain.stochastic_round): the
// rounding the bf16-sr optimizer steps apply to the new weight (stochastic_round.cuh), as an op
// of its own, so the random bits and the rounding can be checked against the CPU reference on
// any values, and a weight can be rounded the way a step would round it.
//
// Memory-bound: each thread takes groups of 4 elements (one Philox call, one 16-byte load,
// one 8-byte store) on a grid-stride loop.
#include "stochastic_round.cuh"

namespace {

__global__ void stochastic_round_kernel(const float* __restrict__ x, at::BFloat16* __restrict__ y, int64_t n,
                                        uint64_t seed, uint32_t step, uint32_t tensor) {
  const int64_t groups = (n + 3) / 4;
  const bool vec = (reinterpret_cast<uintptr_t>(x) % 16 == 0) && (reinterpret_cast<uintptr_t>(y) % 8 == 0);
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < groups;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const mpt_sr::Words w = mpt_sr::random_words(seed, step, tensor, static_cast<uint64_t>(q));
    const int64_t e = 4 * q;
    if (vec && e + 4 <= n) {
      const float4 v = *reinterpret_cast<const float4*>(x + e);
      mpt_mt::Pack<at::BFloat16, 4> pk;
      pk.v[0] = mpt_sr::round_bf16(v.x, w.x);
      pk.v[1] = mpt_sr::round_bf16(v.y, w.y);
      pk.v[2] = mpt_sr::round_bf16(v.z, w.z);
      pk.v[3] = mpt_sr::round_bf16(v.w, w.w);
      *reinterpret_cast<mpt_mt::Pack<at::BFloat16, 4>*>(y + e) = pk;
    } else {
      for (int j = 0; j < 4 && e + j < n; ++j) y[e + j] = mpt_sr::round_bf16(x[e + j], mpt_sr::word(w, j));
    }
  }
}

}  // namespace

at::Tensor stochastic_round(const at::Tensor& x, int64_t seed, int64_t step, int64_t tensor) {
  static const char* name = "mptrain::stochastic_round";
  MPT_CHECK(x.is_cuda(), name, ": expected a CUDA tensor, got ", x.device());
  MPT_CHECK(x.scalar_type() == at::kFloat, name, ": expected float32 input, got ", x.scalar_type());
  MPT_CHECK(step >= 0 && step < (int64_t{1} << 32) && tensor >= 0 && tensor < (int64_t{1} << 32), name,
            ": step and tensor must lie in [0, 2^32), got step=", step, ", tensor=", tensor);
  const at::Tensor src = x.is_non_overlapping_and_dense() ? x : x.contiguous();
  at::Tensor y = at::empty_like(src, src.options().dtype(at::kBFloat16));  // same strides: same memory order
  const int64_t n = src.numel();
  if (n == 0) return y;
  const c10::cuda::CUDAGuard guard(src.device());
  const int64_t groups = (n + 3) / 4;
  static const int64_t resident = mpt::resident_blocks(stochastic_round_kernel, mpt_mt::kBlock);
  const int64_t need = (groups + mpt_mt::kBlock - 1) / mpt_mt::kBlock;
  const int grid = static_cast<int>(need < resident ? need : resident);
  stochastic_round_kernel<<<grid, mpt_mt::kBlock, 0, at::cuda::getCurrentCUDAStream()>>>(
      src.data_ptr<float>(), reinterpret_cast<at::BFloat16*>(y.data_ptr()), n, static_cast<uint64_t>(seed),
      static_cast<uint32_t>(step), static_cast<uint32_t>(tensor));
  MPT_CHECK_LAUNCH(name);
  return y;
}
