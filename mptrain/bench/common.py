"""The harness every benchmark shares (DESIGN §5): its command-line parser (``mptrain bench NAME``),
CUDA-event medians on inputs rotated among sets larger than L2 (HBM, not cache), host-loop timers,
and the result table of ours against the PyTorch baseline (ratio, % of the bandwidth floor)."""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

#: Measured device-to-device copy bandwidth on the H200 (bytes read + written), DESIGN §5.
H200_COPY_BW = 4.25e12


def device_refusal(precision: str, device: "str | torch.device") -> Optional[str]:
    """The trainer's own reason why ``device`` cannot run ``precision`` (its setup check: bf16 or fp8 without the
    hardware), or None; asked before a case builds its model."""
    from mptrain.precision.plugin import check_device_supports

    try:
        check_device_supports(precision, torch.device(device))
    except RuntimeError as e:
        return str(e)
    return None


def bench_parser(name: str, doc: Optional[str], **kwargs) -> argparse.ArgumentParser:
    """The parser of ``mptrain bench NAME``: its description is the module docstring's first paragraph, and
    flags are never abbreviated (``--step`` is not ``--steps``)."""
    description = (doc or "").split("\n\n")[0]
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return argparse.ArgumentParser(prog=f"mptrain bench {name}", description=description, allow_abbrev=False,
                                   **kwargs)


def median_ms(fn: Callable[[], object], warmup_ms: float = 25.0, rep_ms: float = 200.0) -> float:
    """Median time of ``fn`` in milliseconds: triton's do_bench (CUDA events, L2 flushed before each call)."""
    try:
        from triton.testing import do_bench
    except ImportError as e:
        raise ImportError("the GPU benchmarks time with triton's do_bench: pip install triton "
                          "(torch's CUDA wheels for Linux ship it)") from e
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _loop_seconds(fn: Callable[[], object], calls: int, warmup: int, until_gpu_done: bool) -> float:
    """Seconds per call of ``calls`` back-to-back calls from a synchronized start; the span ends
    when the host has issued the last call, or (until_gpu_done) when the GPU is done."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if until_gpu_done:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls


def host_us(fn: Callable[[], object], calls: int = 200, warmup: int = 10) -> float:
    """Host time per call in microseconds: issuing one call in a loop (the GPU may still be busy)."""
    return 1e6 * _loop_seconds(fn, calls, warmup, until_gpu_done=False)


def loop_ms(fn: Callable[[], object], calls: int = 200, warmup: int = 10) -> float:
    """Wall time per call in milliseconds of a loop from a synchronized start to a synchronized
    end, whichever of host or GPU is slower: the measure for host-bound eager calls, where CUDA
    events around each call (median_ms) miss the host time before the call's first launch."""
    return 1e3 * _loop_seconds(fn, calls, warmup, until_gpu_done=True)


def input_sets(make: Callable[[], object], bytes_per_set: int, l2_bytes: int = 60 * 2**20) -> list:
    """``make()``'s input sets, enough of them (at most 8) that cycling through them keeps the working
    set at least 4x the L2 (60 MB on the H200): consecutive calls then read HBM, not cache."""
    return [make() for _ in range(max(1, min(8, -(-4 * l2_bytes // max(1, bytes_per_set)))))]


def parse_csv(parser, text: str, valid, flag: str) -> list[str]:
    """The items of a comma list, each one of ``valid``; else ``parser.error`` names the bad ones."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in valid]
    if bad or not items:
        parser.error(f"{flag}: {', '.join(bad) or 'empty'} not valid; choose from {', '.join(valid)}")
    return items


def fmt(value, spec: str, none: str = "—") -> str:
    """``spec.format(value)``, or ``none`` for a missing value (a table cell)."""
    return none if value is None else spec.format(value)


@dataclass
class Result:
    """One benchmark case: ours against the PyTorch baseline."""

    case: str
    ours_ms: float
    torch_ms: Optional[float]
    floor_ms: Optional[float]
    extra: dict = field(default_factory=dict)

    @property
    def speedup(self) -> Optional[float]:
        return None if self.torch_ms is None else self.torch_ms / self.ours_ms

    @property
    def pct_floor(self) -> Optional[float]:
        return None if self.floor_ms is None else 100.0 * self.floor_ms / self.ours_ms

    def as_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup, "pct_floor": self.pct_floor}


def floor_ms(nbytes: float, bandwidth: float = H200_COPY_BW) -> float:
    """Time to move ``nbytes`` through HBM at the measured copy bandwidth."""
    return 1e3 * nbytes / bandwidth


def format_table(results: list[Result]) -> str:
    """A fixed-width table: case, ours, torch, torch/ours, % of floor."""
    head = f"{'case':<58} {'ours ms':>9} {'torch ms':>9} {'speedup':>8} {'% floor':>8}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.case:<58} {r.ours_ms:9.3f} {fmt(r.torch_ms, '{:9.3f}'):>9} "
                     f"{fmt(r.speedup, '{:7.2f}x'):>8} {fmt(r.pct_floor, '{:7.1f}%'):>8}")
    return "\n".join(lines)


def write_json(path: str, payload: dict, indent: int = 2) -> None:
    """``payload`` as JSON at ``path``."""
    with open(path, "w") as f:
        json.dump(payload, f, indent=indent)


def device_meta() -> dict:
    """What the numbers were measured on."""
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        meta.update(gpu=p.name, sms=p.multi_processor_count, mem_gb=round(p.total_memory / 2**30, 1))
    return meta
