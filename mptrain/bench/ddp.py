"""`mptrain bench ddp`: data-parallel scaling of the e2e benchmark's models under Lightning's DDP,
launched by torchrun (``mptrain.bench.ddp_lightning`` is one rank).

For each model, the same synthetic-data run (the e2e per-GPU batch) is launched with 1 and N
processes under ``mptrain.Trainer`` (default) or a plain ``lightning.Trainer``; a ``Probe`` in each
rank times ``steps`` steps after ``warmup`` and digests the rank's parameters and buffers.
Reported: global samples/s on 1 and N GPUs, scaling efficiency ``rate_N / (N * rate_1)`` (target
>= 0.9), and whether every rank ended with identical weights.

    python -m mptrain.bench.ddp --nproc 2 --json ddp.json                     # 2 GPUs, bf16-master
    python -m mptrain.bench.ddp --nproc 2 --trainer lightning --precision bf16-mixed
    python -m mptrain.bench.ddp --nproc 2 --models bert --batch 256            # BERT at 256 per GPU
    python -m mptrain.bench.ddp --nproc 2 --cpu --quick --models bert         # gloo smoke test
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lightning.pytorch import Callback

from mptrain.bench.common import bench_parser, parse_csv, write_json
from mptrain.bench.e2e_models import MODELS

ROOT = Path(__file__).resolve().parents[2]


class Probe(Callback):
    """Step timing and a weights digest per rank: ``steps`` steps timed after ``warmup``."""

    def __init__(self, out_dir: str, warmup: int = 5, steps: int = 20):
        self.out_dir, self.warmup, self.steps = out_dir, warmup, steps
        self.count, self.t0, self.t1 = 0, None, None
        self.batch = None  # the rank's batch size, set by its script (ddp_lightning)

    @property
    def total_steps(self) -> int:
        """Optimizer steps the run must last."""
        return self.warmup + self.steps

    @staticmethod
    def _sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.count += 1
        if self.count in (self.warmup, self.warmup + self.steps):
            self._sync()
            if self.count == self.warmup:
                self.t0 = time.perf_counter()
            else:
                self.t1 = time.perf_counter()

    @staticmethod
    def _digest(named) -> str:
        digest = hashlib.sha256()
        for name, t in sorted(named):
            digest.update(name.encode())
            digest.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()

    def on_fit_end(self, trainer, pl_module):
        elapsed = None if self.t1 is None else self.t1 - self.t0
        # Parameters must agree bit for bit; BatchNorm statistics differ after the last step
        # (DDP broadcasts buffers from rank 0 at the start of each forward).
        record = {"rank": trainer.global_rank, "world_size": trainer.world_size, "batch": self.batch,
                  "steps": self.steps, "elapsed_s": elapsed, "global_step": trainer.global_step,
                  "weights_sha256": self._digest(pl_module.named_parameters()),
                  "buffers_sha256": self._digest(pl_module.named_buffers())}
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def launch(model: str, nproc: int, out_dir: str, probe: dict, args) -> dict:
    """One torchrun launch of ``nproc`` ranks (``mptrain.bench.ddp_lightning``); ``probe`` holds
    the Probe's arguments but ``out_dir``.  Returns the rate and the per-rank records."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}",
           "-m", "mptrain.bench.ddp_lightning", "--trainer", args.trainer, "--model", model,
           "--precision", args.precision, "--out", out_dir, "--probe", json.dumps(probe),
           *(["--cpu"] if args.cpu else []), *(["--quick"] if args.quick else []),
           *(["--batch", str(args.batch)] if args.batch else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if args.cpu:  # torchrun gives each rank one OpenMP thread unless told otherwise
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise RuntimeError(f"{model} x{nproc} failed (rc={r.returncode}):\n{r.stderr[-3000:]}")
    records = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    if len(records) != nproc:
        raise RuntimeError(f"{model} x{nproc}: {len(records)} rank reports, expected {nproc}")
    r0 = next(rec for rec in records if rec["rank"] == 0)
    rate = nproc * r0["batch"] * r0["steps"] / r0["elapsed_s"]
    return {"nproc": nproc, "samples_per_s": rate, "wall_s": wall,
            "identical_weights": len({rec["weights_sha256"] for rec in records}) == 1,
            "identical_buffers": len({rec["buffers_sha256"] for rec in records}) == 1, "ranks": records}


def measure(model: str, nproc: int, tmp: str, probe: dict, args) -> dict:
    """``args.repeat`` launches of one configuration; the median rate is the result (launches on a
    shared host vary by several %, more than the effects we look for)."""
    runs = [launch(model, nproc, f"{tmp}/{model}-{nproc}-{i}", probe, args) for i in range(args.repeat)]
    rates = [r["samples_per_s"] for r in runs]
    return {**runs[0], "samples_per_s": statistics.median(rates), "rates": rates,
            "identical_weights": all(r["identical_weights"] for r in runs),
            "identical_buffers": all(r["identical_buffers"] for r in runs)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = bench_parser("ddp", __doc__)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--trainer", default="mptrain", choices=("mptrain", "lightning"),
                   help="mptrain.Trainer, or a plain lightning.Trainer as the baseline")
    p.add_argument("--precision", default=None, help="default: bf16-master (mptrain), bf16-mixed (lightning)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch", type=int, default=None,
                   help="per-GPU batch (default: the e2e benchmark's: 256, BERT 128)")
    # DDP samples its runtime statistics (with host syncs) in iterations 1..10: time after them.
    p.add_argument("--warmup", type=int, default=12, help="untimed steps (past DDP's 10 sampled iterations)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=1, help="launches per configuration; the median rate is reported")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke test of the path)")
    p.add_argument("--quick", action="store_true", help="tiny models (with --cpu: a smoke test)")
    p.add_argument("--skip-single", action="store_true",
                   help="only the N-process run (no efficiency; for comparing variants)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.models = parse_csv(p, args.models, MODELS, "--models")
    if args.batch is not None and args.batch < 1:
        p.error(f"--batch {args.batch}: must be >= 1")
    args.precision = args.precision or ("bf16-master" if args.trainer == "mptrain" else "bf16-mixed")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.cpu and torch.cuda.device_count() < args.nproc:
        print(f"mptrain bench ddp: needs {args.nproc} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    probe = {"warmup": args.warmup, "steps": args.steps}
    results, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            try:
                one = None if args.skip_single else measure(model, 1, tmp, probe, args)
                many = measure(model, args.nproc, tmp, probe, args)
                eff = None if one is None else many["samples_per_s"] / (args.nproc * one["samples_per_s"])
                results[model] = {"single": one, "multi": many, "scaling_efficiency": eff}
                ok &= many["identical_weights"]
                _print_result(model, args, one, many, eff)
            except Exception as e:  # noqa: BLE001 - report and go on to the next model
                ok = False
                results[model] = {"error": f"{type(e).__name__}: {e}"}
                print(f"[ddp] {model}: ERROR {e}", flush=True)
    if args.json:
        write_json(args.json, {"nproc": args.nproc, "trainer": args.trainer, "precision": args.precision,
                               "probe": probe, "results": results})
    return 0 if ok else 1


def _print_result(model: str, args, one, many, eff) -> None:
    who = f"{args.trainer} {args.precision}"
    rates = lambda r: "/".join(f"{x:.0f}" for x in r["rates"])  # noqa: E731
    single = "" if one is None else f"1 GPU {one['samples_per_s']:.1f}/s ({rates(one)}), "
    effs = "" if eff is None else f" -> efficiency {eff:.3f}"
    print(f"[ddp] {model} ({who}): {single}{args.nproc} GPUs {many['samples_per_s']:.1f}/s "
          f"({rates(many)}){effs}; identical weights on all ranks: {many['identical_weights']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
