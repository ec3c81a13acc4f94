"""Timing a fwd+bwd step as GPU work only, the same way for our op and the baseline.

A short fwd+bwd is shorter than the Python and autograd work that launches it, so one eager
call measures the host.  Here ``steps`` calls, cycling through the input sets, are captured in
one CUDA graph, replayed under :func:`median_ms` (L2 flushed before each replay) and divided by
``steps``: launch gaps stay in the number, host overhead does not.  If capture fails, the same
calls are timed eagerly, and the method says so.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from mptrain.bench.common import median_ms


def capture_graph(fn: Callable[[], object], warmup: Optional[Callable[[], object]] = None):
    """``(graph, fn's outputs)``: ``fn`` captured in a CUDA graph, after ``warmup`` (default
    ``fn``) ran once on a side stream (lazy init, autotuning, allocator pools), as capture
    requires.  Replaying the graph rewrites the returned outputs in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warmup or fn)()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def step_ms(step: Callable[[object], object], sets: Sequence[object], rep_ms: float,
            min_steps: int = 4) -> tuple[float, str]:
    """Milliseconds per ``step(set)``, and the method used ("graph xN" or "eager xN")."""
    steps = len(sets) * max(1, -(-min_steps // len(sets)))

    def run_steps():
        return [step(sets[i % len(sets)]) for i in range(steps)]

    try:
        graph, _ = capture_graph(run_steps, warmup=lambda: [step(inp) for inp in sets])
    except Exception as e:  # noqa: BLE001 - any capture failure falls back, and is reported
        torch.cuda.synchronize()
        return median_ms(run_steps, rep_ms=rep_ms) / steps, f"eager x{steps} ({type(e).__name__})"
    ms = median_ms(graph.replay, rep_ms=rep_ms) / steps
    del graph
    return ms, f"graph x{steps}"
