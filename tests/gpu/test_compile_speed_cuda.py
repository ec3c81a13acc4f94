"""Compiled mptrain is never slower than its own eager step on a user's model: a plain LightningModule around
transformers' BertForMaskedLM and torchvision's ResNet-50 (``mptrain.bench.user_models``), bf16-master, eager
against ``compile=True``, each case from a fresh dynamo in this process (``mptrain.bench.e2e.run_case``)."""
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("model", ["user_bert", "user_resnet50"])
def test_compiled_bf16_master_is_not_slower_than_eager(model):
    pytest.importorskip("transformers" if model == "user_bert" else "torchvision")
    from mptrain.bench import e2e

    eager = e2e.run_case(model, "mptrain:bf16-master", "bf16-master", warmup=5, steps=12, quick=False)
    compiled = e2e.run_case(model, "mptrain+compile:bf16-master", "bf16-master", warmup=6, steps=12, quick=False)
    assert eager.status == "ok", eager.message
    assert compiled.status == "ok", compiled.message
    print(f"{model}: eager {eager.step_ms:.2f} ms/step, compiled {compiled.step_ms:.2f} ms/step, "
          f"peak {eager.peak_mem_gb:.2f} / {compiled.peak_mem_gb:.2f} GB")
    assert compiled.step_ms <= eager.step_ms, (
        f"{model}: compiled bf16-master {compiled.step_ms:.2f} ms/step is slower than eager {eager.step_ms:.2f}")
