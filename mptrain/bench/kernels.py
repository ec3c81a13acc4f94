"""`python -m mptrain.bench.kernels`: every shipped fused kernel against PyTorch on the GPU.

Each kernel family contributes a ``cases_*.py`` module with a ``run(args) -> list[Result]``;
this module only selects, runs and reports them: GPU time (CUDA graphs / events), then the
host-cost table of one eager call per op (``mptrain.bench.host_cost``), unless ``--no-host``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

from mptrain.bench.common import device_meta, format_table, write_json

FAMILIES = {
    "optim": "mptrain.bench.cases_optim",
    "norm": "mptrain.bench.cases_norm",
    "softmax": "mptrain.bench.cases_softmax",
    "lstm": "mptrain.bench.cases_lstm",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mptrain bench kernels", description=__doc__)
    parser.add_argument("--only", default=",".join(FAMILIES), help=f"comma list of {sorted(FAMILIES)}")
    parser.add_argument("--json", default="bench_kernels.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    parser.add_argument("--no-host", action="store_true",
                        help="skip the host-cost table (python -m mptrain.bench.host_cost runs it alone)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mptrain bench kernels: no CUDA device visible; the kernel benchmarks need a GPU.", file=sys.stderr)
        return 2
    chosen = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        parser.error(f"--only: unknown famil{'ies' if len(unknown) > 1 else 'y'} {unknown}; choose from {sorted(FAMILIES)}")
    results = []
    for fam in chosen:
        mod = importlib.import_module(FAMILIES[fam])
        print(f"[bench] {fam} ...", flush=True)
        fam_results = mod.run(args)
        print(format_table(fam_results), flush=True)
        results.extend(fam_results)
    print("\n== all kernels ==")
    print(format_table(results))
    write_json(results, args.json, device_meta())
    print(f"wrote {args.json}")
    return 0 if args.no_host else _host_table(args)


def _host_table(args) -> int:
    """The host cost of one eager call per op, beside the GPU times above."""
    from mptrain.bench import host_cost

    print("\n== host cost per eager call ==", flush=True)
    host_json = str(Path(args.json).with_name(Path(args.json).stem + "_host.json"))
    return host_cost.main(["--json", host_json] + (["--quick"] if args.quick else []))


if __name__ == "__main__":
    sys.exit(main())
