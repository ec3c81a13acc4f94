"""Numerics toolkit on the GPU: the int8 tensor-core path, layerwise reports of BERT-base and
ResNet-50, the GEMM benchmark and the doctor (skipped without CUDA by tests/gpu/conftest.py)."""
import math
import time

import pytest
import torch
from torch import nn

from mptrain.numerics import Int8DynamicLinear, QuantConfig, compare_layerwise, int8_matmul, int8_matmul_reference
from mptrain.numerics.quant import int_mm_supported


def _int8(shape, seed):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a silent fallback to the reference must fail here
@pytest.mark.parametrize("m,k,n", [(32, 64, 64), (17, 16, 8), (256, 1024, 512), (5, 13, 7), (1, 64, 8), (100, 24, 3)])
@pytest.mark.parametrize("b_layout", ["row", "col"])
def test_int_mm_path_equals_the_reference_exactly(m, k, n, b_layout):
    a = _int8((m, k), 0)
    b = _int8((k, n), 1) if b_layout == "row" else _int8((n, k), 1).t()
    expect = int8_matmul_reference(a, b)  # CPU integer matmul
    ac, bc = a.cuda(), b.cuda()
    got = int8_matmul(ac, bc)
    torch.cuda.synchronize()
    assert got.dtype == torch.int32 and got.is_cuda
    assert torch.equal(got.cpu(), expect)
    if m > 16 and k % 8 == 0 and n % 8 == 0:
        assert int_mm_supported(ac, bc) is None  # the direct torch._int_mm path, no padding
    else:
        assert int_mm_supported(ac, bc) is not None  # padded, still exact
    assert torch.equal(int8_matmul(ac, bc, pad=False).cpu(), expect)  # the fallback is exact too


@pytest.mark.parametrize("cfg", [QuantConfig(), QuantConfig("asymmetric", "per_tensor", "asymmetric", "per_tensor")])
def test_int8_linear_cuda_matches_cpu(cfg):
    torch.manual_seed(0)
    lin = Int8DynamicLinear(nn.Linear(768, 3072), cfg)
    x = torch.randn(4, 64, 768)
    y_cpu = lin(x)
    y_gpu = lin.cuda()(x.cuda()).cpu()
    torch.testing.assert_close(y_gpu, y_cpu, rtol=1e-5, atol=1e-5)


def _check_forward(report, seconds):
    print(report.table(top=10))
    assert seconds < 30, f"compare_layerwise took {seconds:.1f}s"
    assert len(report.rows) > 50
    overflowing = [r["module"] for r in report.rows if r["overflow_frac"] > 0]
    assert not overflowing, f"overflow in {overflowing[:5]}"
    final = report.rows[-1]
    assert final["cosine"] > 0.99, final
    assert report.grad_rows and report.param_grad_rows
    # Output grads only: an inf there would reach the input end; fp16 param grads of a
    # random net may genuinely overflow (no loss scale here) and that is a finding, not a bug.
    bad = [r["module"] for r in report.grad_rows if r["overflow_frac"] > 0 or math.isnan(r["cosine"])]
    assert not bad, f"non-finite output gradients in {bad[:5]}"


@pytest.mark.parametrize("precision", ["16-master", "bf16-master"])
def test_layerwise_bert_base(precision):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ids = torch.randint(0, model.config.vocab_size, (4, 128), device="cuda")
    model, example, train_mode = model.cuda(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, False
    t0 = time.perf_counter()
    report = compare_layerwise(model, example, precision=precision, backward=True, train_mode=train_mode)
    _check_forward(report, time.perf_counter() - t0)
    # LayerNorm after every block keeps BERT's backward well conditioned: the input end is accurate.
    assert report.grad_rows[-1]["cosine"] > 0.9, report.grad_rows[-1]


def test_layerwise_resnet50():
    """Random-init ResNet-50 in train mode: the gradient at the input end is ill-conditioned.

    Measured on the CPU (docs/numerics.md, "ResNet-50 input-end gradients"): fp32 against fp64
    already differs by 4e-2 (relative L2) in conv1's output gradient, an amplification of ~6e5
    over fp32's rounding; merely rounding the weights and input to bf16 and computing in fp64
    drops its cosine to 0.36 (fp16: 0.86).  So a low cosine there is the network, not the tool.
    What must hold: the ordering of the grad rows, near-exact gradients at the output end
    (where the signal enters), accurate parameter grads of the classifier, finite output gradients
    everywhere, and fp16's 3 extra mantissa bits giving the more accurate input-end gradient.
    """
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    # Train mode (BatchNorm on batch statistics): a random-init net in eval mode blows up.
    model, example, train_mode = models.resnet50(weights=None).cuda(), torch.randn(8, 3, 224, 224, device="cuda"), True
    input_end = {}
    for precision in ("16-master", "bf16-master"):
        t0 = time.perf_counter()
        report = compare_layerwise(model, example, precision=precision, backward=True, train_mode=train_mode)
        _check_forward(report, time.perf_counter() - t0)
        grads = {r["module"]: r for r in report.grad_rows}
        assert report.grad_rows[0]["module"] == "fc" and report.grad_rows[-1]["module"] == "conv1"
        assert grads["fc"]["cosine"] > 0.9999 and grads["avgpool"]["cosine"] > 0.999, (grads["fc"], grads["avgpool"])
        params = {r["module"]: r for r in report.param_grad_rows}
        assert params["fc"]["cosine"] > 0.98, params["fc"]
        input_end[precision] = grads["conv1"]["cosine"]
        assert input_end[precision] > 0, grads["conv1"]  # noisy, but still the same direction
    assert input_end["16-master"] > input_end["bf16-master"], input_end


def test_planted_overflow_on_cuda():
    class Blowup(nn.Module):
        def forward(self, x):
            return x * 1e5

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), Blowup(), nn.Linear(64, 8)).cuda()
    report = compare_layerwise(net, torch.randn(32, 64, device="cuda"), precision="16-mixed")
    assert report.first_bad == "1" and report.worst(1) == ["1"]


def test_gemm_bench_small():
    from mptrain.bench import gemm

    cap = torch.cuda.get_device_capability()
    rows = gemm.run_cases([2048], list(gemm.DTYPES), cap)
    by = {r["dtype"]: r for r in rows}
    print(gemm.format_rows(rows))
    assert by["fp32"]["status"] == "ok" and by["bf16"]["status"] == "ok"
    assert by["bf16"]["tflops"] > 2 * by["fp32"]["tflops"]
    if cap >= (7, 5):
        assert by["int8"]["status"] == "ok", by["int8"]["status"]


def test_doctor_on_the_gpu():
    from mptrain.cli.doctor import doctor_report, format_doctor

    report = doctor_report(build_extension=False)
    g = report["gpus"][0]
    print(format_doctor(report))
    assert g["memory_gb"] > 1 and g["capability"]
    if torch.cuda.get_device_capability() >= (9, 0):
        assert all(p["ok"] for p in g["probes"].values()), g["probes"]
        assert "bf16-master" in report["recommendation"]


def test_evaluate_precisions_on_cuda():
    from torch.utils.data import DataLoader, TensorDataset

    from mptrain.numerics import evaluate_precisions

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    table = evaluate_precisions(model, DataLoader(TensorDataset(x, y), batch_size=128), "accuracy")
    print(table)
    assert [r["status"] for r in table.rows] == ["ok"] * 4, table.rows
    fp32 = table.row("32-true")["metric"]
    assert abs(table.row("bf16-true")["metric"] - fp32) <= 2.0
    assert abs(table.row("int8-dynamic")["metric"] - fp32) <= 3.0


def test_monitor_names_the_culprit_with_the_cuda_trainer(tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    import csv

    from lightning.pytorch.loggers import CSVLogger

    from mptrain import Trainer
    from mptrain.numerics import OverflowMonitor

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.inp, self.bad, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
            self.calls = 0
            self.bad.weight.register_hook(lambda gr: gr * float("inf") if self.calls == 3 else gr)

        def forward(self, x):
            return self.out(torch.relu(self.bad(torch.relu(self.inp(x)))))

        def training_step(self, batch, batch_idx):
            self.calls += 1
            return nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)),
                      batch_size=8)
    monitor = OverflowMonitor(every_n_steps=4)
    trainer = Trainer(precision="16-mixed", accelerator="cuda", devices=1, max_epochs=1,
                      logger=CSVLogger(tmp_path), enable_progress_bar=False, enable_checkpointing=False,
                      default_root_dir=str(tmp_path), callbacks=[monitor], log_every_n_steps=4,
                      loss_scaler={"init_scale": 2.0**8})
    trainer.fit(Net(), train_dataloaders=data)
    assert trainer.skipped_steps == 1
    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("overflow/bad/grad_nonfinite")]
    # the inf grad of call 3 lands in the first window (steps 1-4); only ``bad`` has non-finite grads
    assert float(rows[0]["overflow/bad/grad_nonfinite"]) > 0
    assert all(float(r["overflow/inp/grad_nonfinite"]) == 0.0 and float(r["overflow/out/grad_nonfinite"]) == 0.0
               for r in rows)
    assert all(float(r["overflow/bad/grad_nonfinite"]) == 0.0 for r in rows[1:])
