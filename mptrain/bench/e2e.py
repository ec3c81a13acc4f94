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

The user models (``--models user_resnet50,user_bert``, and ``user_llama``: transformers' LlamaForCausalLM at the
1.2B widths, batch 8 x 2048, a call of its own on the GPU) are what a plain Lightning user trains: torchvision's
ResNet-50 (channels_last, batch 256, ``SGD(lr=0.1, momentum=0.9, fused=True)``) and transformers'
``BertForMaskedLM(BertConfig(attn_implementation="sdpa"))`` (batch 128 x 128, ``AdamW(fused=True)``) in a
LightningModule of their own (mptrain.bench.user_models), with their own optimizer, run in USER_CASES:
Lightning bf16-mixed and bf16-true, eager and ``fit(torch.compile(module))`` (Lightning's documented idiom), and
mptrain bf16-master eager, ``compile=True`` and ``compile=True, cuda_graphs=True``, bf16-mixed with
``compile=True``, and on the Llama fp8-master with ``compile=True`` (refused, with the trainer's reason, where the
GPU has no fp8 tensor cores).  Their summary: mptrain's best / Lightning + compile's best (speed), and bf16-master's peak
memory / Lightning bf16-mixed's.  Every case starts from a fresh dynamo, with the previous case's memory
collected; the memory still allocated at its start and after its end is reported beside its peak, and one
steady-state step's memory by phase (forward, backward, optimizer step).

    mptrain bench e2e --models user_resnet50,user_bert --warmup 6 --steps 20 --out user.json
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

from mptrain.bench.common import bench_parser, device_meta, device_refusal, fmt, parse_csv, write_json
from mptrain.bench.compile_cache import CompileCache, add_compile_cache_option
from mptrain.bench.e2e_models import MODELS, build, compile_lightning_module, make_trainer, use_optimizer
from mptrain.bench.user_models import USER_MODELS, build_user
from mptrain.precision.graph_capture import CudaGraphError

LR = 1e-4


@dataclass(frozen=True)
class CaseSpec:
    trainer: str  # "mptrain" | "lightning"
    precision: str  # "best": mptrain's fastest eager mode of this run
    optimizer: str  # "torch-fused" | "mptrain" | "mptrain-master" | "user" (the module's own configure_optimizers)
    compile: bool = False
    cuda_graphs: bool = False
    models: Optional[tuple[str, ...]] = None  # the models the case runs on (None: every model of its list)


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
#: the user models' cases, in run order: the memory comparison's eager cases first, then mptrain's compiled
#: bf16-master cases together (the CUDA-graph case reuses the first's inductor caches), then Lightning + compile;
#: a run cut short (a stage's timeout) loses the least likely winners of the comparison first
USER_CASES = {
    "lightning:bf16-mixed": CaseSpec("lightning", "bf16-mixed", "user"),
    "mptrain:bf16-master": CaseSpec("mptrain", "bf16-master", "user"),
    "lightning:bf16-true": CaseSpec("lightning", "bf16-true", "user"),
    "mptrain+compile:bf16-master": CaseSpec("mptrain", "bf16-master", "user", compile=True),
    "mptrain+compile+cuda_graphs:bf16-master": CaseSpec("mptrain", "bf16-master", "user", compile=True,
                                                        cuda_graphs=True),
    "lightning+compile:bf16-mixed": CaseSpec("lightning", "bf16-mixed", "user", compile=True),
    "lightning+compile:bf16-true": CaseSpec("lightning", "bf16-true", "user", compile=True),
    "mptrain+compile:bf16-mixed": CaseSpec("mptrain", "bf16-mixed", "user", compile=True),
    # fp8 GEMMs pay where the linears are wide: the Llama's (docs/fp8.md); BERT-base's and ResNet's one fc are not
    "mptrain+compile:fp8-master": CaseSpec("mptrain", "fp8-master", "user", compile=True, models=("user_llama",)),
}
ALL_MODELS = MODELS + USER_MODELS


def cases_of(model: str) -> dict[str, CaseSpec]:
    """The cases a model runs in: the user models' own list, or the mptrain-module models'."""
    cases = USER_CASES if model in USER_MODELS else CASES
    return {n: s for n, s in cases.items() if s.models is None or model in s.models}
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
    peak_mem_gb: Optional[float] = None  # torch.cuda.max_memory_allocated() from the case's start
    mem_start_gb: Optional[float] = None  # still allocated when the case started (the previous cases' leftovers)
    mem_end_gb: Optional[float] = None  # still allocated after the case, its trainer and model collected
    mem_phases: Optional[dict] = None  # one steady-state step: allocated and peak GB by phase (MemoryPhases)
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


GB = 2**30


class MemoryPhases(L.Callback):
    """CUDA memory through one steady-state train batch (the ``step``-th, counted from 1): allocated at its start
    and after each phase, and each phase's peak -- ``forward`` (training_step with the loss, then Lightning's
    zero_grad), ``backward``, ``optimizer`` (mptrain's grad copy-up, clipping, the step, the params' copy-down) --
    in GB.  The peak statistic is reset at each phase's start, so :meth:`peak` keeps the case's overall peak."""

    PHASES = ("forward", "backward", "optimizer")

    def __init__(self, step: int, cuda: bool):
        self.step, self.cuda, self.count = step, cuda, 0
        self.gb: dict[str, float] = {}
        self.before: int = 0  # max_memory_allocated() before the measured batch
        self._peaks: list[int] = []
        self._next: Optional[str] = None  # the phase in progress

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.count += 1
        if self.cuda and self.count == self.step:
            self.before = torch.cuda.max_memory_allocated()
            self.gb["start"] = torch.cuda.memory_allocated() / GB
            torch.cuda.reset_peak_memory_stats()
            self._next = "forward"

    def on_before_backward(self, trainer, pl_module, loss):
        self._end("forward")

    def on_after_backward(self, trainer, pl_module):
        self._end("backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._end("optimizer")

    def _end(self, phase: str) -> None:
        if self._next != phase:
            return
        peak = torch.cuda.max_memory_allocated()
        self._peaks.append(peak)
        self.gb[f"{phase}_peak"] = peak / GB
        self.gb[f"after_{phase}"] = torch.cuda.memory_allocated() / GB
        torch.cuda.reset_peak_memory_stats()
        i = self.PHASES.index(phase) + 1
        self._next = self.PHASES[i] if i < len(self.PHASES) else None

    def peak(self) -> int:
        """The case's peak in bytes: before the measured batch, in its phases, and since."""
        return max([self.before, torch.cuda.max_memory_allocated(), *self._peaks])


def optimizer_factory(kind: str):
    """AdamW as each case steps it: torch's fused kernel, or mptrain's FusedAdamW (optionally owning fp32 masters)."""
    if kind == "torch-fused":
        return lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)
    from mptrain.optim import FusedAdamW

    return lambda params: FusedAdamW(params, lr=LR, weight_decay=0.01, master_weights=kind == "mptrain-master")


def _trainer(spec: CaseSpec, precision: str, model: str, callbacks: list, total: int, quick: bool):
    ours = dict(channels_last=model == "resnet50", cuda_graphs=spec.cuda_graphs,
                compile=(QUICK_COMPILE if quick else True) if spec.compile else False)
    return make_trainer(spec.trainer, precision, callbacks, total, ours, accelerator="cpu" if quick else "cuda",
                        devices=1, benchmark=True)


def _build(model: str, spec: CaseSpec, total: int, quick: bool):
    """(module, batches, batch size) of a case: the user models with their own optimizer, the others with the
    case's; Lightning's cases compile the module as Lightning's docs do, ``fit(torch.compile(module))``."""
    device = "cpu" if quick else "cuda"
    if model in USER_MODELS:
        module, batches, batch = build_user(model, total, device, quick)
    else:
        module, batches, batch = build(model, total, device, quick, stock=spec.trainer == "lightning")
        use_optimizer(module, optimizer_factory(spec.optimizer))
        if spec.trainer == "lightning" and model == "resnet50":
            module = module.to(memory_format=torch.channels_last)
    if spec.trainer == "lightning" and spec.compile:
        module = compile_lightning_module(module, **(QUICK_COMPILE if quick else {}))
    return module, batches, batch


def _fresh_start(cuda: bool) -> Optional[float]:
    """Dynamo's state of a fresh process and the previous case's objects collected; the GB still allocated.

    Each case compiles from dynamo's state of a fresh process.  Shared code (LightningModule.log, the recipe
    modules' training_step, our compiled call) otherwise keeps every earlier case's cache entries: they pile up
    across precisions, and at the recompile limit (8) dynamo runs that frame eagerly for the rest of the process
    (LightningModule.log reaches it within the full benchmark's compiled cases).  Inductor's on-disk caches stay,
    so a recompile of code seen before is quick.  The reset comes before the collection: compiled code and its
    guards hold the last case's module."""
    torch.compiler.reset()
    gc.collect()
    if not cuda:
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / GB


def run_case(model: str, name: str, precision: str, warmup: int, steps: int, quick: bool) -> Result:
    spec = cases_of(model)[name]
    res = Result(model, name, precision, batch=0)
    timer = StepTimer(warmup, steps)
    total = timer.total
    cuda = timer.cuda and not quick
    phases = MemoryPhases(warmup + steps + 1, cuda)  # the first step after the timed window
    res.mem_start_gb = _fresh_start(cuda)
    start = time.perf_counter()
    module = batches = trainer = None
    # fp8 without fp8 tensor cores (the CPU of --quick): the trainer's reason, before the model is built
    refusal = device_refusal(precision, "cpu" if quick else "cuda") if precision.startswith("fp8") else None
    if refusal is not None:
        res.status, res.message, res.mem_end_gb, res.wall_s = "not supported", refusal, res.mem_start_gb, 0.0
        return res
    try:
        module, batches, res.batch = _build(model, spec, total, quick)
        trainer = _trainer(spec, precision, model, [timer, phases], total, quick)
        trainer.fit(module, train_dataloaders=batches)
        _record(res, timer, steps, getattr(trainer, "skipped_steps", None))
        if cuda:
            res.peak_mem_gb = phases.peak() / GB
            res.mem_phases = phases.gb or None
    except (NotImplementedError, CudaGraphError) as e:  # the trainer refuses the feature: say why, never fall back
        res.status, res.message = "not supported", str(e)
    except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
        res.status, res.message = "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
    finally:
        timer.abandon()
        res.wall_s = time.perf_counter() - start
        module = batches = trainer = None  # noqa: F841 - the case's memory is collected before the next starts
        res.mem_end_gb = _fresh_start(cuda)
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
    res.peak_mem_gb = torch.cuda.max_memory_allocated() / GB if timer.cuda else None


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


def own_peak(r: Optional[Result]) -> Optional[float]:
    """A case's own peak GB: its peak less what was still allocated when it started."""
    if r is None or r.status != "ok" or r.peak_mem_gb is None:
        return None
    return r.peak_mem_gb - (r.mem_start_gb or 0.0)


def summarize_user(results: list[Result], model: str) -> dict:
    """A user model's comparison: mptrain's best case / Lightning + compile's best (speed), Lightning's eager best,
    and bf16-master's peak memory / Lightning bf16-mixed's, eager and compiled (each case's own peak)."""
    def rate(names):
        r = _rate(results, model, names)
        return None if r is None else {"case": r.case, "samples_per_s": r.samples_per_s}

    def case(name):
        return next((r for r in results if r.model == model and r.case == name), None)

    def ratio(a, b):
        return a["samples_per_s"] / b["samples_per_s"] if a and b else None

    def mem_ratio(a, b):
        pa, pb = own_peak(case(a)), own_peak(case(b))
        return pa / pb if pa is not None and pb else None

    lightning = [n for n, s in USER_CASES.items() if s.trainer == "lightning"]
    out = {"mptrain_best": rate([n for n, s in USER_CASES.items() if s.trainer == "mptrain"]),
           "lightning_compile_best": rate([n for n in lightning if USER_CASES[n].compile]),
           "lightning_best": rate([n for n in lightning if not USER_CASES[n].compile]),
           "peak_gb": {n: own_peak(case(n)) for n in USER_CASES}}
    out["ratios"] = {
        "mptrain_best / lightning_compile_best": ratio(out["mptrain_best"], out["lightning_compile_best"]),
        "mptrain_best / lightning_best": ratio(out["mptrain_best"], out["lightning_best"]),
        "peak mptrain:bf16-master / lightning:bf16-mixed": mem_ratio("mptrain:bf16-master", "lightning:bf16-mixed"),
        "peak mptrain+compile:bf16-master / lightning+compile:bf16-mixed":
            mem_ratio("mptrain+compile:bf16-master", "lightning+compile:bf16-mixed"),
    }
    return out


def format_user_summary(model: str, summary: dict) -> str:
    """The user model's two targets in one line each: speed against Lightning + compile, memory against bf16-mixed."""
    best, theirs = summary["mptrain_best"], summary["lightning_compile_best"]
    speed = summary["ratios"]["mptrain_best / lightning_compile_best"]
    mem = summary["ratios"]["peak mptrain:bf16-master / lightning:bf16-mixed"]
    peaks = summary["peak_gb"]
    return (f"{model}: speed: mptrain best ({best['case'] if best else '-'}) / Lightning + compile best "
            f"({theirs['case'] if theirs else '-'}) = {_fmt(speed, '{:.3f}x')} (target >= 1.05)\n"
            f"{model}: memory: mptrain:bf16-master peak {_fmt(peaks['mptrain:bf16-master'], '{:.2f}')} GB / "
            f"lightning:bf16-mixed peak {_fmt(peaks['lightning:bf16-mixed'], '{:.2f}')} GB = {_fmt(mem, '{:.3f}')} "
            f"(target <= 1)")


def summary_of(results: list[Result], model: str, runs: Optional[list[Result]] = None) -> dict:
    return summarize_user(results, model) if model in USER_MODELS else summarize(results, model, runs)


def format_table(results: list[Result]) -> str:
    head = (f"{'model':<13} {'case':<40} {'precision':<12} {'batch':>5} {'throughput':>14} {'vs L best':>9} "
            f"{'ms/step':>8} {'event ms':>8} {'peak GB':>8} {'start GB':>8} {'syncs/step':>10} {'skips':>5}")
    lines = [head, "-" * len(head)]
    for r in results:
        prefix = f"{r.model:<13} {r.case:<40} {r.precision:<12} {r.batch:>5}"
        if r.status != "ok":
            lines.append(f"{prefix} {r.status.upper()}: {r.message.splitlines()[0][:110]}")
            continue
        best = _rate(results, r.model, LIGHTNING_EAGER)
        unit = "img/s" if r.model.endswith("resnet50") else "seq/s"
        cells = [f"{r.samples_per_s:8.1f} {unit}", _fmt(best and r.samples_per_s / best.samples_per_s, "{:.3f}x"),
                 f"{r.step_ms:8.2f}", _fmt(r.gpu_step_ms, "{:.2f}"), _fmt(r.peak_mem_gb, "{:.2f}"),
                 _fmt(r.mem_start_gb, "{:.2f}"), _fmt(r.syncs_per_step, "{:g}"), _fmt(r.skipped_steps, "{}")]
        widths = (14, 9, 8, 8, 8, 8, 10, 5)
        lines.append(prefix + "".join(f" {c:>{w}}" for c, w in zip(cells, widths)))
    paused = [r for r in results if r.gc_full]
    for r in paused:  # a full collection's pause is in that case's ms/step: say so beside the table
        lines.append(f"note: {r.model} {r.case}: {r.gc_full} full garbage collection(s) in the timed window, "
                     f"{r.gc_ms_per_step:.2f} ms/step of collector pauses")
    for r in results:  # memory a case left behind would inflate the next one's peak: say so
        if r.mem_end_gb is not None and r.mem_end_gb > 0.01:
            lines.append(f"note: {r.model} {r.case}: {r.mem_end_gb:.2f} GB still allocated after the case was "
                         "collected")
    return "\n".join(lines)


def format_phases(results: list[Result]) -> str:
    """One steady-state step's memory by phase, per case (GB): allocated at the start, each phase's peak and what
    it leaves allocated."""
    rows = [r for r in results if r.mem_phases]
    if not rows:
        return ""
    keys = ("start", "forward_peak", "after_forward", "backward_peak", "after_backward", "optimizer_peak",
            "after_optimizer")
    head = f"{'model':<13} {'case':<40}" + "".join(f" {k:>15}" for k in keys)
    lines = ["memory of one steady-state step by phase (GB)", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.model:<13} {r.case:<40}" + "".join(f" {_fmt(r.mem_phases.get(k), '{:.2f}'):>15}"
                                                             for k in keys))
    return "\n".join(lines)


_fmt = partial(fmt, none="-")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = bench_parser("e2e", __doc__)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(ALL_MODELS)} "
                   f"(default: {', '.join(MODELS)})")
    p.add_argument("--cases", default=None,
                   help="comma list of cases (default: each model's all): " + ", ".join(CASES)
                   + "; the user models': " + ", ".join(USER_CASES))
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per case (cuDNN autotuning, compile)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per case")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of every case in alternating order: the median run of each; mixed-mode ratios by pass")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the results as JSON")
    p.add_argument("--quick", action="store_true", help="tiny models on the CPU: checks the harness, not speed")
    add_compile_cache_option(p)
    args = p.parse_args(argv)
    args.models = parse_csv(p, args.models, ALL_MODELS, "--models")
    every = tuple(dict.fromkeys([*CASES, *USER_CASES]))
    asked = parse_csv(p, args.cases, every, "--cases") if args.cases is not None else None
    args.cases = {}  # model -> its cases, in its list's order
    for model in args.models:
        valid = cases_of(model)
        args.cases[model] = [n for n in valid if asked is None or n in asked]
        if not args.cases[model]:
            p.error(f"--cases: none of {', '.join(asked)} is a case of {model}; its cases: {', '.join(valid)}")
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
    cache = CompileCache(args.compile_cache)
    print(f"[e2e] compile cache: {cache.load()}", flush=True)
    runs: list[Result] = []  # every pass's run of every case
    for model in args.models:
        for order in case_orders(args.cases[model], args.repeat, cases_of(model)):
            for name in order:
                spec = cases_of(model)[name]
                precision = best_mptrain_mode(runs, model) if spec.precision == "best" else spec.precision
                res = run_case(model, name, precision, args.warmup, args.steps, args.quick)
                runs.append(res)
                done = (f"{res.samples_per_s:.1f}/s" if res.status == "ok"
                        else f"{res.status}: {res.message.splitlines()[0]}")
                print(f"[e2e] {model} {name} ({precision}): {done} ({res.wall_s:.1f} s)", flush=True)
                _write_json(args, runs, kernels)  # a run cut short keeps what it measured
                saved = cache.save()
                if saved:
                    print(f"[e2e] compile cache: {saved}", flush=True)
    results = median_runs(runs)
    print(f"mptrain fused kernels: {kernels}")
    print(format_table(results))
    phases = format_phases(results)
    if phases:
        print(phases)
    for r in results:
        if r.sync_sites:
            print(f"host syncs, {r.model} {r.case}: " + ", ".join(f"{k} x{n}" for k, n in r.sync_sites.items()))
    for model in args.models:
        summary = summary_of(results, model, runs)
        passes = "; ".join(f"{k} = " + ", ".join(f"{x:.3f}x" for x in v)
                           for k, v in summary.get("each_pass", {}).items() if v)
        print(f"{model}: " + "; ".join(f"{k} = {_fmt(v, '{:.3f}x')}" for k, v in summary["ratios"].items())
              + (f"\n{model}, each pass: {passes}" if passes else ""))
        if model in USER_MODELS:
            print(format_user_summary(model, summary))
    return 1 if any(r.status == "error" for r in results) else 0


def case_orders(cases: list[str], repeat: int, specs: Optional[dict] = None) -> list[list[str]]:
    """The case order of each repetition: the list forwards, then backwards, and so on, so that a
    drift of the machine over the run (host clocks, caches) favours no case; "best" cases, which
    need this repetition's mode results, come last every time (``specs``: the cases' specs, CASES by default)."""
    specs = CASES if specs is None else specs
    modes = [n for n in cases if specs[n].precision != "best"]
    best = [n for n in cases if specs[n].precision == "best"]
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
        write_json(args.out, {"meta": meta, "summary": {m: summary_of(results, m, runs) for m in args.models},
                              "results": [asdict(r) for r in results]})


if __name__ == "__main__":
    sys.exit(main())
