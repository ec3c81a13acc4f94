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
// One `Session` per op: the handle fetch and the math-mode set / reset happen once per
// op, not once per GEMM (host time; see Session).
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

#include "check.h"
#include "new_tensor.h"

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
  MPT_CHECK(s == CUBLAS_STATUS_SUCCESS, op, ": ", what, " failed: ", cublasGetStatusString(s), " (status ",
              static_cast<int>(s), ")");
}

// Row stride as cuBLAS sees it, or -1 when t is not rows-of-unit-stride cuBLAS can read.
inline int64_t row_ld(const at::Tensor& t) {
  if (t.dim() != 2) return -1;
  if (t.size(1) > 1 && t.stride(1) != 1) return -1;
  if (t.size(0) <= 1) return std::max<int64_t>(t.size(1), 1);  // one row: its stride is never used
  return t.stride(0) >= std::max<int64_t>(t.size(1), 1) ? t.stride(0) : -1;
}

// The GEMMs of one op (a cell step's 2 forward / up to 4 backward GEMMs, a layer's
// loop). Why a session: getCurrentCUDABlasHandle (device and pool lookups, stream and
// workspace binding) and the math-mode set / reset cost host time on every GEMM, and a
// host-bound LSTM step makes several. The session decides the direct path once, fetches
// the handle and sets the math mode at its first direct GEMM, and restores
// CUBLAS_DEFAULT_MATH once in its destructor (also when a check throws), which is the
// state torch leaves the handle in after its own 16-bit GEMMs. Every cuBLAS argument is
// the one the per-GEMM code used, so the kernels and the bits are unchanged.
// Use from one thread, on one device and stream (construct it after the device guard).
class Session {
 public:
  Session(at::ScalarType dtype, const char* op) : dtype_(dtype), op_(op), direct_(direct_ok(dtype)) {}
  ~Session() {
    if (mode_set_) cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH);  // no throw from a destructor
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Whether this op's dtype and torch's settings allow direct cuBLAS (direct_ok).
  bool direct() const { return direct_; }

  // C (M x N) = op(A) op(B) + beta C, every matrix row-major with row stride ld*.
  // A is stored (M x K), or (K x M) when trans_a; B is (K x N), or (N x K) when trans_b.
  // Only when direct(); sizes and leading dimensions within int range (caller checked).
  void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
            const void* B, int64_t ldb, float beta, void* C, int64_t ldc) {
    MPT_CHECK(direct_, op_, ": internal error: direct GEMM on a session that may not call cuBLAS directly");
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
      MPT_CHECK(v <= INT_MAX, op_, ": GEMM size ", v, " exceeds cuBLAS's int range (internal error: the caller "
                  "should have used the ATen path)");
    const float alpha = 1.f;
    const cudaDataType_t t = dtype_ == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
    cublasHandle_t handle = ready();
    check_status(cublasGemmEx(handle, op_first, op_second, static_cast<int>(m), static_cast<int>(n),
                              static_cast<int>(k), &alpha, B, t, static_cast<int>(ld_first), A, t,
                              static_cast<int>(ld_second), &beta, C, t, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT_TENSOR_OP),
                 "cublasGemmEx", op_);
  }

  // out (M x N) = op(a) op(b) + beta * out, out pre-allocated (any row stride). Direct
  // cuBLAS when the session and these tensors allow it, else at::mm_out / addmm_
  // (identical result, more host work). Returns whether cuBLAS was called directly.
  bool mm(at::Tensor& out, const at::Tensor& a, bool trans_a, const at::Tensor& b, bool trans_b, float beta) {
    const int64_t M = out.size(0), N = out.size(1), K = trans_a ? a.size(0) : a.size(1);
    MPT_CHECK((trans_a ? a.size(1) : a.size(0)) == M && (trans_b ? b.size(1) : b.size(0)) == K &&
                    (trans_b ? b.size(0) : b.size(1)) == N,
                op_, ": internal error: GEMM shapes ", a.sizes(), trans_a ? "^T" : "", " x ", b.sizes(),
                trans_b ? "^T" : "", " -> ", out.sizes(), " do not match");
    const int64_t lda = row_ld(a), ldb = row_ld(b), ldc = row_ld(out);
    if (direct_ && out.scalar_type() == dtype_ && M > 0 && N > 0 && K > 0 && lda > 0 && ldb > 0 && ldc > 0 &&
        std::max({M, N, K, lda, ldb, ldc}) <= INT_MAX) {
      gemm(trans_a, trans_b, M, N, K, a.data_ptr(), lda, b.data_ptr(), ldb, beta, out.data_ptr(), ldc);
      return true;
    }
    const at::Tensor A = trans_a ? a.t() : a, B = trans_b ? b.t() : b;
    // torch fetches the handle itself and leaves the math mode at its default: our next
    // direct GEMM must fetch and set again.
    release();
    if (beta == 0.f)
      at::mm_out(out, A, B);
    else
      out.addmm_(A, B, beta, 1);
    return false;
  }

  // A new (M x N) = op(a) op(b) (CUDA tensors; every element is written).
  at::Tensor mm_new(const at::Tensor& a, bool trans_a, const at::Tensor& b, bool trans_b) {
    at::Tensor out = new_cuda({trans_a ? a.size(1) : a.size(0), trans_b ? b.size(0) : b.size(1)}, a);
    mm(out, a, trans_a, b, trans_b, 0.f);
    return out;
  }

 private:
  // torch's handle for the current device and stream (its workspace bound: graph capture
  // works as for at::mm), with the math mode torch sets before its own 16-bit GEMM.
  cublasHandle_t ready() {
    if (mode_set_) return handle_;
    handle_ = at::cuda::getCurrentCUDABlasHandle();
    const bool reduced = dtype_ == at::kHalf
                             ? reduced_reduction_allowed(at::globalContext().allowFP16ReductionCuBLAS())
                             : reduced_reduction_allowed(at::globalContext().allowBF16ReductionCuBLAS());
    const cublasMath_t mode = reduced ? CUBLAS_DEFAULT_MATH
                                      : static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                                                  CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
    check_status(cublasSetMathMode(handle_, mode), "cublasSetMathMode", op_);
    mode_set_ = true;
    return handle_;
  }

  void release() {
    if (mode_set_) cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH);
    mode_set_ = false;
  }

  at::ScalarType dtype_;
  const char* op_;
  bool direct_;
  bool mode_set_ = false;
  cublasHandle_t handle_ = nullptr;
};

}  // namespace blas
}  // namespace mpt
