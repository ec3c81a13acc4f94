"""`python -m mptrain.bench.sr`: bf16-sr (stochastic rounding, no fp32 master) against bf16-master on the 1.2B Llama,
and its AdamW step alone against torchao's stochastic-rounding AdamW, in one process.

Part 1, training (``--e2e``): compiled training steps of the llama_1b recipe's LlamaForCausalLM (bench/fp8.py's
model, batch, LightningModule and timer: torch's fused AdamW, which both modes step through mptrain's kernels) in
``mptrain.Trainer(precision="bf16-master")`` and ``"bf16-sr"``: ms/step (median of per-step CUDA events), tokens/s,
peak memory (max_memory_allocated from the case's start).  bf16-sr holds no fp32 master: its peak is expected about
4 bytes per parameter (4.8e9 B, 4.49 GiB) lower; the target printed is 4.5e9 B (peaks are printed in GiB).

Part 2, the optimizer step alone (``--optim``): one AdamW step over the same model's matrices (bf16 params and
grads; the norm weights, fp32 in both modes, are left out), timed with CUDA events around ``step()``, median of
``--reps`` steps after warm-up, against the bandwidth floor: bytes read + written per parameter over the device's
copy bandwidth (3.0 TB/s on an H100, 4.25 on an H200; DESIGN §5).  Cases:

  mptrain-sr             FusedAdamW with stochastic rounding: fp32 moments, 22 B/param (grad 2, param 2+2, m 4+4, v 4+4)
  mptrain-master         FusedAdamW(master_weights=True) (bf16-master's step): 28 B/param (+ fp32 master 4+4, param 2)
  torchao-sr             torchao.optim.AdamW(bf16_stochastic_round=True) (_AdamW in torchao 0.18): its default
                         bf16 moments, 14 B/param;
                         a compiled kernel per parameter (torchao compiles its single-tensor step)
  torchao-sr-fp32-state  the same with fp32 moments (its buffers made fp32): mptrain-sr's 22 B/param

Results: a table on stdout and JSON (``--out``).  ``--smoke``: a tiny Llama on the CPU (the harness, not speed:
the CPU reference steps, torchao's cases skipped).

    python -m mptrain.bench.sr --out sr.json           # both parts: about 4 minutes on an H100
    python -m mptrain.bench.sr --optim-only            # the optimizer step alone
    python -m mptrain.bench.sr --smoke
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from mptrain.bench.common import bench_parser, device_meta, write_json
from mptrain.bench.e2e import QUICK_COMPILE
from mptrain.bench.fp8 import MODELS, QUICK, Case, CausalLM, LlamaShape, StepTimes, _record, build_model, \
    extension_for, token_batches

E2E_CASES = ("bf16-master", "bf16-sr")
OPTIM_CASES = ("mptrain-sr", "mptrain-master", "torchao-sr", "torchao-sr-fp32-state")
BYTES_PER_PARAM = {"mptrain-sr": 22, "mptrain-master": 28, "torchao-sr": 14, "torchao-sr-fp32-state": 22}
MEMORY_TARGET_GB = 4.5  # bf16-sr's peak below bf16-master's, in 1e9 bytes (the 4 B/param master of 1.2B params is
# 4.8e9 B); the peaks themselves are printed in GiB (2^30 B), as every mptrain benchmark prints them
LR, SEED = 3e-4, 1234


def copy_bandwidth(device_name: str) -> float:
    """Achieved copy bandwidth (bytes read + written per second) of the device, DESIGN §5; H200's for unknown ones."""
    return 3.0e12 if "H100" in device_name else 4.25e12


# ---------------------------------------------------------------- part 1: training steps


@dataclass
class E2EResult:
    case: str
    status: str = "ok"
    step_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    peak_mem_gb: Optional[float] = None
    steps_peak_mem_gb: Optional[float] = None
    first_step_s: Optional[float] = None
    wall_s: Optional[float] = None
    message: Optional[str] = None


def run_e2e_case(name: str, shape: LlamaShape, warmup: int, steps: int, device: str, compile_args, fused
                 ) -> E2EResult:
    """One training case from a fresh dynamo and freed memory (as bench/fp8.py's cases)."""
    from mptrain.bench.e2e_models import make_trainer
    from mptrain.bench.fp8 import Result

    res = E2EResult(name)
    torch.compiler.reset()
    gc.collect()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    timer = StepTimes(warmup, steps, cuda, start)
    try:
        module = CausalLM(build_model(shape, device, Case(name)))
        trainer = make_trainer("mptrain", name, timer, timer.total, {"compile": compile_args, "fused": fused},
                               accelerator="cuda" if cuda else "cpu", devices=1)
        trainer.fit(module, train_dataloaders=token_batches(shape, timer.total, device))
        rec = Result("llama1b", name, name, None, shape.batch, shape.seq)
        _record(rec, timer, shape)
        res.step_ms, res.tokens_per_s = rec.step_ms, rec.tokens_per_s
        res.peak_mem_gb, res.steps_peak_mem_gb, res.first_step_s = rec.peak_mem_gb, rec.steps_peak_mem_gb, \
            rec.first_step_s
        if name == "bf16-sr":  # the mode's promise: bf16 matrices, no fp32 copy in the optimizer
            opt = trainer.optimizers[0]
            assert not any("master_param" in st for st in opt.state.values()), "bf16-sr kept a master copy"
    except Exception as e:  # noqa: BLE001 - one failing case must not hide the other
        res.status, res.message = "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
    finally:
        timer.abandon()
        res.wall_s = time.perf_counter() - start
    return res


# ---------------------------------------------------------------- part 2: the optimizer step


@dataclass
class OptimResult:
    case: str
    status: str = "ok"
    params: int = 0
    tensors: int = 0
    bytes_per_param: int = 0
    step_ms: Optional[float] = None  # median over the reps (CUDA events around step(); wall clock on the CPU)
    floor_ms: Optional[float] = None
    pct_of_floor: Optional[float] = None  # floor / measured, in %
    message: Optional[str] = None


def matrix_shapes(shape: LlamaShape) -> list[tuple[int, ...]]:
    """The shapes of the model's matrices (every parameter of 2 or more dims), built on the meta device."""
    from mptrain.models.llama import build_llama

    with torch.device("meta"):
        model = build_llama(shape.vocab, shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.ffn,
                            max_position_embeddings=shape.seq)
    return [tuple(p.shape) for p in model.parameters() if p.dim() >= 2]


def _make_params(shapes, device: str) -> list[torch.nn.Parameter]:
    """bf16 params ~ N(0, 0.02) with bf16 grads ~ N(0, 1e-3) (never zeros: real values through every path)."""
    g = torch.Generator(device=device).manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=g, device=device) * 0.02).bfloat16())
        p.grad = (torch.randn(s, generator=g, device=device) * 1e-3).bfloat16()
        params.append(p)
    return params


def _optimizer(case: str, params: list, fused) -> Callable[[], object]:
    if case.startswith("mptrain"):
        from mptrain.optim import FusedAdamW

        opt = FusedAdamW(params, lr=LR, weight_decay=0.1, fused=fused, master_weights=case == "mptrain-master")
        if case == "mptrain-sr":
            opt.enable_stochastic_rounding(SEED)
        return opt.step
    try:
        import torchao.optim
    except ImportError as e:
        raise ImportError("torchao is not installed: pip install torchao") from e

    # torchao 0.18 exports its bf16 SR AdamW as _AdamW (for its quantized training), later ones as AdamW
    base = getattr(torchao.optim, "AdamW", None) or getattr(torchao.optim, "_AdamW")
    if case == "torchao-sr":
        cls = base
    else:
        class AdamWFp32State(base):
            """torchao's AdamW with fp32 moments, as bf16-sr keeps them."""

            def _new_buffer(self, p, signed):
                return torch.zeros_like(p, dtype=torch.float32)

        cls = AdamWFp32State
    opt = cls(params, lr=LR, weight_decay=0.1, bf16_stochastic_round=True)
    return opt.step


def run_optim_case(case: str, shapes, device: str, warmup: int, reps: int, fused, bandwidth: float) -> OptimResult:
    res = OptimResult(case, bytes_per_param=BYTES_PER_PARAM[case], tensors=len(shapes))
    cuda = device == "cuda"
    torch.compiler.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    try:
        params = _make_params(shapes, device)
        res.params = sum(p.numel() for p in params)
        step = _optimizer(case, params, fused)
        for _ in range(warmup):  # the first steps make the state (and torchao's compiled kernels)
            step()
        times = []
        for _ in range(reps):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                a.record()
                step()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                step()
                times.append(1e3 * (time.perf_counter() - t0))
        res.step_ms = statistics.median(times)
        res.floor_ms = 1e3 * res.params * res.bytes_per_param / bandwidth
        res.pct_of_floor = 100 * res.floor_ms / res.step_ms
    except Exception as e:  # noqa: BLE001
        res.status, res.message = "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
    finally:
        params = step = None  # noqa: F841 - freed before the next case
        gc.collect()
    return res


# ---------------------------------------------------------------- report


def _f(v, spec="{:.2f}"):
    return "-" if v is None else spec.format(v)


def format_e2e(results: list[E2EResult]) -> str:
    head = f"{'case':<12} {'ms/step':>8} {'tokens/s':>9} {'peak GB':>8} {'steps GB':>8} {'1st s':>6} {'case s':>6}"
    lines = [head, "-" * len(head)]
    for r in results:
        if r.status != "ok":
            lines.append(f"{r.case:<12} {r.status.upper()}: {r.message.splitlines()[0][:150]}")
            continue
        lines.append(f"{r.case:<12} {r.step_ms:>8.1f} {r.tokens_per_s:>9.0f} {_f(r.peak_mem_gb):>8} "
                     f"{_f(r.steps_peak_mem_gb):>8} {_f(r.first_step_s, '{:.0f}'):>6} {r.wall_s:>6.0f}")
    return "\n".join(lines)


def e2e_summary(results: list[E2EResult]) -> dict:
    ok = {r.case: r for r in results if r.status == "ok"}
    if not {"bf16-master", "bf16-sr"} <= set(ok):
        return {}
    m, s = ok["bf16-master"], ok["bf16-sr"]
    saved = None if m.peak_mem_gb is None or s.peak_mem_gb is None else m.peak_mem_gb - s.peak_mem_gb
    saved_1e9 = None if saved is None else saved * 2**30 / 1e9
    return {"speed bf16-sr / bf16-master": s.tokens_per_s / m.tokens_per_s, "peak GiB saved": saved,
            "peak GB (1e9 B) saved": saved_1e9, "peak target GB (1e9 B)": MEMORY_TARGET_GB,
            "peak target met": None if saved is None else saved_1e9 >= MEMORY_TARGET_GB}


def format_optim(results: list[OptimResult]) -> str:
    head = f"{'case':<22} {'params':>13} {'tensors':>7} {'B/param':>7} {'ms':>8} {'floor ms':>8} {'% floor':>7}"
    lines = [head, "-" * len(head)]
    for r in results:
        if r.status != "ok":
            lines.append(f"{r.case:<22} {r.status.upper()}: {r.message.splitlines()[0][:150]}")
            continue
        lines.append(f"{r.case:<22} {r.params:>13,} {r.tensors:>7} {r.bytes_per_param:>7} {r.step_ms:>8.3f} "
                     f"{r.floor_ms:>8.3f} {r.pct_of_floor:>6.1f}%")
    return "\n".join(lines)


def optim_summary(results: list[OptimResult]) -> dict:
    ok = {r.case: r for r in results if r.status == "ok"}
    out = {}
    for other in ("torchao-sr", "torchao-sr-fp32-state", "mptrain-master"):
        if "mptrain-sr" in ok and other in ok:
            out[f"{other} / mptrain-sr (time)"] = ok[other].step_ms / ok["mptrain-sr"].step_ms
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = bench_parser("sr", __doc__)
    p.add_argument("--e2e-only", action="store_true", help="only the training steps")
    p.add_argument("--optim-only", action="store_true", help="only the optimizer step")
    p.add_argument("--optim-cases", default=",".join(OPTIM_CASES), help=f"comma list of {', '.join(OPTIM_CASES)}")
    p.add_argument("--warmup", type=int, default=5, help="untimed training steps per case (the compile is in the "
                                                         "first)")
    p.add_argument("--steps", type=int, default=15, help="timed training steps per case")
    p.add_argument("--reps", type=int, default=20, help="timed optimizer steps per case")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the results as JSON")
    p.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU: the harness, not speed")
    args = p.parse_args(argv)
    args.optim_cases = [c for c in args.optim_cases.split(",") if c]
    bad = [c for c in args.optim_cases if c not in OPTIM_CASES]
    if bad:
        p.error(f"--optim-cases: unknown {bad}; choose from {', '.join(OPTIM_CASES)}")
    if args.e2e_only and args.optim_only:
        p.error("--e2e-only and --optim-only exclude each other")
    if args.warmup < 1 or args.steps < 2 or args.reps < 1:
        p.error("need --warmup >= 1, --steps >= 2, --reps >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.smoke and not torch.cuda.is_available():
        print("python -m mptrain.bench.sr: needs a CUDA GPU (none visible); --smoke runs a tiny Llama on the CPU",
              file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    shape = QUICK if args.smoke else MODELS["llama1b"]
    fused, kernels = extension_for("auto", args.smoke)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    bandwidth = copy_bandwidth(name)
    meta = {**device_meta(), "device_name": name, "copy_bandwidth_TBps": bandwidth / 1e12, "shape": asdict(shape),
            "smoke": args.smoke, "fused": kernels, "warmup": args.warmup, "steps": args.steps, "reps": args.reps}
    print(f"[sr] {name}: bandwidth floor at {bandwidth / 1e12:.2f} TB/s; {meta}", flush=True)
    out: dict = {"meta": meta}
    failed = False
    if not args.optim_only:
        e2e = []
        for case in E2E_CASES:
            e2e.append(run_e2e_case(case, shape, args.warmup, args.steps, device,
                                    QUICK_COMPILE if args.smoke else True, fused))
            print(f"[sr] e2e {case}: {e2e[-1].status} ({e2e[-1].wall_s:.0f} s)", flush=True)
        out["e2e"] = [asdict(r) for r in e2e]
        out["e2e_summary"] = e2e_summary(e2e)
        print(format_e2e(e2e))
        if out["e2e_summary"]:
            s = out["e2e_summary"]
            met = {None: "not measured", True: "met", False: "NOT met"}[s["peak target met"]]
            print(f"bf16-sr / bf16-master speed {s['speed bf16-sr / bf16-master']:.3f}x; peak memory "
                  f"{_f(s['peak GiB saved'])} GiB = {_f(s['peak GB (1e9 B) saved'])} GB (1e9 B) lower "
                  f"(target >= {MEMORY_TARGET_GB} GB: {met})")
        failed |= any(r.status != "ok" for r in e2e)
        if args.out:
            write_json(args.out, out)
    if not args.e2e_only:
        shapes = matrix_shapes(shape)
        optim = []
        for case in args.optim_cases:
            if args.smoke and case.startswith("torchao"):
                optim.append(OptimResult(case, status="skipped", message="--smoke: torchao compiles for CUDA"))
                continue
            optim.append(run_optim_case(case, shapes, device, 3, 3 if args.smoke else args.reps, fused, bandwidth))
            print(f"[sr] optim {case}: {optim[-1].status}", flush=True)
        out["optim"] = [asdict(r) for r in optim]
        out["optim_summary"] = optim_summary(optim)
        print(f"AdamW step over the {shape.hidden}-wide Llama's matrices on {name} "
              f"(floor: bytes / {bandwidth / 1e12:.2f} TB/s):")
        print(format_optim(optim))
        for k, v in out["optim_summary"].items():
            print(f"  {k}: {v:.2f}x")
        failed |= any(r.status == "error" for r in optim)
    if args.out:
        write_json(args.out, out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
