"""`mptrain bench e2e`: whole training steps of ResNet-50 (batch 256) and BERT-base MLM (batch 128,
seq 128) in one process: ``mptrain.Trainer`` in each mode (eager, compiled, CUDA graphs) against
``lightning.Trainer`` in its best modes, eager, with ``fit(torch.compile(module))``, and with
mptrain's fused master-weight optimizer.

Each case trains a fresh model and trainer on the same synthetic device batches and times ``--steps``
steps after ``--warmup`` (``StepTimer``: wall and GPU time; then host-device syncs over a few more steps;
peak memory per case).
All step AdamW at a constant learning rate (torch's fused one for Lightning, mptrain's FusedAdamW);
the Lightning cases train the stock model (torch's LayerNorm and max-pool), the mptrain cases its fused
modules (mptrain.nn, and ResNet's stem conv padded to 4 channels in fp16).

    mptrain bench e2e --out e2e.json
    mptrain bench e2e --models bert --cases mptrain:bf16-master,lightning:bf16-mixed --steps 50
    mptrain bench e2e --models bert --repeat 3   # each case 3 times, alternating order: median
    mptrain bench e2e --quick          # tiny models on the CPU: checks the harness only
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from functools import partial
from typing import Optional

import lightning as L
import torch

from mptrain.bench.common import device_meta, fmt, parse_csv, write_json
from mptrain.bench.e2e_models import MODELS, build, compile_lightning_module, make_trainer, use_optimizer
from mptrain.precision.graph_capture import CudaGraphError

LR = 1e-4


@dataclass(frozen=True)
class CaseSpec:
    trainer: str  # "mptrain" | "lightning"
    precision: str  # "best": mptrain's fastest eager mode of this run
    optimizer: str  # "torch-fused" | "mptrain" | "mptrain-master"
    compile: bool = False
    cuda_graphs: bool = False


# Run order: the cases a target compares stand next to each other (each mixed mode beside
# Lightning's, the master modes beside Lightning's bf16-true plugins), so that the host's
# drift over a run (BERT's eager steps are host-bound) moves both sides of a ratio alike.
CASES = {
    "mptrain:bf16-master": CaseSpec("mptrain", "bf16-master", "mptrain"),
    "lightning:bf16-true+FusedAdamW(master)": CaseSpec("lightning", "bf16-true", "mptrain-master"),
    "lightning:bf16-true": CaseSpec("lightning", "bf16-true", "torch-fused"),
    "mptrain:16-master": CaseSpec("mptrain", "16-master", "mptrain"),
    "mptrain:bf16-mixed": CaseSpec("mptrain", "bf16-mixed", "mptrain"),
    "lightning:bf16-mixed": CaseSpec("lightning", "bf16-mixed", "torch-fused"),
    "mptrain:16-mixed": CaseSpec("mptrain", "16-mixed", "mptrain"),
    "lightning:16-mixed": CaseSpec("lightning", "16-mixed", "torch-fused"),
    "mptrain+cuda_graphs:bf16-master": CaseSpec("mptrain", "bf16-master", "mptrain", cuda_graphs=True),
    "lightning+compile:bf16-mixed": CaseSpec("lightning", "bf16-mixed", "torch-fused", compile=True),
    "lightning+compile:16-mixed": CaseSpec("lightning", "16-mixed", "torch-fused", compile=True),
    "lightning+compile:bf16-true": CaseSpec("lightning", "bf16-true", "torch-fused", compile=True),
    "mptrain+compile:best": CaseSpec("mptrain", "best", "mptrain", compile=True),
    "mptrain+compile+cuda_graphs:best": CaseSpec("mptrain", "best", "mptrain", compile=True, cuda_graphs=True),
}
LIGHTNING_EAGER = ("lightning:bf16-mixed", "lightning:16-mixed", "lightning:bf16-true")
LIGHTNING_COMPILE = ("lightning+compile:bf16-mixed", "lightning+compile:16-mixed", "lightning+compile:bf16-true")
MPTRAIN_EAGER = tuple(n for n, s in CASES.items() if s.trainer == "mptrain" and not (s.compile or s.cuda_graphs))
#: torch.compile's arguments under --quick, which checks the path, not inductor's code generation
QUICK_COMPILE = {"backend": "eager"}


@dataclass
class Result:
    model: str
    case: str
    precision: str
    batch: int
    status: str = "ok"  # "ok" | "not supported" | "error"
    samples_per_s: Optional[float] = None
    step_ms: Optional[float] = None
    gpu_step_ms: Optional[float] = None
    peak_mem_gb: Optional[float] = None
    syncs_per_step: Optional[float] = None
    skipped_steps: Optional[int] = None
    wall_s: Optional[float] = None
    message: Optional[str] = None
    sync_sites: Optional[dict] = None  # "file:line" of the Python call that synchronized -> count
    gc_ms_per_step: Optional[float] = None  # Python garbage-collection pauses inside the timed window
    gc_full: Optional[int] = None  # full (generation 2) collections inside the timed window


class StepTimer(L.Callback):
    """Times ``steps`` steps after ``warmup`` (synchronizing only at the window's two edges), then counts
    the host-device syncs of the next ``sync_steps`` steps with ``torch.cuda.set_sync_debug_mode("warn")``
    (the master modes must make none).  The two windows are apart so that the debug mode and the warning
    capture it needs (every warning of the step recorded) cost the timed steps nothing.

    The garbage of the compile and the warm-up is collected before the timed window opens: a full
    collection of a process that has compiled models walks ~600k objects (0.3 s on a 2-core CPU), and
    one falling inside a 20-step window would add its pause to every step's average.  Collections
    inside the window still happen and are reported (``gc_ms``, ``gc_full``), not hidden."""

    def __init__(self, warmup: int, steps: int, sync_steps: int = 5):
        self.warmup, self.steps, self.sync_steps, self.count = warmup, steps, sync_steps, 0
        self.cuda = torch.cuda.is_available()
        self.t0 = self.t1 = self.gpu_ms = self.syncs = self.sync_sites = None
        self._events = self._caught = self._catcher = None
        self.gc_ms, self.gc_full, self._gc_t = 0.0, 0, None

    @property
    def total(self) -> int:
        """Steps the trainer must run: warmup, the timed window, the sync-count window (CUDA only)."""
        return self.warmup + self.steps + (self.sync_steps if self.cuda else 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.count += 1
        if self.count == self.warmup:
            self._open()
        elif self.count == self.warmup + self.steps:
            self._close()
        elif self.count == self.warmup + self.steps + self.sync_steps:
            self._count_syncs()

    def _gc_pause(self, phase: str, info: dict) -> None:
        """gc.callbacks hook while the timed window is open: the collections' pauses and full ones."""
        if phase == "start":
            self._gc_t = time.perf_counter()
        elif self._gc_t is not None:
            self.gc_ms += (time.perf_counter() - self._gc_t) * 1e3
            self.gc_full += info.get("generation") == 2
            self._gc_t = None

    def _open(self) -> None:
        gc.collect()
        gc.callbacks.append(self._gc_pause)
        if self.cuda:
            torch.cuda.synchronize()
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self.t0 = time.perf_counter()

    def _close(self) -> None:
        if self.cuda:
            self._events[1].record()
            torch.cuda.synchronize()
            self.gpu_ms = self._events[0].elapsed_time(self._events[1]) / self.steps
        self.t1 = time.perf_counter()
        self._stop_gc_count()
        if self.cuda and self.sync_steps:
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def _count_syncs(self) -> None:
        if self._catcher is None:
            return
        self.abandon()
        # only the synchronizations (the debug mode's own "prototype feature" warning is not one)
        syncs = [w for w in self._caught if "called a synchronizing CUDA operation" in str(w.message)]
        self.syncs = len(syncs)
        self.sync_sites = dict(Counter(f"{w.filename}:{w.lineno}" for w in syncs))

    def _stop_gc_count(self) -> None:
        if self._gc_pause in gc.callbacks:
            gc.callbacks.remove(self._gc_pause)

    def abandon(self) -> None:
        """Leave the debug mode, the warning capture and the GC count (at the windows' ends, or if the run
        died in one)."""
        self._stop_gc_count()
        if self._catcher is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catcher.__exit__(None, None, None)
            self._catcher = None


def optimizer_factory(kind: str):
    """AdamW as each case steps it: torch's fused kernel, or mptrain's FusedAdamW (optionally owning fp32 masters)."""
    if kind == "torch-fused":
        return lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)
    from mptrain.optim import FusedAdamW

    return lambda params: FusedAdamW(params, lr=LR, weight_decay=0.01, master_weights=kind == "mptrain-master")


def _trainer(spec: CaseSpec, precision: str, model: str, timer: StepTimer, total: int, quick: bool):
    ours = dict(channels_last=model == "resnet50", cuda_graphs=spec.cuda_graphs,
                compile=(QUICK_COMPILE if quick else True) if spec.compile else False)
    return make_trainer(spec.trainer, precision, timer, total, ours, accelerator="cpu" if quick else "cuda",
                        devices=1, benchmark=True)


def run_case(model: str, name: str, precision: str, warmup: int, steps: int, quick: bool) -> Result:
    spec = CASES[name]
    res = Result(model, name, precision, batch=0)
    timer = StepTimer(warmup, steps)
    total = timer.total
    gc.collect()  # the last case's trainer and module (reference cycles) are freed before the peak is reset
    # Each case compiles from dynamo's state of a fresh process.  Shared code (LightningModule.log, the
    # recipe modules' training_step, our compiled call) otherwise keeps every earlier case's cache entries:
    # they pile up across precisions, and at the recompile limit (8) dynamo runs that frame eagerly for the
    # rest of the process (LightningModule.log reaches it within the full benchmark's compiled cases).
    # Inductor's on-disk caches stay, so a recompile of code seen before is quick.
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        module, batches, res.batch = build(model, total, "cpu" if quick else "cuda", quick,
                                           stock=spec.trainer == "lightning")
        use_optimizer(module, optimizer_factory(spec.optimizer))
        if spec.trainer == "lightning":
            module = module.to(memory_format=torch.channels_last) if model == "resnet50" else module
            module = compile_lightning_module(module, **(QUICK_COMPILE if quick else {})) if spec.compile else module
        trainer = _trainer(spec, precision, model, timer, total, quick)
        trainer.fit(module, train_dataloaders=batches)
        _record(res, timer, steps, getattr(trainer, "skipped_steps", None))
    except (NotImplementedError, CudaGraphError) as e:  # the trainer refuses the feature: say why, never fall back
        res.status, res.message = "not supported", str(e)
    except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
        res.status, res.message = "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
    finally:
        timer.abandon()
        res.wall_s = time.perf_counter() - start
    return res


def _record(res: Result, timer: StepTimer, steps: int, skipped) -> None:
    if timer.t1 is None or (timer.cuda and timer.sync_steps and timer.syncs is None):
        raise RuntimeError(f"only {timer.count} steps ran; expected {timer.total}")
    elapsed = timer.t1 - timer.t0
    res.step_ms, res.samples_per_s = 1e3 * elapsed / steps, steps * res.batch / elapsed
    res.gpu_step_ms = timer.gpu_ms
    res.gc_ms_per_step, res.gc_full = timer.gc_ms / steps, timer.gc_full
    res.syncs_per_step = None if timer.syncs is None else timer.syncs / timer.sync_steps
    res.sync_sites = timer.sync_sites
    res.skipped_steps = skipped
    res.peak_mem_gb = torch.cuda.max_memory_allocated() / 2**30 if timer.cuda else None


def _rate(results: list[Result], model: str, names) -> Optional[Result]:
    ok = [r for r in results if r.model == model and r.case in names and r.status == "ok"]
    return max(ok, key=lambda r: r.samples_per_s, default=None)


def best_mptrain_mode(results: list[Result], model: str) -> str:
    best = _rate(results, model, MPTRAIN_EAGER)
    return best.precision if best else "bf16-master"


def summarize(results: list[Result], model: str, runs: Optional[list[Result]] = None) -> dict:
    """The ratios of docs/PERFORMANCE.md's e2e table; the mixed modes' as the median of each pass's (``runs``)."""
    def rate(names):
        r = _rate(results, model, names)
        return None if r is None else {"case": r.case, "samples_per_s": r.samples_per_s}

    def ratio(a, b):
        return a["samples_per_s"] / b["samples_per_s"] if a and b else None

    out = {"mptrain_best": rate([n for n, s in CASES.items() if s.trainer == "mptrain"]),
           "mptrain_eager_best": rate(MPTRAIN_EAGER), "mptrain_compiled": rate(["mptrain+compile:best"]),
           "mptrain_cuda_graphs": rate(["mptrain+cuda_graphs:bf16-master"]),
           "mptrain_bf16_master": rate(["mptrain:bf16-master"]),
           "lightning_best": rate(LIGHTNING_EAGER), "lightning_compile": rate(LIGHTNING_COMPILE),
           "lightning_fused_master": rate(["lightning:bf16-true+FusedAdamW(master)"]), "each_pass": {}}
    out["ratios"] = {f"{a} / {b}": ratio(out[a], out[b]) for a, b in (
        ("mptrain_best", "lightning_best"), ("mptrain_best", "lightning_compile"),
        ("mptrain_best", "lightning_fused_master"), ("mptrain_compiled", "mptrain_eager_best"),
        ("mptrain_cuda_graphs", "mptrain_bf16_master"))}
    for ours, theirs in ((f"mptrain:{m}", f"lightning:{m}") for m in ("bf16-mixed", "16-mixed")):
        each = out["each_pass"][f"{ours} / {theirs}"] = paired_ratios(runs or results, model, ours, theirs)
        out["ratios"][f"{ours} / {theirs}"] = statistics.median(each) if each else None
    return out


def paired_ratios(runs: list[Result], model: str, ours: str, theirs: str) -> list[float]:
    """``ours / theirs`` pass by pass (``runs`` in run order): two neighbouring cases ran seconds apart, while a
    host-bound step drifts by tens of percent over minutes (two cases' medians may come from different passes)."""
    a, b = ([r for r in runs if r.model == model and r.case == case] for case in (ours, theirs))
    return [x.samples_per_s / y.samples_per_s for x, y in zip(a, b) if x.status == y.status == "ok"]


def format_table(results: list[Result]) -> str:
    head = (f"{'model':<9} {'case':<40} {'precision':<12} {'batch':>5} {'throughput':>14} {'vs L best':>9} "
            f"{'ms/step':>8} {'event ms':>8} {'peak GB':>8} {'syncs/step':>10} {'skips':>5}")
    lines = [head, "-" * len(head)]
    for r in results:
        prefix = f"{r.model:<9} {r.case:<40} {r.precision:<12} {r.batch:>5}"
        if r.status != "ok":
            lines.append(f"{prefix} {r.status.upper()}: {r.message.splitlines()[0][:110]}")
            continue
        best = _rate(results, r.model, LIGHTNING_EAGER)
        unit = "img/s" if r.model == "resnet50" else "seq/s"
        cells = [f"{r.samples_per_s:8.1f} {unit}", _fmt(best and r.samples_per_s / best.samples_per_s, "{:.3f}x"),
                 f"{r.step_ms:8.2f}", _fmt(r.gpu_step_ms, "{:.2f}"), _fmt(r.peak_mem_gb, "{:.2f}"),
                 _fmt(r.syncs_per_step, "{:g}"), _fmt(r.skipped_steps, "{}")]
        widths = (14, 9, 8, 8, 8, 10, 5)
        lines.append(prefix + "".join(f" {c:>{w}}" for c, w in zip(cells, widths)))
    paused = [r for r in results if r.gc_full]
    for r in paused:  # a full collection's pause is in that case's ms/step: say so beside the table
        lines.append(f"note: {r.model} {r.case}: {r.gc_full} full garbage collection(s) in the timed window, "
                     f"{r.gc_ms_per_step:.2f} ms/step of collector pauses")
    return "\n".join(lines)


_fmt = partial(fmt, none="-")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mptrain bench e2e", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--cases", default=",".join(CASES), help="comma list of cases (default: all): " + ", ".join(CASES))
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per case (cuDNN autotuning, compile)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per case")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of every case in alternating order: the median run of each; mixed-mode ratios by pass")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the results as JSON")
    p.add_argument("--quick", action="store_true", help="tiny models on the CPU: checks the harness, not speed")
    args = p.parse_args(argv)
    args.models = parse_csv(p, args.models, MODELS, "--models")
    args.cases = parse_csv(p, args.cases, tuple(CASES), "--cases")
    if args.warmup < 1 or args.steps < 1 or args.repeat < 1:
        p.error(f"--warmup {args.warmup} / --steps {args.steps} / --repeat {args.repeat}: all must be >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.quick and not torch.cuda.is_available():
        print("mptrain bench e2e: needs a CUDA GPU (none visible); --quick runs tiny models on the CPU",
              file=sys.stderr)
        return 2
    kernels = fused_kernel_status(args.quick)
    print(f"[e2e] mptrain fused kernels: {kernels}", flush=True)
    runs: list[Result] = []  # every pass's run of every case
    for model in args.models:
        for order in case_orders(args.cases, args.repeat):
            for name in order:
                spec = CASES[name]
                precision = best_mptrain_mode(runs, model) if spec.precision == "best" else spec.precision
                res = run_case(model, name, precision, args.warmup, args.steps, args.quick)
                runs.append(res)
                done = (f"{res.samples_per_s:.1f}/s" if res.status == "ok"
                        else f"{res.status}: {res.message.splitlines()[0]}")
                print(f"[e2e] {model} {name} ({precision}): {done} ({res.wall_s:.1f} s)", flush=True)
                _write_json(args, runs, kernels)  # a run cut short keeps what it measured
    results = median_runs(runs)
    print(f"mptrain fused kernels: {kernels}")
    print(format_table(results))
    for r in results:
        if r.sync_sites:
            print(f"host syncs, {r.model} {r.case}: " + ", ".join(f"{k} x{n}" for k, n in r.sync_sites.items()))
    for model in args.models:
        summary = summarize(results, model, runs)
        passes = "; ".join(f"{k} = " + ", ".join(f"{x:.3f}x" for x in v) for k, v in summary["each_pass"].items() if v)
        print(f"{model}: " + "; ".join(f"{k} = {_fmt(v, '{:.3f}x')}" for k, v in summary["ratios"].items())
              + (f"\n{model}, each pass: {passes}" if passes else ""))
    return 1 if any(r.status == "error" for r in results) else 0


def case_orders(cases: list[str], repeat: int) -> list[list[str]]:
    """The case order of each repetition: the list forwards, then backwards, and so on, so that a
    drift of the machine over the run (host clocks, caches) favours no case; "best" cases, which
    need this repetition's mode results, come last every time."""
    modes = [n for n in cases if CASES[n].precision != "best"]
    best = [n for n in cases if CASES[n].precision == "best"]
    return [(modes if r % 2 == 0 else modes[::-1]) + best for r in range(repeat)]


def median_runs(runs: list[Result]) -> list[Result]:
    """One result per model and case: the run of median throughput (failed runs only when no run succeeded)."""
    out = []
    for key in dict.fromkeys((r.model, r.case) for r in runs):
        mine = [r for r in runs if (r.model, r.case) == key]
        ok = sorted((r for r in mine if r.status == "ok"), key=lambda r: r.samples_per_s)
        out.append(ok[(len(ok) - 1) // 2] if ok else mine[-1])
    return out


def fused_kernel_status(quick: bool) -> str:
    """Build (or load) the CUDA extension before the first case, so no case pays the build, and
    say whether the mptrain cases run the fused kernels or PyTorch's reference code."""
    if quick:
        return "not used (--quick runs the CPU references)"
    from mptrain.ops.build import extension_status, get_extension

    get_extension(required=False)
    status = extension_status()
    slow = ("" if status == "built"
            else "NOT BUILT -- the mptrain cases run the slow reference code, not mptrain's speed: ")
    return slow + status.describe()


def _write_json(args: argparse.Namespace, runs: list[Result], kernels: str) -> None:
    if args.out:
        results = median_runs(runs)
        meta = {**device_meta(), "warmup": args.warmup, "steps": args.steps, "repeat": args.repeat,
                "quick": args.quick, "fused_kernels": kernels}
        write_json(args.out, {"meta": meta, "summary": {m: summarize(results, m, runs) for m in args.models},
                              "results": [asdict(r) for r in results]})


if __name__ == "__main__":
    sys.exit(main())
