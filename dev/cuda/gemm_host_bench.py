"""Lab (not shipped): host time of one 16-bit GEMM by API, at the LSTM cell's GEMM shapes, on the
GPU machine.  Why: the cell's fwd+bwd is host-bound and makes 6 GEMMs; torch.profiler showed
cuBLAS's own host work at ~20-45 us per GEMM there (docs/kernels/lstm.md).  Compares, per
shape, enqueue-only host us per call (interleaved rounds, best of 5):

* ``torch.mm(out=)`` (cuBLAS, torch's default) and with ``preferred_blas_library("cublaslt")``;
* ``cublasGemmEx`` called directly (what csrc/cublas_gemm.cuh does);
* ``cublasLtMatmul`` with the plan made once (descriptors + the heuristic's first algorithm),
  and what that one-off heuristic query costs;

and whether each result is bitwise torch.mm's; then the three shapes in turn, alone and with a small
ATen kernel launched between GEMMs (a cell step's pattern), for torch.mm and cublasGemmEx; then a
cell backward's GEMM pairs as two calls or one strided-batched call (host us, bitwise or not).

    python3 dev/cuda/gemm_host_bench.py [--iters 200]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.cpp_extension import load

from mptrain.ops.build import _extra_include_dirs, _loaded_cublas, find_cuda_home

HERE = os.path.dirname(os.path.abspath(__file__))


def _ldflags():
    """torch's own libcublas / libcublasLt (loaded by file name, as mptrain.ops.build links cuBLAS):
    one copy of each in the process, so torch's handles are valid for our calls."""
    torch.mm(torch.ones(2, 2, device="cuda"), torch.ones(2, 2, device="cuda"))  # loads cuBLAS
    lib = _loaded_cublas()
    if lib is None:
        return ["-lcublasLt", "-lcublas"]
    lt = lib.name.replace("libcublas", "libcublasLt")
    return [f"-L{lib.parent}", f"-l:{lib.name}", f"-l:{lt}"]


def host_us(fn, iters):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    return t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=200)
    a = p.parse_args()
    ext = load("gemm_host", [os.path.join(HERE, "gemm_host.cpp")], extra_ldflags=_ldflags(),
               extra_include_paths=_extra_include_dirs(find_cuda_home()), with_cuda=True, verbose=False)
    bf = torch.bfloat16
    print(f"{'gemm':<28} {'torch.mm':>9} {'mm(Lt)':>9} {'GemmEx':>9} {'Lt plan':>9} {'heur':>7}  bitwise(GemmEx, Lt)")
    for rows, hid in ((4, 32), (256, 1024), (1024, 1024)):
        x = torch.randn(rows, hid, device="cuda", dtype=bf)
        W = torch.randn(4 * hid, hid, device="cuda", dtype=bf)
        g = torch.randn(rows, 4 * hid, device="cuda", dtype=bf)
        # (name, torch call writing out, out, gemm args: A, B, ta, tb, m, n, k) -- column-major views
        cases = [
            ("fwd x@W^T", lambda o: torch.mm(x, W.t(), out=o), torch.empty(rows, 4 * hid, device="cuda", dtype=bf),
             (W, x, True, False, 4 * hid, rows, hid)),
            ("dx g@W", lambda o: torch.mm(g, W, out=o), torch.empty(rows, hid, device="cuda", dtype=bf),
             (W, g, False, False, hid, rows, 4 * hid)),
            ("dW g^T@x", lambda o: torch.mm(g.t(), x, out=o), torch.empty(4 * hid, hid, device="cuda", dtype=bf),
             (x, g, False, True, hid, 4 * hid, rows)),
        ]
        for name, mm, out, (A, B, ta, tb, m, n, k) in cases:
            ref = mm(torch.empty_like(out)).clone()
            c1, c2 = torch.empty_like(out), torch.empty_like(out)
            ext.gemmex(A, B, c1, ta, tb, m, n, k, 0.0, 1)
            ext.lt(A, B, c2, ta, tb, m, n, k, 0.0, 1)
            torch.cuda.synchronize()
            same = (torch.equal(c1, ref), torch.equal(c2, ref))
            best = [float("inf")] * 4
            heur = float("inf")
            for _ in range(5):
                best[0] = min(best[0], host_us(lambda: mm(out), a.iters))
                torch.backends.cuda.preferred_blas_library("cublaslt")
                best[1] = min(best[1], host_us(lambda: mm(out), a.iters))
                torch.backends.cuda.preferred_blas_library("cublas")
                torch.cuda.synchronize()
                best[2] = min(best[2], ext.gemmex(A, B, out, ta, tb, m, n, k, 0.0, a.iters))
                torch.cuda.synchronize()
                per, h, _setup = ext.lt(A, B, out, ta, tb, m, n, k, 0.0, a.iters)
                best[3], heur = min(best[3], per), min(heur, h)
            print(f"{name + f' {rows}x{hid}':<28} " + " ".join(f"{v:9.2f}" for v in best) + f" {heur:7.1f}  {same}")
        rotating(ext, cases, rows, hid, a.iters)
        pairs(ext, rows, hid, a.iters)


def pairs(ext, rows, hid, iters):
    """A cell backward's GEMM pairs (dx, dh = dgates W_ih, dgates W_hh; dW_ih, dW_hh = dgates^T x, dgates^T h)
    as two cublasGemmEx calls or one strided-batched call: host us per pair, and whether the batched results
    are bitwise the separate ones (and torch.mm's).  Each pair's operands share one buffer ([2, ...], a
    positive fixed stride), the layout a shipped version would need (weights flattened as for cuDNN; x and h
    copied side by side): with separately allocated operands (any offset between them) the batched call
    faulted at 1024x1024 (illegal address)."""
    bf = torch.bfloat16
    xh = torch.randn(2, rows, hid, device="cuda", dtype=bf)
    w = torch.randn(2, 4 * hid, hid, device="cuda", dtype=bf)
    g = torch.randn(rows, 4 * hid, device="cuda", dtype=bf)
    x, h, w_ih, w_hh = xh[0], xh[1], w[0], w[1]
    # (name, column-major (A1, A2, B1, B2, ta, tb, m, n, k), output pair shape, torch references)
    specs = [("dx,dh", (w_ih, w_hh, g, g, False, False, hid, rows, 4 * hid), (2, rows, hid), (g @ w_ih, g @ w_hh)),
             ("dW_ih,dW_hh", (x, h, g, g, False, True, hid, 4 * hid, rows), (2, 4 * hid, hid), (g.t() @ x, g.t() @ h))]
    for name, (a1, a2, b1, b2, ta, tb, m, n, k), shape, refs in specs:
        out2 = torch.empty(shape, device="cuda", dtype=bf)
        sep = [torch.empty(shape[1:], device="cuda", dtype=bf) for _ in range(2)]
        ext.gemmex_pair(a1, a2, b1, b2, out2, ta, tb, m, n, k, 1)
        ext.gemmex(a1, b1, sep[0], ta, tb, m, n, k, 0.0, 1)
        ext.gemmex(a2, b2, sep[1], ta, tb, m, n, k, 0.0, 1)
        torch.cuda.synchronize()
        bitwise = all(torch.equal(out2[i], sep[i]) for i in range(2)), all(torch.equal(sep[i], refs[i]) for i in range(2))
        best_sep = best_pair = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t = ext.gemmex(a1, b1, sep[0], ta, tb, m, n, k, 0.0, iters) + ext.gemmex(a2, b2, sep[1], ta, tb, m, n, k,
                                                                                     0.0, iters)
            best_sep = min(best_sep, t)
            torch.cuda.synchronize()
            best_pair = min(best_pair, ext.gemmex_pair(a1, a2, b1, b2, out2, ta, tb, m, n, k, iters))
        torch.cuda.synchronize()
        print(f"{f'{name} {rows}x{hid}':<28} two GemmEx {best_sep:.2f} us, one strided-batched {best_pair:.2f} us; "
              f"batched == separate: {bitwise[0]}, separate == torch.mm: {bitwise[1]}")


def rotating(ext, cases, rows, hid, iters):
    """The three shapes in turn (a cell step's pattern): us per GEMM for torch.mm and cublasGemmEx, alone
    and with a small ATen kernel (a fill) launched between GEMMs."""
    problems = [(*args[:2], out, *args[2:]) for _, _, out, args in cases]
    scratch = torch.empty(rows, hid, device="cuda", dtype=torch.bfloat16)
    mms = [lambda mm=mm, out=out: mm(out) for _, mm, out, _ in cases]

    def torch_rot(fill):
        def fn():
            for f in mms:
                f()
                if fill:
                    scratch.zero_()
        return fn

    best = [float("inf")] * 4
    fill_py = fill_cpp = float("inf")
    for _ in range(5):
        fill_py = min(fill_py, host_us(scratch.zero_, iters))
        torch.cuda.synchronize()
        fill_cpp = min(fill_cpp, ext.fill_loop(scratch, iters))
        torch.cuda.synchronize()
        best[0] = min(best[0], host_us(torch_rot(False), iters) / len(mms))
        best[1] = min(best[1], host_us(torch_rot(True), iters) / len(mms))
        torch.cuda.synchronize()
        best[2] = min(best[2], ext.gemmex_rotating(problems, iters, None))
        torch.cuda.synchronize()
        best[3] = min(best[3], ext.gemmex_rotating(problems, iters, scratch))
        torch.cuda.synchronize()
    print(f"{f'3 shapes in turn {rows}x{hid}':<28} torch.mm {best[0]:.2f}, with a fill between {best[1]:.2f}; "
          f"GemmEx {best[2]:.2f}, with a fill between {best[3]:.2f} us per GEMM (a fill alone: "
          f"{fill_py:.2f} us from Python, {fill_cpp:.2f} from C++)")


if __name__ == "__main__":
    main()
