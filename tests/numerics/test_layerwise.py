"""compare_layerwise: planted faults are found and ranked first; the report's shape is the contract."""
import json
import math

import pytest
import torch
from torch import nn

from mptrain.numerics import ROW_KEYS, compare_layerwise


class Blowup(nn.Module):
    """Multiplies by 1e5: fine in fp32, beyond fp16's 65504 for |x| > 0.66."""

    def forward(self, x):
        return x * 1e5


class Cancel(nn.Module):
    """(x + 1e4) - 1e4 in the input's dtype: exact-ish in fp32, all precision lost in half."""

    def forward(self, x):
        return (x + 1e4) - 1e4


def _net(fault: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), fault, nn.Linear(32, 8), nn.Tanh(),
                         nn.Linear(8, 4))


@pytest.fixture
def x():
    return torch.randn(6, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("precision", ["16-mixed", "16-true", "16-master"])
def test_fp16_overflow_is_found_and_ranked_first(x, precision):
    report = compare_layerwise(_net(Blowup()), x, precision=precision)
    assert report.first_bad == "3"
    assert report.worst(1) == ["3"]
    row = report.rows[3]
    assert row["module"] == "3" and not row["ok"]
    assert row["overflow_frac"] > 0 and row["max_abs"] == math.inf
    det = report.details[3]
    assert det["new_nonfinite"] is True
    # Downstream modules inherit the inf but did not create it.
    assert report.details[4]["new_nonfinite"] is False
    assert not report.rows[4]["ok"]
    # Upstream modules are within tolerance in fp16.
    assert all(r["ok"] for r in report.rows[:3])
    assert "CREATES-INF/NAN" in str(report).splitlines()[3]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_precision_loss_is_found_and_ranked_first(x, precision):
    report = compare_layerwise(_net(Cancel()), x, precision=precision)
    assert report.worst(1) == ["3"]
    row = report.rows[3]
    assert not row["ok"]
    assert row["cosine"] < 0.9  # the values are gone, not just rounded
    assert row["underflow_frac"] > 0.5  # small values became exactly 0
    assert report.details[3]["local_rel_err"] > 0.5
    # Its neighbours' own (local) errors are those of ordinary rounding.
    for i in (2, 4):
        assert report.details[i]["local_rel_err"] < 0.02


def test_first_bad_with_fp16_precision_loss(x):
    # fp16 keeps Linear layers within rtol=1e-2 here, so the first bad module is the fault.
    report = compare_layerwise(_net(Cancel()), x, precision="16-mixed")
    assert report.first_bad == "3"


def test_clean_model_is_ok_in_fp16(x):
    report = compare_layerwise(_net(nn.Identity()), x, precision="16-true")
    assert report.first_bad is None
    assert all(r["ok"] and r["cosine"] > 0.9999 and r["overflow_frac"] == 0 for r in report.rows)


def test_rows_have_exactly_the_contract_keys_in_execution_order(x):
    class Reordered(nn.Module):
        def __init__(self):
            super().__init__()
            self.late = nn.Linear(8, 4)  # defined first, runs last
            self.early = nn.Linear(16, 8)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.late(self.act(self.early(x)))

    report = compare_layerwise(Reordered(), x, precision="bf16-mixed")
    assert [r["module"] for r in report.rows] == ["early", "act", "late"]
    for r in report.rows:
        assert tuple(r) == ROW_KEYS
        assert isinstance(r["ok"], bool)
        assert all(isinstance(r[k], float) for k in ROW_KEYS if k not in ("module", "ok"))


def test_to_json_round_trips(x):
    report = compare_layerwise(_net(Blowup()), x, precision="16-true", backward=True)
    data = json.loads(report.to_json())
    assert data["first_bad"] == report.first_bad == "3"
    assert [r["module"] for r in data["rows"]] == [r["module"] for r in report.rows]
    assert data["rows"][3]["max_abs"] == math.inf
    assert data["precision"] == "16-true"


def test_model_is_left_untouched(x):
    net = _net(Blowup())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    compare_layerwise(net, x, precision="16-true", backward=True)
    assert all(v.dtype == torch.float32 for v in net.state_dict().values())
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters())


def test_backward_compares_output_and_parameter_gradients(x):
    report = compare_layerwise(_net(Cancel()), x, precision="bf16-mixed", backward=True)
    assert report.grad_rows and report.param_grad_rows
    assert report.grad_rows[0]["module"] == "6"  # backward order: last layer first
    names = {r["module"] for r in report.param_grad_rows}
    assert names == {"0", "2", "4", "6"}
    for r in report.grad_rows + report.param_grad_rows:
        assert tuple(r) == ROW_KEYS


def test_gradient_underflow_in_fp16_is_reported():
    class Tiny(nn.Module):
        def forward(self, x):
            return x * 1e-6  # grads w.r.t. the input of this layer are ~1e-6 * O(1) ...

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), Tiny(), Tiny(), nn.Linear(8, 2))
    report = compare_layerwise(net, torch.randn(4, 8), precision="16-true", backward=True)
    first = {r["module"]: r for r in report.grad_rows}
    # ... and ~1e-12 after two of them: below fp16's smallest subnormal (6e-8), flushed to 0.
    assert first["0"]["underflow_frac"] > 0.9
    # Within atol (the values are tiny) but the direction is lost: all zeros.
    assert first["0"]["cosine"] < 0.5


def test_shared_module_calls_are_aggregated_and_inplace_inputs_kept():
    class DoubleInPlace(nn.Module):
        def forward(self, x):
            return x.mul_(2.0)  # not idempotent: re-running it on its overwritten input would give 4x

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.twice = DoubleInPlace()

        def forward(self, x):
            return self.twice(self.b(self.twice(self.a(x))))

    report = compare_layerwise(Shared(), torch.randn(4, 8), precision="bf16-mixed")
    assert [r["module"] for r in report.rows] == ["a", "twice", "b"]
    double = report.details[1]
    assert double["calls"] == 2
    # Only the rounding of the input to bf16 (the input was cloned before the in-place op).
    assert double["local_rel_err"] < 5e-3


def test_dict_input_and_tuple_output():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, features, scale=1.0):
            h = self.body(features) * scale
            return self.head(h), h

    report = compare_layerwise(TwoHeads(), {"features": torch.randn(4, 8), "scale": 2.0}, precision="bf16-true",
                               rtol=5e-2, atol=5e-2, backward=True)
    assert [r["module"] for r in report.rows] == ["body", "head"]
    assert report.first_bad is None


def test_unknown_precision_is_rejected(x):
    with pytest.raises(ValueError, match="not one of"):
        compare_layerwise(_net(nn.Identity()), x, precision="fp8-magic")


def test_table_is_worst_first(x):
    report = compare_layerwise(_net(Blowup()), x, precision="16-true")
    lines = str(report).splitlines()
    assert lines[0].startswith("layerwise fp32 vs 16-true")
    assert lines[3].split()[0] == "3"
    assert len([ln for ln in lines[3:-1] if ln.strip()]) == len(report.rows)
    assert lines[-1].startswith("summary: ") and "worst: 3: creates inf/NaN" in lines[-1]


class Perturbed(nn.Linear):
    """A Linear whose low-precision forward uses weights off by ``scale`` (a planted bug,
    e.g. a wrong master-to-half copy); exact in fp32."""

    def __init__(self, n, scale):
        super().__init__(n, n)
        self.scale = scale

    def forward(self, x):
        w = self.weight if x.dtype == torch.float32 else self.weight * self.scale
        return nn.functional.linear(x, w, self.bias)


def _deep(fault: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), fault]
    for _ in range(4):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(64, 10))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-mixed", "16-master"])
def test_default_tolerance_passes_a_healthy_network(precision):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    report = compare_layerwise(_deep(nn.Linear(64, 64)), x, precision=precision)
    assert report.rows and all(r["ok"] for r in report.rows), report.table()
    assert report.verdict().startswith(f"summary: all {len(report.rows)} modules within tolerance")
    # the tolerance follows the dtype's rounding: bf16 (u=2^-8) is 8x looser than fp16 (u=2^-11)
    first = report.details[0]["rtol"]
    assert first == pytest.approx(8 * (2**-8 if precision.startswith("bf16") else 2**-11))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_default_tolerance_fails_a_perturbed_layer(precision):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    scale = 1.05 if precision.startswith("bf16") else 1.01  # 5% (bf16) / 1% (fp16) off: far above rounding
    report = compare_layerwise(_deep(Perturbed(64, scale)), x, precision=precision)
    assert report.first_bad == "3" and report.worst(1) == ["3"], report.table()
    summary = report.table().splitlines()[-1]
    assert summary.startswith("summary: ") and "worst: 3: out of tolerance" in summary, summary


def test_local_error_of_a_master_norm_uses_the_half_input_it_really_gets(x):
    # In *-master a LayerNorm keeps fp32 weights: a pre-hook upcasts its half input and a
    # forward hook casts the output back. The local re-run must start from the half input
    # the layer was given (not the upcast one), so its error includes both roundings.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    report = compare_layerwise(net, x, precision="16-master")
    ln = report.details[1]
    assert ln["module"] == "1" and ln["dtype"] == "float16"
    assert 1e-5 < ln["local_rel_err"] < 2e-3


def test_fp32_shadow_runs_without_tf32_and_flags_are_restored(x):
    """CUDA convs default to TF32 (a 10-bit mantissa): the fp32 shadow must not use it."""
    seen = []

    class Probe(nn.Module):
        def forward(self, t):
            conv = getattr(torch.backends.cudnn, "conv", None)
            seen.append((torch.get_float32_matmul_precision(), getattr(conv, "fp32_precision", "ieee")))
            return t

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        compare_layerwise(_net(Probe()), x, precision="bf16-mixed", backward=True)
        assert seen and all(s == ("highest", "ieee") for s in seen), seen
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
