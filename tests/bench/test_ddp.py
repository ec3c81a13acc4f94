"""`mptrain bench ddp --cpu --quick`: the scaling/weight-agreement harness end to end on gloo with
2 ranks under torchrun, on mptrain's Lightning-native Trainer."""
from __future__ import annotations

import json

import pytest

from mptrain.bench import ddp


@pytest.mark.slow
def test_cpu_two_ranks_report_identical_weights(tmp_path):
    out = tmp_path / "ddp.json"
    rc = ddp.main(["--cpu", "--quick", "--nproc", "2", "--models", "bert", "--precision", "bf16-master",
                   "--warmup", "2", "--steps", "2", "--batch", "3", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0, data
    res = data["results"]["bert"]
    assert res["multi"]["identical_weights"] and len(res["multi"]["ranks"]) == 2
    assert {r["world_size"] for r in res["multi"]["ranks"]} == {2}
    assert {r["batch"] for r in res["multi"]["ranks"]} == {3}  # --batch reaches every rank
    assert {r["global_step"] for r in res["multi"]["ranks"]} == {2 + 2}
    assert res["single"]["samples_per_s"] > 0 and res["scaling_efficiency"] > 0


def test_refuses_without_enough_gpus(capsys, monkeypatch):
    monkeypatch.setattr(ddp.torch.cuda, "device_count", lambda: 0)
    assert ddp.main(["--nproc", "2"]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().err


def test_bad_model_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        ddp.main(["--models", "gpt2"])
    assert "resnet50, bert" in capsys.readouterr().err
