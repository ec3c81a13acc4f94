"""`mptrain bench e2e` on the CPU with tiny models (--smoke): every code path of the GPU run."""
from __future__ import annotations

import json

from mptrain.bench import e2e


def test_smoke_run_writes_json_with_both_trainers(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    rc = e2e.main(["--smoke", "--batch-resnet50", "2", "--batch-bert", "2", "--seq-len", "16", "--warmup", "1",
                   "--steps", "2", "--precisions", "32-true,bf16-master", "--lightning", "bf16-mixed",
                   "--json", str(out)])
    assert rc == 0, capsys.readouterr()
    data = json.loads(out.read_text())
    cases = data["cases"]
    assert {(c["model"], c["trainer"], c["precision"]) for c in cases} == {
        (m, t, p) for m in ("resnet50", "bert_base")
        for t, p in (("mptrain", "32-true"), ("mptrain", "bf16-master"), ("lightning", "bf16-mixed"))}
    for c in cases:
        assert c["error"] is None and c["samples_per_s"] > 0 and c["step_ms"] > 0
        assert (c["tokens_per_s"] is not None) == (c["model"] == "bert_base")
    assert set(data["summary"]) == {"resnet50", "bert_base"}
    assert all(s["ratio"] > 0 for s in data["summary"].values())
    assert "samples/s" in capsys.readouterr().out


def test_bad_arguments_are_rejected(capsys):
    import pytest

    with pytest.raises(SystemExit):
        e2e.main(["--models", "gpt2"])
    assert "resnet50, bert_base" in capsys.readouterr().err


def test_needs_a_gpu_without_smoke(monkeypatch, capsys):
    monkeypatch.setattr(e2e.torch.cuda, "is_available", lambda: False)
    assert e2e.main([]) == 2
    assert "--smoke" in capsys.readouterr().err
