"""CPU smoke run of the host-cost harness (mptrain.bench.host_cost --quick)."""
import json

import pytest

from mptrain.bench import host_cost


def test_per_call_us_interleaves_the_loops_and_keeps_each_fastest():
    calls, syncs = [], []
    fns = [lambda: calls.append("a"), lambda: calls.append("b")]
    us = host_cost.per_call_us(fns, iters=50, sync=lambda: syncs.append(len(calls)), repeats=5)
    assert len(us) == 2 and all(0 < u < 1e5 for u in us)
    timed = calls[10:]  # after 5 warm-up calls each
    assert calls[:10] == ["a"] * 5 + ["b"] * 5
    assert timed == (["a"] * 10 + ["b"] * 10) * 5  # rounds alternate: a's loop, then b's
    assert syncs == [10] + [10 + 10 * k for k in range(1, 11)]  # one sync after warm-up and each loop


def test_quick_cpu_run_prints_every_op_and_writes_json(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert host_cost.main(["--device", "cpu", "--quick", "--iters", "5", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["meta"]["engine_us"] > 0 and "the engine's fixed cost" in table
    ops = {r["op"] for r in rows}
    assert ops == {"layer_norm", "rms_norm", "scaled_masked_softmax", "lstm_cell", "max_pool2d"}
    assert {r["pass_"] for r in rows} == {"fwd", "fwd+bwd"} and len(rows) == 10
    for r in rows:
        assert r["ours_us"] > 0 and r["torch_us"] > 0 and r["reference_us"] > 0
        assert r["ratio"] == pytest.approx(r["ours_us"] / r["torch_us"])
        assert r["op"] in table
    assert "ratio" in table


def test_cuda_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(host_cost.torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        host_cost.run("cuda", quick=True)
