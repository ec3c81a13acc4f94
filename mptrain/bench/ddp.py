"""`mptrain bench ddp`: data-parallel scaling of the recipes through ``launch/torchrun.sh``.

For each recipe, the same synthetic-data run (the recipe's per-GPU batch) is launched with 1
and with N processes; a ``Probe`` callback in every rank times ``steps`` optimizer steps after
``warmup`` (two ``cuda.synchronize()``), and at the end of fit writes a digest of the rank's
parameters (and, separately, of its buffers: BatchNorm statistics differ across ranks by design).  Reported: global samples/s for 1 and N GPUs, scaling efficiency
``rate_N / (N * rate_1)`` (target >= 0.9), and whether every rank ended with identical weights.

    python -m mptrain.bench.ddp --nproc 2 --json ddp.json          # on a 2-GPU machine
    python -m mptrain.bench.ddp --nproc 2 --cpu --recipes quickstart   # gloo smoke test
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

try:  # Lightning's Trainer accepts only its Callback subclasses; mptrain's takes any object
    from lightning.pytorch import Callback as _CallbackBase
except ImportError:  # pragma: no cover - lightning is a core dependency
    _CallbackBase = object

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RECIPES = ("resnet50", "bert_base")


class Probe(_CallbackBase):
    """Trainer callback (the hook names of mptrain and Lightning): step timing, a weights digest
    per rank and, with ``profile`` > 0, a torch.profiler summary of that many steps after the
    timed ones (``profile_rank{r}.txt``: where the step's GPU and host time go)."""

    def __init__(self, out_dir: str, warmup: int = 5, steps: int = 20, profile: int = 0):
        self.out_dir, self.warmup, self.steps, self.profile = out_dir, warmup, steps, profile
        self.count, self.t0, self.t1, self.batch = 0, None, None, None
        self._prof = None

    @staticmethod
    def _sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.count += 1
        if self.batch is None:
            first = batch["input_ids"] if isinstance(batch, dict) else batch[0]
            self.batch = int(first.shape[0])
        if self.count == self.warmup:
            self._sync()
            self.t0 = time.perf_counter()
        elif self.count == self.warmup + self.steps:
            self._sync()
            self.t1 = time.perf_counter()
            if self.profile:
                from torch.profiler import ProfilerActivity, profile

                self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self._prof.__enter__()
                self._pt0 = time.perf_counter()
        elif self._prof is not None and self.count == self.warmup + self.steps + self.profile:
            self._sync()
            wall = time.perf_counter() - self._pt0
            self._prof.__exit__(None, None, None)
            from mptrain.bench.profile_summary import summarize_profile

            text = summarize_profile(self._prof, self.profile, wall)
            Path(self.out_dir, f"profile_rank{trainer.global_rank}.txt").write_text(text)
            self._prof = None

    @staticmethod
    def _digest(named) -> str:
        digest = hashlib.sha256()
        for name, t in sorted(named):
            digest.update(name.encode())
            digest.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()

    def on_fit_end(self, trainer, pl_module):
        elapsed = None if self.t1 is None else self.t1 - self.t0
        # Parameters must agree bit for bit; BatchNorm running statistics legitimately differ
        # after the last step (DDP broadcasts buffers from rank 0 at the start of each forward).
        record = {"rank": trainer.global_rank, "world_size": trainer.world_size, "batch": self.batch,
                  "steps": self.steps, "elapsed_s": elapsed, "global_step": trainer.global_step,
                  "weights_sha256": self._digest(pl_module.named_parameters()),
                  "buffers_sha256": self._digest(pl_module.named_buffers())}
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def launch(recipe: str, nproc: int, out_dir: str, warmup: int, steps: int, cpu: bool, extra: list[str],
           profile: int = 0, lightning: str | None = None) -> dict:
    """One torchrun launch (mptrain's recipe, or with ``lightning`` a plain Lightning Trainer in
    that precision on the same model); returns the per-rank records."""
    os.makedirs(out_dir, exist_ok=True)
    if lightning:
        if cpu:
            raise ValueError("--lightning runs on GPUs only")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}",
               "-m", "mptrain.bench.ddp_lightning", "--model", recipe, "--precision", lightning, "--warmup", str(warmup),
               "--steps", str(steps), "--profile", str(profile), "--out", out_dir]
    else:
        cb = (f"[{{class_path: mptrain.bench.ddp.Probe, init_args: {{out_dir: {out_dir}, warmup: {warmup}, "
              f"steps: {steps}, profile: {profile}}}}}]")
        cmd = ["bash", str(ROOT / "launch" / "torchrun.sh"), str(ROOT / "recipes" / f"{recipe}.yaml"), str(nproc),
               "--data.synthetic=true", f"--trainer.max_steps={warmup + steps + profile}", "--trainer.max_epochs=-1",
               "--trainer.logger=none", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
               f"--trainer.default_root_dir={out_dir}", f"--trainer.callbacks={cb}",
               *(["--trainer.accelerator=cpu"] if cpu else []), *extra]
    env = dict(os.environ, PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise RuntimeError(f"{recipe} x{nproc} failed (rc={r.returncode}):\n{r.stderr[-3000:]}")
    records = [json.loads(Path(p).read_text()) for p in sorted(glob.glob(os.path.join(out_dir, "rank*.json")))]
    if len(records) != nproc:
        raise RuntimeError(f"{recipe} x{nproc}: {len(records)} rank reports, expected {nproc}")
    r0 = next(rec for rec in records if rec["rank"] == 0)
    rate = nproc * r0["batch"] * r0["steps"] / r0["elapsed_s"]
    profiles = {p: Path(p).read_text() for p in sorted(glob.glob(os.path.join(out_dir, "profile_rank*.txt")))}
    return {"nproc": nproc, "samples_per_s": rate, "wall_s": wall,
            "identical_weights": len({rec["weights_sha256"] for rec in records}) == 1,
            "identical_buffers": len({rec["buffers_sha256"] for rec in records}) == 1, "ranks": records,
            "profiles": profiles}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mptrain bench ddp", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default=",".join(DEFAULT_RECIPES), help="recipe names under recipes/ (comma list)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke test of the path)")
    p.add_argument("--profile", type=int, default=0,
                   help="after the timed steps, profile this many steps per rank (torch.profiler summary)")
    p.add_argument("--lightning", default=None, metavar="PRECISION",
                   help="time a plain lightning.Trainer with its DDP in this precision instead of the recipe")
    p.add_argument("--skip-single", action="store_true",
                   help="only the N-process run (no efficiency; for comparing variants)")
    p.add_argument("--profile-out", default=None, help="copy the profile summaries into this folder")
    p.add_argument("--json", default=None)
    p.add_argument("extra", nargs="*", help="more --key.path=value overrides for every run (after --)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.cpu and torch.cuda.device_count() < args.nproc:
        print(f"mptrain bench ddp: needs {args.nproc} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    results, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in [r.strip() for r in args.recipes.split(",") if r.strip()]:
            try:
                run = lambda n: launch(recipe, n, f"{tmp}/{recipe}-{n}", args.warmup, args.steps, args.cpu,  # noqa: E731
                                       args.extra, args.profile, args.lightning)
                one = None if args.skip_single else run(1)
                many = run(args.nproc)
                eff = None if one is None else many["samples_per_s"] / (args.nproc * one["samples_per_s"])
                results[recipe] = {"single": one, "multi": many, "scaling_efficiency": eff}
                ok &= many["identical_weights"]
                who = f"lightning {args.lightning}" if args.lightning else "mptrain"
                single = "" if one is None else f"1 GPU {one['samples_per_s']:.1f}/s, "
                effs = "" if eff is None else f" -> efficiency {eff:.3f}"
                print(f"[ddp] {recipe} ({who} {' '.join(args.extra)}): {single}{args.nproc} GPUs "
                      f"{many['samples_per_s']:.1f}/s{effs}; identical weights on all ranks: "
                      f"{many['identical_weights']}", flush=True)
                if args.profile_out:
                    os.makedirs(args.profile_out, exist_ok=True)
                    tag = f"{recipe}{'-L' if args.lightning else ''}"
                    for res in (one, many):
                        for path, text in ({} if res is None else res["profiles"]).items():
                            Path(args.profile_out, f"{tag}-x{res['nproc']}-{Path(path).name}").write_text(text)
            except Exception as e:  # noqa: BLE001 - report and go on to the next recipe
                ok = False
                results[recipe] = {"error": f"{type(e).__name__}: {e}"}
                print(f"[ddp] {recipe}: ERROR {e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"nproc": args.nproc, "results": results}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
