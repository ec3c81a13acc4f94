"""bench.common's loop timers: call counts and which span each one times (CPU: the
CUDA synchronize is replaced by a recorder)."""
import time

import torch

from mptrain.bench import common


def _recording(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: events.append("sync"))
    return events


def test_loop_timers_call_warmup_plus_calls(monkeypatch):
    _recording(monkeypatch)
    n = []
    common.host_us(lambda: n.append(1), calls=7, warmup=3)
    assert len(n) == 10
    n.clear()
    common.loop_ms(lambda: n.append(1), calls=5, warmup=2)
    assert len(n) == 7


def test_loop_ms_waits_for_the_gpu_inside_its_span_and_host_us_does_not(monkeypatch):
    # A synchronize that takes 20 ms stands for GPU work still queued after the last call.
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: time.sleep(0.02))
    assert common.loop_ms(lambda: None, calls=2, warmup=0) >= 10.0  # 20 ms / 2 calls
    assert common.host_us(lambda: None, calls=2, warmup=0) < 5000.0  # the wait is outside
