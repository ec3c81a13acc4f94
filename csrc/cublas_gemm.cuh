// Row-major GEMM on torch's cuBLAS handle, for host-bound callers (the LSTM step).
//
// Why: at::mm / addmm_ / mm_out cost ~10-12 us of host time each (dispatcher, output
// checks and resizing, operand preparation) before the ~3 us cuBLAS call itself; an LSTM
// cell step makes 6 of them, and a layer makes one per time step. For 16-bit tensors
// we make the call at::mm would make -- same handle (current stream and torch's
// workspace, so CUDA-graph capture works as for at::mm), cublasGemmEx, CUBLAS_COMPUTE_32F,
// CUBLAS_GEMM_DEFAULT_TENSOR_OP, the math mode torch sets for that dtype -- so the GPU
// kernels and the numerics are those of at::mm, without its host work.
//
// Whenever torch would take a different route for the same product (fp32 and TF32
// settings, cuBLASLt or TunableOp preferred, deterministic mode, fp16 accumulation,
// split-K disallowed, sizes beyond int32, strides cuBLAS cannot take), the helpers fall
// back to the ATen call, so results never depend on which path ran.
//
// Row-major trick: cuBLAS is column-major, and a row-major (r x c) matrix with row stride
// ld is, read column-major, its transpose (c x r) with leading dimension ld. So
// C = op(A) op(B) (row-major) is computed as C^T = op(B)^T op(A)^T: operands swapped,
// m <-> n, each operand's transpose flag kept as is.
#pragma once
#include <ATen/ATen.h>
#include <ATen/BlasBackend.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/tunable/Tunable.h>
#include <cublas_v2.h>

#include <algorithm>
#include <climits>
#include <type_traits>

namespace mpt {
namespace blas {

// torch <= 2.8 reports "reduced-precision reduction allowed" as a bool, later torch as
// an enum that also says whether split-K is allowed; if constexpr keeps both compiling.
template <typename Opt>
inline bool reduced_reduction_allowed(Opt opt) {
  if constexpr (std::is_same_v<Opt, bool>) {
    return opt;
  } else {
    return opt == Opt::AllowReducedPrecisionWithSplitK;
  }
}

template <typename Opt>
inline bool splitk_disallowed(Opt opt) {
  if constexpr (std::is_same_v<Opt, bool>) {
    return false;
  } else {
    return opt == Opt::DisallowReducedPrecisionDisallowSplitK;  // torch sends those to cuBLASLt
  }
}

// fp16 accumulation (torch >= 2.7) makes at::mm use a 16-bit compute type: not ours.
template <typename Ctx>
inline auto fp16_accumulation(Ctx& ctx, int) -> decltype(ctx.allowFP16AccumulationCuBLAS()) {
  return ctx.allowFP16AccumulationCuBLAS();
}
template <typename Ctx>
inline bool fp16_accumulation(Ctx&, long) {
  return false;
}

// Whether a GEMM of this dtype may go straight to cublasGemmEx with at::mm's numerics
// under the current global settings. Cheap (a few flag reads): evaluate once per op.
inline bool direct_ok(at::ScalarType dtype) {
  if (dtype != at::kHalf && dtype != at::kBFloat16) return false;  // fp32: TF32 is torch's business
  auto& ctx = at::globalContext();
  if (ctx.blasPreferredBackend() != at::BlasBackend::Cublas) return false;
  if (ctx.deterministicAlgorithms()) return false;  // keep torch's cuBLAS-workspace checks
  if (at::cuda::tunable::getTuningContext()->IsTunableOpEnabled()) return false;
  if (dtype == at::kHalf) {
    return !fp16_accumulation(ctx, 0) && !splitk_disallowed(ctx.allowFP16ReductionCuBLAS());
  }
  return !splitk_disallowed(ctx.allowBF16ReductionCuBLAS());
}

inline void check_status(cublasStatus_t s, const char* what, const char* op) {
  TORCH_CHECK(s == CUBLAS_STATUS_SUCCESS, op, ": ", what, " failed: ", cublasGetStatusString(s), " (status ",
              static_cast<int>(s), ")");
}

// C (M x N) = alpha op(A) op(B) + beta C, every matrix row-major with row stride ld*.
// A is stored (M x K), or (K x M) when trans_a; B is (K x N), or (N x K) when trans_b.
// dtype: Half or BFloat16 for A, B and C (fp32 accumulation). Caller checked direct_ok().
inline void gemm_rm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
                    int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc,
                    at::ScalarType dtype, const char* op) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op, ": gemm_rm takes float16/bfloat16, got ", dtype);
  // Column-major problem: C^T (N x M) = op(B)^T (N x K) op(A)^T (K x M).
  const cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // B comes first
  const cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int64_t m = N, n = M, k = K;
  int64_t ld_first = ldb, ld_second = lda;
  // cuBLAS rejects a leading dimension below the stored row count even where a size-1
  // dimension means it is never used; torch raises it to the minimum there, so do we
  // (same arguments -> same cuBLAS heuristics as at::mm).
  if (n <= 1) ldc = std::max<int64_t>(m, 1);
  if (op_first == CUBLAS_OP_T ? m <= 1 : k <= 1) ld_first = std::max<int64_t>(op_first == CUBLAS_OP_T ? k : m, 1);
  if (op_second == CUBLAS_OP_T ? k <= 1 : n <= 1) ld_second = std::max<int64_t>(op_second == CUBLAS_OP_T ? n : k, 1);
  for (int64_t v : {m, n, k, ld_first, ld_second, ldc})
    TORCH_CHECK(v <= INT_MAX, op, ": GEMM size ", v, " exceeds cuBLAS's int range (internal error: the caller "
                "should have used the ATen path)");
  const cudaDataType_t t = dtype == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
  const bool reduced = dtype == at::kHalf ? reduced_reduction_allowed(at::globalContext().allowFP16ReductionCuBLAS())
                                          : reduced_reduction_allowed(at::globalContext().allowBF16ReductionCuBLAS());
  // The handle binds the current stream and torch's workspace for it (graph-capture safe).
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  // The mode torch sets before its own 16-bit cublasGemmEx, and the default it restores
  // after (torch sets the mode it needs on every call, so nothing relies on ours).
  const cublasMath_t mode = reduced ? CUBLAS_DEFAULT_MATH
                                    : static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                                                CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
  check_status(cublasSetMathMode(handle, mode), "cublasSetMathMode", op);
  const cublasStatus_t s =
      cublasGemmEx(handle, op_first, op_second, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                   &alpha, B, t, static_cast<int>(ld_first), A, t, static_cast<int>(ld_second), &beta, C, t,
                   static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP);
  cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH);  // restore first, then report the GEMM's status
  check_status(s, "cublasGemmEx", op);
}

// Row stride as cuBLAS sees it, or -1 when t is not rows-of-unit-stride cuBLAS can read.
inline int64_t row_ld(const at::Tensor& t) {
  if (t.dim() != 2) return -1;
  if (t.size(1) > 1 && t.stride(1) != 1) return -1;
  if (t.size(0) <= 1) return std::max<int64_t>(t.size(1), 1);  // one row: its stride is never used
  return t.stride(0) >= std::max<int64_t>(t.size(1), 1) ? t.stride(0) : -1;
}

// out (M x N) = op(a) op(b) + beta * out, out pre-allocated (any row stride).
// direct: the caller's direct_ok(dtype) for this op. Falls back to at::mm_out / addmm_
// (identical result, more host work) when cuBLAS cannot take these tensors directly.
// Returns whether cuBLAS was called directly.
inline bool mm_rm(at::Tensor& out, const at::Tensor& a, bool trans_a, const at::Tensor& b, bool trans_b, float beta,
                  bool direct, const char* op) {
  const int64_t M = out.size(0), N = out.size(1), K = trans_a ? a.size(0) : a.size(1);
  TORCH_CHECK((trans_a ? a.size(1) : a.size(0)) == M && (trans_b ? b.size(1) : b.size(0)) == K &&
                  (trans_b ? b.size(0) : b.size(1)) == N,
              op, ": internal error: GEMM shapes ", a.sizes(), trans_a ? "^T" : "", " x ", b.sizes(),
              trans_b ? "^T" : "", " -> ", out.sizes(), " do not match");
  const int64_t lda = row_ld(a), ldb = row_ld(b), ldc = row_ld(out);
  if (direct && M > 0 && N > 0 && K > 0 && lda > 0 && ldb > 0 && ldc > 0 &&
      std::max({M, N, K, lda, ldb, ldc}) <= INT_MAX) {
    gemm_rm(trans_a, trans_b, M, N, K, 1.f, a.data_ptr(), lda, b.data_ptr(), ldb, beta, out.data_ptr(), ldc,
            out.scalar_type(), op);
    return true;
  }
  const at::Tensor A = trans_a ? a.t() : a, B = trans_b ? b.t() : b;
  if (beta == 0.f)
    at::mm_out(out, A, B);
  else
    out.addmm_(A, B, beta, 1);
  return false;
}

// A new (M x N) = op(a) op(b).
inline at::Tensor mm_new(const at::Tensor& a, bool trans_a, const at::Tensor& b, bool trans_b, bool direct,
                         const char* op) {
  auto out = at::empty({trans_a ? a.size(1) : a.size(0), trans_b ? b.size(0) : b.size(1)}, a.options());
  mm_rm(out, a, trans_a, b, trans_b, 0.f, direct, op);
  return out;
}

}  // namespace blas
}  // namespace mpt
