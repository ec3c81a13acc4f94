"""`python -m mptrain.bench.kernels`: every shipped fused kernel against PyTorch on the GPU.

Each kernel family's ``cases_*.py`` has a ``run(args) -> list[Result]``; this module runs the
chosen ones and reports their GPU times, then (unless ``--no-host``) the host cost of one eager
call per op (``mptrain.bench.host_cost``).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from mptrain.bench import host_cost
from mptrain.bench.common import bench_parser, device_meta, format_table, parse_csv, write_json

FAMILIES = {name: f"mptrain.bench.cases_{name}" for name in ("optim", "norm", "softmax", "lstm", "pool")}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("kernels", __doc__)
    parser.add_argument("--only", default=",".join(FAMILIES), help=f"comma list of {sorted(FAMILIES)}")
    parser.add_argument("--json", default="bench_kernels.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    parser.add_argument("--no-host", action="store_true",
                        help="skip the host-cost table (python -m mptrain.bench.host_cost runs it alone)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mptrain bench kernels: no CUDA device visible; the kernel benchmarks need a GPU.", file=sys.stderr)
        return 2
    results = []
    for fam in parse_csv(parser, args.only, tuple(FAMILIES), "--only"):
        print(f"[bench] {fam} ...", flush=True)
        fam_results = importlib.import_module(FAMILIES[fam]).run(args)
        print(format_table(fam_results), flush=True)
        results.extend(fam_results)
    print("\n== all kernels ==")
    print(format_table(results))
    write_json(args.json, {"meta": device_meta(), "results": [r.as_dict() for r in results]})
    print(f"wrote {args.json}")
    if args.no_host:
        return 0
    print("\n== host cost per eager call ==", flush=True)
    host_json = str(Path(args.json).with_name(Path(args.json).stem + "_host.json"))
    return host_cost.main(["--json", host_json] + (["--quick"] if args.quick else []))


if __name__ == "__main__":
    sys.exit(main())
