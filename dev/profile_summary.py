"""A text summary of a torch.profiler run of training steps: where the step's GPU time goes
(compute kernels, NCCL kernels, idle gaps, communication not hidden behind compute) and the
top operators by GPU and by host time (lab tool, not shipped).  Used by ``dev/ddp_diag_rank.py --profile``."""
from __future__ import annotations


def _union(intervals: list[tuple[float, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def kernel_breakdown(events, steps: int, wall_s: float) -> dict:
    """Per-step milliseconds of compute kernels, NCCL kernels, exposed NCCL and GPU idle time."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    kernels = [(e.time_range.start, e.time_range.end, "nccl" in e.name.lower()) for e in events
               if e.device_type == cuda]
    compute = [(a, b) for a, b, nccl in kernels if not nccl]
    comm = [(a, b) for a, b, nccl in kernels if nccl]
    cu, co = _union(compute), _union(comm)
    both = _union(compute + comm)
    span = (both[-1][1] - both[0][0]) if both else 0.0
    per = lambda us: us / 1e3 / max(steps, 1)  # noqa: E731
    return {
        "wall_ms_per_step": 1e3 * wall_s / max(steps, 1),
        "gpu_span_ms_per_step": per(span),
        "compute_busy_ms_per_step": per(_length(cu)),
        "nccl_busy_ms_per_step": per(_length(co)),
        # NCCL time not hidden behind compute: what the union adds to the compute time alone
        "nccl_exposed_ms_per_step": per(_length(both) - _length(cu)),
        "gpu_idle_ms_per_step": per(span - _length(both)),
        "compute_kernels": len(compute),
        "nccl_kernels": len(comm),
    }


def summarize_profile(prof, steps: int, wall_s: float) -> str:
    b = kernel_breakdown(prof.events(), steps, wall_s)
    lines = [f"profiled steps: {steps}"] + [f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}"
                                             for k, v in b.items()]
    avg = prof.key_averages()
    for what in ("CUDA", "CPU"):
        lines += ["", f"== top by self {what} time",
                  avg.table(sort_by=f"self_{what.lower()}_time_total", row_limit=30, max_name_column_width=70)]
    return "\n".join(lines)
