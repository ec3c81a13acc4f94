"""`mptrain bench gemm`: TFLOP/s of square matmuls in each precision the GPU has.

fp32 (IEEE), tf32, fp16, bf16, int8 (``torch._int_mm``, int32 out; TOP/s) and fp8 e4m3
(``torch._scaled_mm``, bf16 out) where device and torch support them; speed-up against fp32.
Operands are random (a zero operand lets some hardware clock higher) and rotated past L2.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
from typing import Callable, Optional

import torch

from mptrain.bench.common import bench_parser, device_meta, fmt, input_sets, median_ms, write_json
from mptrain.compat import torch as compat

#: minimum compute capability per dtype (torch >= 2.6 has _int_mm, _scaled_mm and float8_e4m3fn)
MIN_CC = {"fp32": (0, 0), "tf32": (8, 0), "fp16": (7, 0), "bf16": (8, 0), "int8": (7, 5), "fp8": (8, 9)}
DTYPES = tuple(MIN_CC)
DEFAULT_SIZES = (1024, 4096, 8192)
_TORCH_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def parse_sizes(text: str) -> list[int]:
    """'1024,4096' -> [1024, 4096]; every size a positive integer."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("--sizes: no size given")
    bad = [p for p in parts if not p.isdigit() or int(p) == 0]
    if bad:
        raise ValueError(f"--sizes: {bad[0]!r} is not a positive integer (expected e.g. 1024,4096,8192)")
    return [int(p) for p in parts]


def parse_dtypes(text: str) -> list[str]:
    chosen = [d.strip() for d in text.split(",") if d.strip()]
    unknown = [d for d in chosen if d not in DTYPES]
    if unknown:
        raise ValueError(f"--dtypes: unknown {unknown}; choose from {list(DTYPES)}")
    return chosen


def gemm_flops(n: int) -> float:
    """Operations of an n x n x n matrix product (one multiply and one add per term)."""
    return 2.0 * n**3


def products_per_call(n: int, min_flops: float = 3.5e10) -> int:
    """Products per timed call: a 1024^3 bf16 product takes ~3 us on an H200, less than the
    events' resolution and the launch overhead; several per call keep the timing meaningful."""
    return max(1, min(64, int(-(-min_flops // gemm_flops(n)))))


def unsupported_reason(dtype: str, capability: Optional[tuple[int, int]]) -> Optional[str]:
    """None when ``dtype`` can run on a device of ``capability``, else why not."""
    if capability is None:
        return "no CUDA device"
    need_cc = MIN_CC[dtype]
    if tuple(capability) < need_cc:
        return f"needs compute capability >= {need_cc[0]}.{need_cc[1]}, device has {capability[0]}.{capability[1]}"
    return None


def make_operands(dtype: str, n: int, device, gen: Optional[torch.Generator] = None) -> tuple:
    """Random ``(a, b)`` for ``dtype``, drawn on ``device`` (``gen`` must live there too):
    a row-major; b column-major for int8/fp8, the layout cuBLASLt's int8/fp8 kernels take."""
    kw = {"device": device, "generator": gen}
    if dtype == "int8":
        a, b = (torch.randint(-128, 128, (n, n), dtype=torch.int8, **kw) for _ in range(2))
    else:
        a, b = (torch.randn(n, n, **kw).to(_TORCH_DTYPE[dtype]) for _ in range(2))
    return (a, b.t()) if dtype in ("int8", "fp8") else (a, b)


def gemm_fn(dtype: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The product for ``dtype`` (TF32 on/off is set by :func:`_matmul_precision` around the timing)."""
    if dtype == "int8":
        return compat.int_mm
    if dtype == "fp8":
        def fp8_mm(a, b):
            one = torch.ones((), device=a.device)
            return compat.scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return fp8_mm
    return torch.matmul


@contextlib.contextmanager
def _matmul_precision(dtype: str):
    """fp32 matmuls in IEEE ("highest") or TF32 ("high"), restored afterwards."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def run_cases(sizes: list[int], dtypes: list[str], capability: Optional[tuple[int, int]], device="cuda",
              timer: Callable[[Callable[[], object]], float] = median_ms) -> list[dict]:
    """Time every (size, dtype); rows carry ms, TFLOP/s and speed-up vs fp32 (or a status)."""
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for n in sizes:
        size_rows = [_time_case(dtype, n, capability, device, gen, timer) for dtype in dtypes]
        base_ms = next((r["ms"] for r in size_rows if r["dtype"] == "fp32"), None)
        for row in size_rows:
            if row["ms"] and base_ms:
                row["speedup_vs_fp32"] = base_ms / row["ms"]
        rows += size_rows
    return rows


def _time_case(dtype: str, n: int, capability, device, gen, timer) -> dict:
    row = {"n": n, "dtype": dtype, "ms": None, "tflops": None, "speedup_vs_fp32": None, "status": "ok"}
    why = unsupported_reason(dtype, capability)
    if why:
        return {**row, "status": f"unsupported: {why}"}
    try:
        fn, reps = gemm_fn(dtype), products_per_call(n)
        set_bytes = 2 * n * n * _TORCH_DTYPE[dtype].itemsize
        sets = itertools.cycle(input_sets(lambda: make_operands(dtype, n, device, gen), set_bytes))

        def call():
            for _ in range(reps):
                fn(*next(sets))

        with _matmul_precision(dtype):
            call()  # fails here, not inside the timer, if the kernel is missing
            ms = timer(call) / reps
    except (RuntimeError, TypeError) as e:
        return {**row, "status": f"unsupported: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"}
    return {**row, "ms": ms, "tflops": gemm_flops(n) / (ms * 1e-3) / 1e12}


def format_rows(rows: list[dict]) -> str:
    head = f"{'n':>6} {'dtype':>6} {'ms':>9} {'TFLOP/s':>9} {'vs fp32':>8}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        unit = " (TOP/s)" if r["dtype"] == "int8" and r["tflops"] is not None else ""
        lines.append(f"{r['n']:>6} {r['dtype']:>6} {fmt(r['ms'], '{:9.3f}'):>9} {fmt(r['tflops'], '{:9.1f}'):>9} "
                     f"{fmt(r['speedup_vs_fp32'], '{:7.2f}x'):>8}  {r['status']}{unit}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = bench_parser("gemm", __doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma list of n (n x n x n)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma list of {list(DTYPES)}")
    parser.add_argument("--json", default="bench_gemm.json", help="where to write the results")
    args = parser.parse_args(argv)
    try:
        sizes, dtypes = parse_sizes(args.sizes), parse_dtypes(args.dtypes)
    except ValueError as e:
        parser.error(str(e))
    if not torch.cuda.is_available():
        print("mptrain bench gemm: no CUDA device visible; the GEMM benchmark needs a GPU.", file=sys.stderr)
        return 2
    if "fp32" not in dtypes:
        dtypes = ["fp32"] + dtypes  # the speed-up needs the baseline
    cap = torch.cuda.get_device_capability()
    rows = run_cases(sizes, dtypes, cap)
    print(format_rows(rows))
    write_json(args.json, {"meta": device_meta() | {"capability": f"{cap[0]}.{cap[1]}"}, "rows": rows})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
