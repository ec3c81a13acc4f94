"""profile_summary.kernel_breakdown: busy, exposed-NCCL and idle time from kernel intervals."""
from types import SimpleNamespace

import pytest
import torch

from mptrain.bench.profile_summary import kernel_breakdown


def _kernel(name, start, end, device=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_exposed_nccl_is_the_part_no_compute_kernel_covers():
    # compute [0, 10] and [20, 30]; NCCL [5, 25] is hidden on [5, 10] and [20, 25], exposed on [10, 20]
    events = [_kernel("gemm", 0, 10), _kernel("gemm", 20, 30), _kernel("ncclAllReduce", 5, 25),
              _kernel("aten::mm", 40, 50, device=torch.autograd.DeviceType.CPU)]
    b = kernel_breakdown(events, steps=2, wall_s=0.1)
    ms = 1e-3 / 2  # microseconds per step -> milliseconds
    assert b["compute_busy_ms_per_step"] == pytest.approx(20 * ms)
    assert b["nccl_busy_ms_per_step"] == pytest.approx(20 * ms)
    assert b["nccl_exposed_ms_per_step"] == pytest.approx(10 * ms)
    assert b["gpu_idle_ms_per_step"] == pytest.approx(0.0)
    assert b["gpu_span_ms_per_step"] == pytest.approx(30 * ms)
    assert (b["compute_kernels"], b["nccl_kernels"]) == (2, 1)
    assert b["wall_ms_per_step"] == pytest.approx(50.0)


def test_idle_gaps_count_between_kernels():
    b = kernel_breakdown([_kernel("gemm", 0, 10), _kernel("nccl", 30, 40)], steps=1, wall_s=1.0)
    assert b["gpu_idle_ms_per_step"] == pytest.approx(20e-3)
    assert b["nccl_exposed_ms_per_step"] == pytest.approx(10e-3)
