"""`python -m mptrain.bench.sr --smoke`: the harness on the CPU with a tiny Llama (no speed claims): both training
cases and the optimizer-step cases run, the table and JSON come out, torchao's cases are skipped there."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from mptrain.bench import sr  # noqa: E402


@pytest.mark.slow
def test_smoke_run_prints_the_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sr.json"
    rc = sr.main(["--smoke", "--warmup", "1", "--steps", "2", "--reps", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert rc == 0, data
    e2e = {r["case"]: r for r in data["e2e"]}
    assert list(e2e) == ["bf16-master", "bf16-sr"] and all(r["status"] == "ok" for r in e2e.values())
    assert all(r["step_ms"] > 0 and r["peak_mem_gb"] is None for r in e2e.values())  # peaks: CUDA only
    assert data["e2e_summary"]["peak target met"] is None
    optim = {r["case"]: r for r in data["optim"]}
    assert list(optim) == list(sr.OPTIM_CASES)
    for case in ("mptrain-sr", "mptrain-master"):
        r = optim[case]
        assert r["status"] == "ok" and r["step_ms"] > 0 and r["bytes_per_param"] == sr.BYTES_PER_PARAM[case]
        assert r["params"] == sum(a * b for a, b in sr.matrix_shapes(sr.QUICK)) and r["tensors"] == 2 + 7 * 2
    assert optim["torchao-sr"]["status"] == "skipped"
    assert "bf16-sr" in printed and "% floor" in printed and "mptrain-sr" in printed


def test_bandwidth_floor_by_device_name():
    assert sr.copy_bandwidth("NVIDIA H100 80GB HBM3") == 3.0e12
    assert sr.copy_bandwidth("NVIDIA H200") == 4.25e12
