"""`python -m mptrain.bench.fp8 --quick`: the harness on the CPU with a tiny Llama (no speed claims): the table,
the JSON, fp8-master refused with the trainer's reason, torchao's linears swapped in; the full-size cases compare
the same layers in fp8."""
from __future__ import annotations

import json
import time

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchao")

from mptrain.bench import fp8  # noqa: E402


@pytest.mark.slow
def test_quick_run_prints_the_table_and_ratios_and_writes_json(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    rc = fp8.main(["--quick", "--models", "llama1b", "--warmup", "1", "--steps", "3", "--out", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    results = {r["case"]: r for r in data["results"]}
    assert rc == 0, [r["message"] for r in results.values() if r["status"] == "error"]
    assert list(results) == ["bf16-master", "torchao-tensorwise", "fp8-master", "lightning-torchao-mixed",
                             "lightning-torchao-true"]
    shape = fp8.QUICK
    for case in ("bf16-master", "torchao-tensorwise", "lightning-torchao-mixed", "lightning-torchao-true"):
        r = results[case]
        assert r["status"] == "ok", r["message"]
        assert r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"] and r["step_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(shape.batch * shape.seq * 1e3 / r["step_ms"])
        assert r["peak_mem_gb"] is None and r["syncs_per_step"] is None  # CUDA-only measurements
        assert r["first_step_s"] <= r["wall_s"]
    assert results["bf16-master"]["fp8_linears"] == 0
    for case in ("torchao-tensorwise", "lightning-torchao-mixed", "lightning-torchao-true"):
        assert results[case]["fp8_linears"] == shape.layers * 7  # q k v o gate up down; not lm_head
        assert results[case]["fused_mlps"] == 0  # torchao's own linears: nothing of fp8-master's delayed recipe
    refused = results["fp8-master"]
    assert refused["status"] == "refused" and refused["tokens_per_s"] is None
    assert "fp8 tensor cores" in refused["message"] and "'cpu'" in refused["message"]
    speed = data["summary"]["llama1b"]["speed"]
    assert speed["fp8-master / torchao-tensorwise"] is None and speed["fp8-master / bf16-master"] is None
    assert speed["fp8-master / lightning-torchao-mixed"] is None and speed["fp8-master / lightning-torchao-true"] is None
    assert speed["torchao-tensorwise / bf16-master"] == pytest.approx(
        results["torchao-tensorwise"]["tokens_per_s"] / results["bf16-master"]["tokens_per_s"])
    assert "fp8-master-rowwise / torchao-rowwise" not in speed  # only the cases that ran are compared
    assert data["meta"]["quick"] and data["meta"]["models"]["llama1b"]["hidden"] == shape.hidden
    assert "REFUSED: precision='fp8-master' needs" in printed
    assert "llama1b: speed (tokens/s) fp8-master / lightning-torchao-mixed = -" in printed
    assert "fp8-master / torchao-tensorwise = -" in printed
    assert "peak memory GB" in printed


@pytest.mark.parametrize("model, layers", [("llama1b", 16), ("llama8b_layers", 8)])
def test_torchao_and_fp8_master_run_the_same_layers_in_fp8(model, layers):
    """At the benchmark's sizes fp8-master's default keep list leaves exactly lm_head in bf16, as the torchao cases'
    filter does: the two sides of the ratio run the same GEMMs in fp8."""
    from mptrain.precision.fp8_policy import plan_fp8_layers, resolve_keep_list

    shape = fp8.MODELS[model]
    swapped = fp8.build_model(shape, "meta", fp8.CASES["torchao-tensorwise"])
    by_torchao = sorted(f"model.{n}" for n, m in swapped.named_modules() if type(m).__name__ == "Float8Linear")
    plain = fp8.CausalLM(fp8.build_model(shape, "meta", fp8.CASES["bf16-master"]))
    by_mptrain, kept = plan_fp8_layers(plain, resolve_keep_list("default"))
    assert len(by_torchao) == 7 * layers and sorted(by_mptrain) == by_torchao
    assert list(kept) == ["model.lm_head"]


def test_step_times_are_one_per_timed_step():
    timer = fp8.StepTimes(warmup=2, steps=3, cuda=False, start=time.perf_counter())
    assert timer.total == 5  # no sync-count window on the CPU
    for i in range(timer.total):
        time.sleep(0.01 * (i + 1))
        timer.on_train_batch_end(None, None, None, None, i)
    ms = timer.step_ms()
    assert len(ms) == 3 and timer.t1 is not None
    assert all(t >= 10 * (i + 3) for i, t in enumerate(ms)), ms  # steps 3, 4, 5 slept 30, 40, 50 ms
    assert timer.first_step_s >= 0.01


def test_arguments(capsys):
    args = fp8.parse_args(["--rowwise", "--cases", "fp8-master"])
    assert args.cases == ["fp8-master", "torchao-rowwise", "fp8-master-rowwise"]
    assert fp8.parse_args([]).cases == list(fp8.DEFAULT_CASES) and fp8.parse_args([]).models == list(fp8.MODELS)
    for bad in (["--models", "llama70b"], ["--cases", "fp8"], ["--steps", "1"]):
        with pytest.raises(SystemExit):
            fp8.parse_args(bad)
    assert "llama8b_layers" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_the_full_run_needs_a_gpu(capsys):
    assert fp8.main(["--models", "llama1b"]) == 2
    assert "--quick" in capsys.readouterr().err
