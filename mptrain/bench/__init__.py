"""Benchmarks: GEMM, kernels and end-to-end steps (`mptrain bench ...`)."""
