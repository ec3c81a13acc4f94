// Lab (not shipped): host time of one 16-bit GEMM call by API, for the host-bound LSTM cell.
// Built by dev/cuda/gemm_host_bench.py (torch.utils.cpp_extension.load).  Each function
// loops `iters` calls of one column-major GEMM C (m x n) = op(A) op(B) on torch's current
// stream and returns the host microseconds per call (enqueue only: no sync inside the
// loop; the caller syncs before and after).
//  * gemmex: cublasGemmEx on torch's cuBLAS handle, as csrc/cublas_gemm.cuh calls it.
//  * lt: cublasLtMatmul with descriptors, layouts and the heuristic's first algorithm made
//    once, before the loop (what a per-shape plan cache would keep), on torch's Lt handle
//    and a 32 MiB workspace of our own.  Also returns the one-off heuristic query's time.
//  * gemmex_rotating: cublasGemmEx over several problems in turn, optionally with an ATen
//    fill launched between GEMMs: whether alternating shapes and other launches (a cell
//    step's pattern) raise cuBLAS's host time per call above the single-shape loop's.
//  * gemmex_pair: two same-shape GEMMs as one strided-batched call (each pair of operands in
//    one buffer), for batching a cell backward's GEMM pairs.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <torch/extension.h>

#include <chrono>
#include <optional>
#include <tuple>
#include <vector>
#include <stdexcept>
#include <string>

namespace {

void ok(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + ": " + cublasGetStatusString(s));
}

cudaDataType_t dt(const at::Tensor& t) { return t.scalar_type() == at::kHalf ? CUDA_R_16F : CUDA_R_16BF; }

using Clock = std::chrono::steady_clock;

double us_since(Clock::time_point t0, int64_t iters) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / double(iters);
}

// Column-major operands: A is (k x m) if ta else (m x k), B is (n x k) if tb else (k x n),
// C is (m x n).  The caller passes contiguous row-major torch tensors holding their
// transposes, so each leading dimension is the tensor's size(1).
double gemmex(at::Tensor A, at::Tensor B, at::Tensor C, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
              double beta, int64_t iters) {
  cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();
  ok(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  const float alpha = 1.f, b = float(beta);
  const int lda = int(A.size(1)), ldb = int(B.size(1)), ldc = int(C.size(1));
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    ok(cublasGemmEx(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, int(m), int(n), int(k), &alpha,
                    A.data_ptr(), dt(A), lda, B.data_ptr(), dt(B), ldb, &b, C.data_ptr(), dt(C), ldc,
                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP),
       "cublasGemmEx");
  }
  return us_since(t0, iters);
}

std::vector<double> lt(at::Tensor A, at::Tensor B, at::Tensor C, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                       double beta, int64_t iters) {
  cublasLtHandle_t h = at::cuda::getCurrentCUDABlasLtHandle();
  const size_t ws_bytes = size_t(32) << 20;
  at::Tensor ws = at::empty({int64_t(ws_bytes)}, A.options().dtype(at::kByte));
  const auto t_setup = Clock::now();
  cublasLtMatmulDesc_t desc;
  ok(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "DescCreate");
  const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)), "TRANSA");
  ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)), "TRANSB");
  cublasLtMatrixLayout_t la, lb, lc;
  ok(cublasLtMatrixLayoutCreate(&la, dt(A), ta ? k : m, ta ? m : k, A.size(1)), "layout A");
  ok(cublasLtMatrixLayoutCreate(&lb, dt(B), tb ? n : k, tb ? k : n, B.size(1)), "layout B");
  ok(cublasLtMatrixLayoutCreate(&lc, dt(C), m, n, C.size(1)), "layout C");
  cublasLtMatmulPreference_t pref;
  ok(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
  ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)),
     "workspace pref");
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const auto t_heur = Clock::now();
  ok(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 1, &res, &found), "heuristic");
  const double heur_us = us_since(t_heur, 1), setup_us = us_since(t_setup, 1);
  if (found == 0) throw std::runtime_error("no cuBLASLt algorithm");
  const float alpha = 1.f, b = float(beta);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    ok(cublasLtMatmul(h, desc, &alpha, A.data_ptr(), la, B.data_ptr(), lb, &b, C.data_ptr(), lc, C.data_ptr(), lc,
                      &res.algo, ws.data_ptr(), ws_bytes, stream),
       "cublasLtMatmul");
  }
  const double per_call = us_since(t0, iters);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  // keep the workspace alive until the queued GEMMs ran
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  return {per_call, heur_us, setup_us};
}

// Round-robin over several problems (what a cell step does: shapes alternate), optionally with
// one small ATen kernel (a fill of `scratch`) launched between GEMMs, as the step's pointwise
// kernels and allocations sit between its GEMMs.  Host us per GEMM.
double gemmex_rotating(const std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor, bool, bool, int64_t, int64_t,
                                                    int64_t>>& problems,
                       int64_t iters, std::optional<at::Tensor> scratch) {
  cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();
  ok(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  const float alpha = 1.f, b = 0.f;
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    for (const auto& [A, B, C, ta, tb, m, n, k] : problems) {
      ok(cublasGemmEx(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, int(m), int(n), int(k),
                      &alpha, A.data_ptr(), dt(A), int(A.size(1)), B.data_ptr(), dt(B), int(B.size(1)), &b,
                      C.data_ptr(), dt(C), int(C.size(1)), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP),
         "cublasGemmEx");
      if (scratch.has_value()) scratch->zero_();
    }
  }
  return us_since(t0, iters * int64_t(problems.size()));
}

// Two GEMMs of one shape as one cublasGemmStridedBatchedEx call: the operands' second
// matrices at a fixed element offset from the first (A2 - A1, B2 - B1; the bench passes
// pairs that share one buffer: with unrelated allocations the call faulted), outputs
// [2, ...] in one buffer.  What batching a cell backward's dx / dh and dW_ih / dW_hh pairs
// would be.  Host us per call of the pair.
double gemmex_pair(at::Tensor A1, at::Tensor A2, at::Tensor B1, at::Tensor B2, at::Tensor C2, bool ta, bool tb,
                   int64_t m, int64_t n, int64_t k, int64_t iters) {
  cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();
  ok(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  const float alpha = 1.f, b = 0.f;
  const int64_t es = A1.element_size();
  const long long sa = (static_cast<char*>(A2.data_ptr()) - static_cast<char*>(A1.data_ptr())) / es;
  const long long sb = (static_cast<char*>(B2.data_ptr()) - static_cast<char*>(B1.data_ptr())) / es;
  const long long sc = C2.stride(0);
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    ok(cublasGemmStridedBatchedEx(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, int(m), int(n),
                                  int(k), &alpha, A1.data_ptr(), dt(A1), int(A1.size(1)), sa, B1.data_ptr(), dt(B1),
                                  int(B1.size(1)), sb, &b, C2.data_ptr(), dt(C2), int(C2.size(2)), sc, 2,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP),
       "cublasGemmStridedBatchedEx");
  }
  return us_since(t0, iters);
}

// The fill alone, from C++: what gemmex_rotating's interleaved launch costs by itself.
double fill_loop(at::Tensor scratch, int64_t iters) {
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; ++i) scratch.zero_();
  return us_since(t0, iters);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemmex", &gemmex);
  m.def("lt", &lt);
  m.def("gemmex_rotating", &gemmex_rotating);
  m.def("fill_loop", &fill_loop);
  m.def("gemmex_pair", &gemmex_pair);
}
