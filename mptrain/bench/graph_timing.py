"""Timing a fwd+bwd step as GPU work only, the same way for our op and the baseline.

A short fwd+bwd (16384x1024 LayerNorm moves 168 MB: ~40 us at the floor) is shorter
than the Python and autograd work that launches it, so timing one eager call measures
the host.  Here ``steps`` fwd+bwd calls, cycling through the rotating input sets, are
captured in one CUDA graph; the graph is replayed under :func:`median_ms` (which
flushes L2 before each replay) and the time is divided by ``steps``.  Launch gaps
between the kernels stay in the number (a graph still launches them one after the
other); host overhead does not.  If capture fails (an op that cannot be captured),
the same ``steps`` calls are timed eagerly in one timed call instead, and the method
says so.
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


def _capture(step: Callable[[object], object], sets: Sequence[object], steps: int) -> torch.cuda.CUDAGraph:
    graph, _ = capture_graph(lambda: [step(sets[i % len(sets)]) for i in range(steps)],
                             warmup=lambda: [step(inp) for inp in sets])
    return graph


def step_ms(step: Callable[[object], object], sets: Sequence[object], rep_ms: float,
            min_steps: int = 4) -> tuple[float, str]:
    """Milliseconds per ``step(set)``, and the method used ("graph xN" or "eager xN")."""
    steps = len(sets) * max(1, -(-min_steps // len(sets)))
    try:
        graph = _capture(step, sets, steps)
    except Exception as e:  # noqa: BLE001 - any capture failure falls back, and is reported
        torch.cuda.synchronize()

        def loop():
            for i in range(steps):
                step(sets[i % len(sets)])

        return median_ms(loop, rep_ms=rep_ms) / steps, f"eager x{steps} ({type(e).__name__})"
    ms = median_ms(graph.replay, rep_ms=rep_ms) / steps
    del graph
    return ms, f"graph x{steps}"
