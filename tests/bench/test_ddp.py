"""`mptrain bench ddp --cpu`: the scaling/weight-agreement harness end to end on gloo."""
from __future__ import annotations

import json

import pytest

from mptrain.bench import ddp


@pytest.mark.slow
def test_cpu_scaling_run_reports_identical_weights(tmp_path):
    out = tmp_path / "ddp.json"
    reports = tmp_path / "reports"
    rc = ddp.main(["--cpu", "--nproc", "2", "--recipes", "quickstart", "--warmup", "2", "--steps", "3",
                   "--syncs", "1", "--profile", "1", "--reports-out", str(reports), "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]["quickstart"]
    assert res["multi"]["identical_weights"] and len(res["multi"]["ranks"]) == 2
    assert res["single"]["samples_per_s"] > 0 and res["scaling_efficiency"] > 0
    names = sorted(p.name for p in reports.iterdir())
    assert names == ["quickstart-x1-profile_rank0.txt", "quickstart-x1-syncs_rank0.txt",
                     "quickstart-x2-profile_rank0.txt", "quickstart-x2-profile_rank1.txt",
                     "quickstart-x2-syncs_rank0.txt", "quickstart-x2-syncs_rank1.txt"]
    assert "profiled steps: 1" in (reports / "quickstart-x2-profile_rank1.txt").read_text()


def test_refuses_without_enough_gpus(capsys, monkeypatch):
    monkeypatch.setattr(ddp.torch.cuda, "device_count", lambda: 0)
    assert ddp.main(["--nproc", "2"]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().err
