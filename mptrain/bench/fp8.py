"""`python -m mptrain.bench.fp8`: compiled training steps of Llama decoders in bf16-master, with torchao's float8
linears swapped in under bf16-master, and in fp8-master, in one process.

Every case trains transformers' LlamaForCausalLM (the llama_1b recipe's builder, same seed) through
``mptrain.Trainer(compile=True)`` on the same synthetic token batches made once on the device, with a
LightningModule a user would write (next-token cross-entropy on ``self.model(input_ids=...).logits``, torch's
AdamW with ``fused=True``) and fp32 masters and moments in every case:

  bf16-master          Trainer(precision="bf16-master")
  torchao-tensorwise   torchao.float8.convert_to_float8_training(model, Float8LinearConfig.from_recipe_name(
                       "tensorwise"), every linear but lm_head) before fit, then Trainer(precision="bf16-master")
  fp8-master           Trainer(precision="fp8-master") (tensorwise, the default keep list: lm_head in bf16)
  lightning-torchao-mixed, lightning-torchao-true   the peers: torchao's tensorwise float8 linears (every linear
                       but lm_head) under plain ``lightning.Trainer(precision="bf16-mixed")`` (fp32 parameters
                       and moments) and ``"bf16-true"`` (bf16 parameters and moments, no masters), compiled as
                       Lightning's docs do, ``fit(torch.compile(module))``: how a Lightning user applies torchao
  torchao-rowwise, fp8-master-rowwise   the same with the rowwise recipe (--rowwise, or by name in --cases)
  fp8-master-delayed   Trainer(plugins=[Fp8Precision(recipe="delayed")]) (--delayed, or by name in --cases)

Models: llama1b (the recipe's: hidden 2048, 16 layers, FFN 8192, 16 heads, vocabulary 32000; batch 8 x 2048
tokens) and llama8b_layers (Llama-3-8B's layer widths: hidden 4096, FFN 14336, 32 heads, 8 KV heads; 8 layers,
vocabulary 32000; batch 4 x 2048).  Per case: ms/step, the median of the per-step times (CUDA events at each
step's end) over --steps steps after --warmup; tokens/s from it; peak memory (max_memory_allocated from the case's
start, and over the timed steps alone), and the memory of the step after the timed window by phase (allocated at
its start, the peak of the forward with the loss, of backward and of the optimizer step); host syncs per step
over 2 more steps; the seconds to the first step's end
(model build, setup and compile).  Each case starts from a fresh dynamo and with the last case's memory freed.
With ``--fused=auto`` (the default: the Trainer's default) the master modes step torch's fused AdamW through
mptrain's one-pass master-weight kernel in every case; the CUDA extension is loaded, or built (about a minute
cold), before the first case, and if it cannot be, every case runs ``fused=False`` (said in the output).
``--fused=off``: the generic master path (fp32 grads copied up, torch's fused AdamW, params copied down).

    python -m mptrain.bench.fp8 --models llama1b --out fp8.json   # 5 cases, about 5 minutes; a call per model
    python -m mptrain.bench.fp8 --models llama1b --rowwise
    python -m mptrain.bench.fp8 --models llama1b --compile-cache cc.bin   # a later run skips inductor's compiles
    python -m mptrain.bench.fp8 --quick     # a tiny Llama on the CPU: the harness (fp8-master refused, as it
                                            # should be; torchao's linears emulated)
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from functools import partial
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F

from mptrain.bench.common import bench_parser, device_meta, device_refusal, fmt, parse_csv, write_json
from mptrain.bench.compile_cache import CompileCache, add_compile_cache_option
from mptrain.bench.e2e import QUICK_COMPILE, MemoryPhases, StepTimer, format_phases, fused_kernel_status
from mptrain.bench.e2e_models import DeviceBatches, compile_lightning_module, make_trainer
from mptrain.precision.fp8 import is_float8_linear
from mptrain.precision.fp8_mlp import is_fused_mlp

LR = 3e-4
SYNC_STEPS = 2


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int


MODELS = {
    "llama1b": LlamaShape(hidden=2048, layers=16, ffn=8192, heads=16, kv_heads=16, vocab=32000, batch=8, seq=2048),
    "llama8b_layers": LlamaShape(hidden=4096, layers=8, ffn=14336, heads=32, kv_heads=8, vocab=32000, batch=4,
                                 seq=2048),
}
#: --quick: every model becomes this (sizes multiples of 16, grouped-query attention kept)
QUICK = LlamaShape(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, vocab=512, batch=2, seq=32)


@dataclass(frozen=True)
class Case:
    precision: str  # the Trainer's mode
    recipe: Optional[str] = None  # the fp8 scaling recipe (fp8-master's, or torchao's swapped in)
    torchao: bool = False  # torchao's float8 linears swapped in before fit
    trainer: str = "mptrain"  # "lightning": plain lightning.Trainer, the module compiled as Lightning's docs do

    @property
    def fp8(self) -> bool:
        return self.recipe is not None


CASES = {
    "bf16-master": Case("bf16-master"),
    "torchao-tensorwise": Case("bf16-master", "tensorwise", torchao=True),
    "fp8-master": Case("fp8-master", "tensorwise"),
    "torchao-rowwise": Case("bf16-master", "rowwise", torchao=True),
    "fp8-master-rowwise": Case("fp8-master", "rowwise"),
    "fp8-master-delayed": Case("fp8-master", "delayed"),
    "lightning-torchao-mixed": Case("bf16-mixed", "tensorwise", torchao=True, trainer="lightning"),
    "lightning-torchao-true": Case("bf16-true", "tensorwise", torchao=True, trainer="lightning"),
}
DEFAULT_CASES = ("bf16-master", "torchao-tensorwise", "fp8-master", "lightning-torchao-mixed",
                 "lightning-torchao-true")
ROWWISE_CASES = ("torchao-rowwise", "fp8-master-rowwise")
#: --delayed adds it: fp8-master with delayed scales (fp8_delayed)
DELAYED_CASES = ("fp8-master-delayed",)
#: the comparisons printed and written: (numerator, denominator)
RATIOS = (("fp8-master", "lightning-torchao-mixed"), ("fp8-master", "lightning-torchao-true"),
          ("fp8-master", "torchao-tensorwise"), ("fp8-master", "bf16-master"), ("torchao-tensorwise", "bf16-master"),
          ("fp8-master-rowwise", "torchao-rowwise"), ("fp8-master-rowwise", "bf16-master"),
          ("fp8-master-delayed", "bf16-master"), ("fp8-master-delayed", "fp8-master"),
          ("fp8-master-delayed", "lightning-torchao-mixed"), ("fp8-master-delayed", "lightning-torchao-true"))


@dataclass
class Result:
    model: str
    case: str
    precision: str
    recipe: Optional[str]
    batch: int
    seq: int
    status: str = "ok"  # "ok" | "refused" (no fp8 GEMMs on this device: the trainer's reason) | "error"
    step_ms: Optional[float] = None  # median of the per-step times
    step_ms_mean: Optional[float] = None  # the timed window's wall time / steps
    step_ms_min: Optional[float] = None
    step_ms_max: Optional[float] = None
    tokens_per_s: Optional[float] = None
    peak_mem_gb: Optional[float] = None  # max_memory_allocated from the case's start (setup, compile, steps)
    steps_peak_mem_gb: Optional[float] = None  # over the timed steps (and the sync count's) alone
    mem_phases: Optional[dict] = None  # one steady-state step after the timed window: GB by phase (MemoryPhases)
    fp8_linears: Optional[int] = None  # torchao Float8Linear modules in the trained model
    fused_mlps: Optional[int] = None  # gated MLPs run as one fused fp8 function (recipe="delayed", fp8_mlp)
    syncs_per_step: Optional[float] = None
    first_step_s: Optional[float] = None  # from the case's start to the first step's end: build, setup, compile
    wall_s: Optional[float] = None
    leftover_gb: Optional[float] = None  # memory still allocated when the case started (the last case's)
    message: Optional[str] = None


class CausalLM(L.LightningModule):
    """What a user writes around transformers' model: next-token cross-entropy on ``self.model``'s logits."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())

    def configure_optimizers(self):
        fused = True if next(self.parameters()).is_cuda else None  # torch's fused kernel where it has one
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1, fused=fused)


class StepTimes(StepTimer):
    """``StepTimer`` (the timed window's wall and CUDA-event time, then the host syncs) plus each timed step's own
    time (a CUDA event, or the wall clock on the CPU, at every step's end), the time from ``start`` (a
    ``perf_counter`` value) to the first step's end, and the peak memory before the window and within it."""

    def __init__(self, warmup: int, steps: int, cuda: bool, start: float):
        super().__init__(warmup, steps, SYNC_STEPS if cuda else 0)
        self.cuda = cuda  # the device trained on (a --quick run on a GPU machine trains on the CPU)
        self.start = start
        self.marks: list = []
        self.first_step_s: Optional[float] = None
        self.before_peak = 0  # bytes: setup, compile and warm-up

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = self.count + 1
        if n == 1:
            self.first_step_s = time.perf_counter() - self.start
        if n == self.warmup + self.steps:
            self._mark()  # the last timed step's end, before the window closes (and synchronizes)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.warmup <= n < self.warmup + self.steps:
            self._mark()  # after the window opened (garbage collected, synchronized)

    def _open(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.before_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        super()._open()

    def _mark(self) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((event, time.perf_counter()))

    def step_ms(self) -> list[float]:
        """Each timed step's milliseconds (call after the run: the events have completed)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a[0].elapsed_time(b[0]) for a, b in zip(self.marks, self.marks[1:])]
        return [1e3 * (b[1] - a[1]) for a, b in zip(self.marks, self.marks[1:])]


def build_model(shape: LlamaShape, device: str, case: Case) -> torch.nn.Module:
    """The recipe's LlamaForCausalLM at ``shape``, initialized on ``device`` from seed 0; torchao's float8 linears
    swapped in for every linear but ``lm_head`` when the case asks."""
    from mptrain.models.llama import build_llama

    torch.manual_seed(0)
    with torch.device(device):
        model = build_llama(shape.vocab, shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.ffn,
                            max_position_embeddings=shape.seq)
    if case.torchao:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(case.recipe),
                                   module_filter_fn=lambda m, fqn: fqn != "lm_head")
    return model


def token_batches(shape: LlamaShape, steps: int, device: str) -> DeviceBatches:
    """Random token ids (batch x seq), four distinct batches made once on the device."""
    return DeviceBatches(lambda g: torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g,
                                                 device=device), steps, device)


def fp8_refusal(name: str, case: Case, device: str) -> Optional[str]:
    """Why ``device`` cannot run the case's fp8 GEMMs, in fp8-master's own words (its setup check), or None.
    On the CPU (``--quick``) torchao's linears run, emulated: the harness check of the torchao cases."""
    if not case.fp8 or (case.torchao and device == "cpu"):
        return None
    why = device_refusal("fp8-master", device)
    if why is None or case.precision == "fp8-master":
        return why
    return f"{name} needs fp8 GEMMs as fp8-master does: {why}"


def _trainer(case: Case, callbacks: list, total: int, device: str, compile_args, fused):
    if case.trainer == "lightning":
        return make_trainer("lightning", case.precision, callbacks, total, {},
                            accelerator="cuda" if device == "cuda" else "cpu", devices=1)
    ours = {"compile": compile_args}
    plugins = []
    if case.precision == "fp8-master" and case.recipe != "tensorwise":
        from mptrain import Fp8Precision

        plugins.append(Fp8Precision(case.precision, recipe=case.recipe, fused=fused))
    else:
        ours["fused"] = fused  # the precision string: mptrain's defaults, fp8-master's tensorwise
    return make_trainer("mptrain", None if plugins else case.precision, callbacks, total, ours, plugins=plugins,
                        accelerator="cuda" if device == "cuda" else "cpu", devices=1)


def run_case(model: str, name: str, shape: LlamaShape, warmup: int, steps: int, device: str, compile_args,
             fused) -> Result:
    """One case from a fresh dynamo and freed memory; ``fused``: the Trainer's ``fused`` ("auto" or False)."""
    case = CASES[name]
    res = Result(model, name, case.precision, case.recipe, shape.batch, shape.seq)
    refusal = fp8_refusal(name, case, device)
    if refusal is not None and case.torchao:
        res.status, res.message = "refused", refusal
        return res
    # A fresh dynamo per case (no cache entries or recompile counts from the cases before), and the last case's
    # trainer, model and optimizer state collected before the peak is reset.
    torch.compiler.reset()
    gc.collect()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        res.leftover_gb = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    timer = StepTimes(warmup, steps, cuda, start)
    phases = MemoryPhases(warmup + steps + 1, cuda)  # the first step after the timed window: where the peak is
    try:
        module = CausalLM(build_model(shape, device, case))
        if case.trainer == "lightning":
            module = compile_lightning_module(module, **({} if compile_args is True else compile_args))
        trainer = _trainer(case, [timer, phases], timer.total, device, compile_args, fused)
        trainer.fit(module, train_dataloaders=token_batches(shape, timer.total, device))
        _record(res, timer, shape, phases)
        res.fp8_linears = sum(is_float8_linear(m) for m in module.modules())
        res.fused_mlps = sum(is_fused_mlp(m) for m in module.modules())
    except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
        if refusal is not None and str(e) == refusal and timer.count == 0:  # fp8-master refused at setup, as due
            res.status, res.message = "refused", refusal
        else:
            res.status, res.message = "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
    finally:
        timer.abandon()
        res.wall_s = time.perf_counter() - start
    return res


def _record(res: Result, timer: StepTimes, shape: LlamaShape, phases: Optional[MemoryPhases] = None) -> None:
    if timer.t1 is None or (timer.cuda and timer.syncs is None):
        raise RuntimeError(f"only {timer.count} steps ran; expected {timer.total}")
    per_step = timer.step_ms()
    res.step_ms = statistics.median(per_step)
    res.step_ms_min, res.step_ms_max = min(per_step), max(per_step)
    res.step_ms_mean = 1e3 * (timer.t1 - timer.t0) / timer.steps
    res.tokens_per_s = shape.batch * shape.seq * 1e3 / res.step_ms
    res.first_step_s = timer.first_step_s
    res.syncs_per_step = None if timer.syncs is None else timer.syncs / timer.sync_steps
    if timer.cuda:  # the phases reset the peak statistic after the window: their peak() keeps what came before
        steps_peak = phases.peak() if phases is not None else torch.cuda.max_memory_allocated()
        res.steps_peak_mem_gb = steps_peak / 2**30
        res.peak_mem_gb = max(steps_peak, timer.before_peak) / 2**30
        if phases is not None:
            res.mem_phases = phases.gb or None


def summarize(results: list[Result], model: str) -> dict:
    """Speed (tokens/s) and peak-memory ratios of the cases compared, for one model."""
    ok = {r.case: r for r in results if r.model == model and r.status == "ok"}

    def ratio(a: str, b: str, attr: str) -> Optional[float]:
        x, y = (getattr(ok[c], attr) if c in ok else None for c in (a, b))
        return x / y if x and y else None

    pairs = [(a, b) for a, b in RATIOS if any(r.model == model and r.case == a for r in results)
             and any(r.model == model and r.case == b for r in results)]
    return {"speed": {f"{a} / {b}": ratio(a, b, "tokens_per_s") for a, b in pairs},
            "peak_memory": {f"{a} / {b}": ratio(a, b, "peak_mem_gb") for a, b in pairs},
            "peak_memory_gb": {c: r.peak_mem_gb for c, r in ok.items()},
            "tokens_per_s": {c: r.tokens_per_s for c, r in ok.items()}}


_fmt = partial(fmt, none="-")


def format_table(results: list[Result]) -> str:
    head = (f"{'model':<15} {'case':<23} {'batch':>9} {'ms/step':>8} {'min-max':>13} {'mean':>8} {'tokens/s':>9} "
            f"{'vs bf16':>7} {'peak GB':>7} {'steps GB':>8} {'fp8 lin':>7} {'fused':>5} {'syncs':>5} {'1st s':>6} "
            f"{'case s':>6}")
    lines = [head, "-" * len(head)]
    for r in results:
        prefix = f"{r.model:<15} {r.case:<23} {f'{r.batch}x{r.seq}':>9}"
        if r.status != "ok":
            lines.append(f"{prefix} {r.status.upper()}: {r.message.splitlines()[0][:150]}")
            continue
        base = next((b for b in results if b.model == r.model and b.case == "bf16-master" and b.status == "ok"), None)
        cells = [(f"{r.step_ms:.1f}", 8), (f"{r.step_ms_min:.1f}-{r.step_ms_max:.1f}", 13),
                 (f"{r.step_ms_mean:.1f}", 8), (f"{r.tokens_per_s:.0f}", 9),
                 (_fmt(base and r.tokens_per_s / base.tokens_per_s, "{:.3f}x"), 7),
                 (_fmt(r.peak_mem_gb, "{:.1f}"), 7), (_fmt(r.steps_peak_mem_gb, "{:.1f}"), 8),
                 (f"{r.fp8_linears}", 7), (f"{r.fused_mlps}", 5), (_fmt(r.syncs_per_step, "{:g}"), 5),
                 (_fmt(r.first_step_s, "{:.0f}"), 6),
                 (f"{r.wall_s:.0f}", 6)]
        lines.append(prefix + "".join(f" {c:>{w}}" for c, w in cells))
    return "\n".join(lines)


def format_summary(model: str, summary: dict) -> str:
    speed = "; ".join(f"{k} = {_fmt(v, '{:.3f}x')}" for k, v in summary["speed"].items())
    gb = ", ".join(f"{c} {_fmt(v, '{:.1f}')}" for c, v in summary["peak_memory_gb"].items())
    mem = "; ".join(f"{k} = {_fmt(v, '{:.3f}x')}" for k, v in summary["peak_memory"].items())
    return f"{model}: speed (tokens/s) {speed}\n{model}: peak memory GB: {gb or '-'}; {mem}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = bench_parser("fp8", __doc__)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help=f"comma list of {', '.join(CASES)} (default: {', '.join(DEFAULT_CASES)})")
    p.add_argument("--rowwise", action="store_true", help=f"also run {', '.join(ROWWISE_CASES)}")
    p.add_argument("--delayed", action="store_true", help=f"also run {', '.join(DELAYED_CASES)}")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per case (the compile happens in the first)")
    p.add_argument("--steps", type=int, default=15, help="timed steps per case")
    p.add_argument("--fused", choices=("auto", "off"), default="auto",
                   help="the Trainer's fused= in every case (auto: mptrain's one-pass master AdamW kernel, the CUDA "
                        "extension built or loaded before the first case; off: the generic master path)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the results as JSON (after each case)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny Llama on the CPU, compiled with the eager backend: checks the harness, not speed")
    add_compile_cache_option(p)
    args = p.parse_args(argv)
    args.models = parse_csv(p, args.models, tuple(MODELS), "--models")
    args.cases = parse_csv(p, args.cases, tuple(CASES), "--cases")
    if args.rowwise:
        args.cases += [c for c in ROWWISE_CASES if c not in args.cases]
    if args.delayed:
        args.cases += [c for c in DELAYED_CASES if c not in args.cases]
    if args.warmup < 1 or args.steps < 2:
        p.error(f"--warmup {args.warmup} / --steps {args.steps}: need --warmup >= 1 and --steps >= 2")
    return args


def extension_for(fused: str, quick: bool) -> tuple:
    """(the Trainer's ``fused`` for every case, what the cases run, in words).  ``auto`` loads or builds mptrain's
    CUDA extension now, so no case pays the build; without it every case runs ``fused=False``: the references of
    the kernels would be timed otherwise."""
    if fused == "off":
        return False, "off (fused=False: the generic master path)"
    t = time.perf_counter()
    status = fused_kernel_status(quick)
    if quick:
        return "auto", status
    from mptrain.ops.build import extension_status

    if extension_status() != "built":
        return False, f"off: fused=False in every case, the extension is unavailable ({status})"
    return "auto", f"auto: mptrain's kernels ({status}; {time.perf_counter() - t:.0f} s before the first case)"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.quick and not torch.cuda.is_available():
        print("python -m mptrain.bench.fp8: needs a CUDA GPU (none visible); --quick runs a tiny Llama on the CPU",
              file=sys.stderr)
        return 2
    device = "cpu" if args.quick else "cuda"
    fused, kernels = extension_for(args.fused, args.quick)
    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = "not installed (the fp8 cases fail: pip install 'mptrain[fp8]')"
    meta = {**device_meta(), "torchao": torchao_version, "warmup": args.warmup, "steps": args.steps,
            "quick": args.quick, "fused": kernels,
            "models": {m: asdict(QUICK if args.quick else MODELS[m]) for m in args.models}}
    print(f"[fp8] {meta}", flush=True)
    cache = CompileCache(args.compile_cache)
    print(f"[fp8] compile cache: {cache.load()}", flush=True)
    compile_args = QUICK_COMPILE if args.quick else True
    results: list[Result] = []
    t0 = time.perf_counter()
    for model in args.models:
        shape = QUICK if args.quick else MODELS[model]
        for name in args.cases:
            res = run_case(model, name, shape, args.warmup, args.steps, device, compile_args, fused)
            results.append(res)
            done = (f"{res.step_ms:.1f} ms/step, {res.tokens_per_s:.0f} tokens/s, "
                    f"peak {_fmt(res.peak_mem_gb, '{:.1f}')} GB, first step at {res.first_step_s:.0f} s"
                    if res.status == "ok" else f"{res.status}: {res.message.splitlines()[0]}")
            print(f"[fp8] {model} {name}: {done} ({_fmt(res.wall_s, '{:.0f}')} s; {time.perf_counter() - t0:.0f} s "
                  "in all)",
                  flush=True)
            if res.leftover_gb and res.leftover_gb > 1:
                print(f"[fp8] warning: {res.leftover_gb:.1f} GB still allocated when {model} {name} started",
                      flush=True)
            if args.out:  # a run cut short keeps what it measured
                write_json(args.out, {"meta": meta, "summary": {m: summarize(results, m) for m in args.models},
                                      "results": [asdict(r) for r in results]})
            saved = cache.save()
            if saved:
                print(f"[fp8] compile cache: {saved}", flush=True)
    print(format_table(results))
    phase_table = format_phases(results)
    if phase_table:
        print(phase_table)
    for model in args.models:
        print(format_summary(model, summarize(results, model)))
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
