"""evaluate_precisions on a small model trained on real data (scikit-learn's digits)."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mptrain.numerics import PrecisionTable, QuantConfig, evaluate_precisions


@pytest.fixture(scope="module")
def digits():
    """A 64-64-10 MLP trained full-batch for 60 steps (well under a second on an idle core): ~96%."""
    sklearn = pytest.importorskip("sklearn.datasets")
    bunch = sklearn.load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:1400], order[1400:]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    for _ in range(60):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[train]), y[train]).backward()
        opt.step()
    loader = DataLoader(TensorDataset(x[test], y[test]), batch_size=100)
    return model.eval(), loader


def test_fp32_bf16_within_a_point_and_int8_reported(digits):
    model, loader = digits
    table = evaluate_precisions(model, loader, "accuracy")
    assert [r["precision"] for r in table.rows] == ["32-true", "bf16-true", "16-true", "int8-dynamic"]
    fp32, bf16, fp16, int8 = table.rows
    assert fp32["metric"] > 90.0, "the model did not train"
    assert fp32["diff"] == 0.0
    assert abs(bf16["metric"] - fp32["metric"]) <= 1.0
    assert bf16["diff"] == pytest.approx(bf16["metric"] - fp32["metric"])
    # int8 is reported with its own accuracy (8-bit weights and activations cost little here).
    assert int8["status"] == "ok" and int8["metric"] is not None
    assert abs(int8["diff"]) <= 3.0
    assert int8["latency_ms"] > 0
    # fp16 on the CPU either runs or says why not -- never raises.
    assert fp16["status"] == "ok" or fp16["status"].startswith("unsupported: ")
    text = str(table)
    assert "int8-dynamic" in text and "accuracy %" in text


def test_unsupported_precision_becomes_a_row_not_an_exception(digits):
    _, loader = digits

    class NoHalf(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 10)

        def forward(self, x):
            if x.dtype == torch.float16:
                raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
            return self.lin(x)

    table = evaluate_precisions(NoHalf(), loader, "accuracy", precisions=("32-true", "16-true"))
    assert table.row("16-true")["status"].startswith("unsupported: RuntimeError")
    assert table.row("16-true")["metric"] is None and table.row("16-true")["diff"] is None
    assert table.row("32-true")["status"] == "ok"


def test_callable_and_stateful_metrics_and_quant_config(digits):
    model, loader = digits

    def error_rate(pred, target):
        return 100.0 * (pred.argmax(-1) != target).float().mean()

    class Count:
        def __init__(self):
            self.n = 0

        def reset(self):
            self.n = 0

        def update(self, pred, target):
            self.n += len(target)

        def compute(self):
            return self.n

    t1 = evaluate_precisions(model, loader, error_rate, precisions=("32-true", "int8-dynamic"),
                             quant_config=QuantConfig(weight="asymmetric", activation="asymmetric",
                                                      activation_granularity="per_tensor"))
    assert t1.metric_name == "error_rate" and t1.row("32-true")["metric"] < 10
    t2 = evaluate_precisions(model, loader, Count(), precisions=("32-true", "bf16-true"), max_batches=2)
    assert [r["metric"] for r in t2.rows] == [200.0, 200.0]


def test_unknown_precision_is_rejected(digits):
    model, loader = digits
    with pytest.raises(ValueError, match="unknown precision"):
        evaluate_precisions(model, loader, "accuracy", precisions=("int4",))


def test_table_text_formats_each_number_and_dashes_the_missing():
    table = PrecisionTable("acc", rows=[
        {"precision": "32-true", "metric": 91.25, "diff": 0.0, "latency_ms": 2.5, "speedup": 1.0, "status": "ok"},
        {"precision": "16-true", "metric": None, "diff": None, "latency_ms": None, "speedup": None,
         "status": "unsupported: RuntimeError: no half"}])
    lines = str(table).splitlines()
    assert lines[2].split() == ["32-true", "91.2500", "+0.0000", "2.500", "1.00x", "ok"]
    assert lines[3].split() == ["16-true", "—", "—", "—", "—", "unsupported:", "RuntimeError:", "no", "half"]
