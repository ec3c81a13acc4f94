"""int8 quantization: exact integer matmul, quantizer error bounds, the quantized Linear."""
import numpy as np
import pytest
import torch
from torch import nn

from mptrain.numerics import (
    Int8DynamicLinear,
    QuantConfig,
    dequantize,
    int8_matmul,
    int8_matmul_reference,
    quantization_report,
    quantize,
    quantize_activation,
    quantize_dynamic,
    quantize_weight,
)
from mptrain.numerics.quant import int_mm_supported


def _int8(shape, seed):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (5, 13, 7), (17, 64, 24), (33, 1000, 9)])
def test_reference_matmul_equals_float64_of_the_same_integer_products(m, k, n):
    a, b = _int8((m, k), 0), _int8((k, n), 1)
    out = int8_matmul_reference(a, b)
    assert out.dtype == torch.int32
    # float64 holds every partial sum exactly (|sum| <= k * 2**14 << 2**53).
    expect = a.numpy().astype(np.float64) @ b.numpy().astype(np.float64)
    np.testing.assert_array_equal(out.numpy().astype(np.float64), expect)


def test_reference_matmul_extremes_do_not_wrap():
    k = 4096
    a = torch.full((2, k), -128, dtype=torch.int8)
    b = torch.full((k, 3), -128, dtype=torch.int8)
    assert int(int8_matmul_reference(a, b)[0, 0]) == k * 128 * 128


def test_reference_matmul_raises_where_int32_would_wrap():
    k = 2**31 // (128 * 128)  # the smallest K whose extreme products (each 2**14) overflow int32
    a, b = torch.full((1, k), -128, dtype=torch.int8), torch.full((k, 1), -128, dtype=torch.int8)
    with pytest.raises(OverflowError, match="overflow int32"):
        int8_matmul_reference(a, b)
    assert int(int8_matmul_reference(a[:, :-1], b[:-1])[0, 0]) == (k - 1) * 128 * 128


def test_int8_matmul_on_cpu_is_the_reference():
    a, b = _int8((20, 16), 2), _int8((16, 8), 3)
    assert torch.equal(int8_matmul(a, b), int8_matmul_reference(a, b))
    assert int_mm_supported(a, b) == "operands are not on CUDA"


def test_int8_matmul_rejects_bad_operands():
    with pytest.raises(TypeError, match="int8"):
        int8_matmul(torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="do not multiply"):
        int8_matmul(_int8((2, 3), 0), _int8((4, 2), 1))


@pytest.mark.parametrize("scheme", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("dim", [0, None])
def test_quantize_round_trip_error_is_at_most_half_a_step(scheme, dim):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 1, 16)[:, None]
    q, scale, zero = quantize(x, scheme, dim=dim)
    assert q.dtype == torch.int8
    err = (dequantize(q, scale, zero) - x).abs()
    assert torch.all(err <= scale / 2 + 1e-7)
    if dim == 0:
        assert scale.shape == (16, 1)  # one scale per row
    else:
        assert scale.numel() == 1


def test_asymmetric_uses_the_full_range_of_a_one_sided_tensor():
    x = torch.rand(4, 64) + 0.1  # all positive: symmetric wastes half the codes
    _, s_sym, _ = quantize(x, "symmetric", dim=0)
    _, s_asym, z = quantize(x, "asymmetric", dim=0)
    assert torch.all(s_asym < s_sym * 0.6)
    assert torch.all(z == -128)  # the minimum (clamped to 0) maps to the lowest code


def test_zero_rows_and_per_channel_scales():
    w = torch.randn(4, 8)
    w[2] = 0
    q, scale, zero = quantize_weight(w, "symmetric", "per_channel")
    assert torch.all(q[2] == 0) and torch.isfinite(scale).all()
    assert torch.allclose(scale.flatten()[[0, 1, 3]], w[[0, 1, 3]].abs().amax(1) / 127)
    with pytest.raises(ValueError, match="granularity"):
        quantize_weight(w, "symmetric", "per_row")
    with pytest.raises(ValueError, match="scheme"):
        quantize(w, "logarithmic")
    with pytest.raises(ValueError, match="tokens"):
        quantize_activation(torch.randn(2, 3, 4))


def _float64_int8_linear(lin: Int8DynamicLinear, x: torch.Tensor) -> torch.Tensor:
    """The same quantized computation with zero points subtracted first, in float64."""
    cfg = lin.config
    qx, sx, zx = quantize_activation(x, cfg.activation, cfg.activation_granularity)
    xq = (qx.double() - zx.double())
    wq = lin.weight_q.double() - lin.weight_zero.double()[:, None]
    y = (xq @ wq.t()) * sx.double().reshape(-1, 1) * lin.weight_scale.double()[None, :]
    return y + lin.bias.double()


@pytest.mark.parametrize("weight", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("activation", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("wgran,agran", [("per_channel", "per_token"), ("per_tensor", "per_tensor")])
def test_int8_linear_matches_its_definition_and_the_float_layer(weight, activation, wgran, agran):
    torch.manual_seed(0)
    lin = nn.Linear(48, 24)
    cfg = QuantConfig(weight, wgran, activation, agran)
    q = Int8DynamicLinear(lin, cfg)
    x = torch.randn(10, 48) + (0.5 if activation == "asymmetric" else 0.0)
    y = q(x)
    # Zero points folded into int32 sums == zero points subtracted first (float64).
    torch.testing.assert_close(y.double(), _float64_int8_linear(q, x), rtol=1e-6, atol=1e-6)
    # And close to the float layer (8-bit: about 1% relative error).
    ref = lin(x)
    rel = (y - ref).norm() / ref.norm()
    assert rel < 0.03, f"relative error {rel:.4f}"


def test_int8_linear_keeps_leading_dims_and_dtype():
    q = Int8DynamicLinear(nn.Linear(8, 3))
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    y = q(x)
    assert y.shape == (2, 5, 3) and y.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="features"):
        q(torch.randn(2, 7))


def test_quantize_dynamic_replaces_linears_only():
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)), nn.LayerNorm(4))
    qnet = quantize_dynamic(net, skip=["2.0"])
    assert isinstance(qnet[0], Int8DynamicLinear)
    assert isinstance(qnet[2][0], nn.Linear)  # skipped
    assert isinstance(net[0], nn.Linear)  # original untouched
    x = torch.randn(4, 8)
    assert (qnet(x) - net(x)).abs().max() < 0.1
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_dynamic(nn.Sequential(nn.ReLU()))


def test_quantization_report_ranks_a_badly_scaled_layer_worst():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(64, 32)
    x[:, 5] = 0.0
    with torch.no_grad():
        # An outlier weight in every row on an input feature that is always 0: it adds nothing
        # to the output but sets the per-channel scale, so the useful weights round to few codes.
        net[0].weight[:, 5] = 50.0
    report = quantization_report(net, x)
    assert [r["module"] for r in report.rows] == ["0", "2", "4"]
    assert report.worst()["module"] == "0"
    assert report.rows[0]["out_rel_err"] > 5 * max(report.rows[1]["out_rel_err"], report.rows[2]["out_rel_err"])
    assert all(r["out_rel_err"] is not None and r["weight_sqnr_db"] > 0 for r in report.rows)
    assert "int8 quantization error" in str(report)
    # Without an input only the weight error is known.
    assert quantization_report(net).rows[0]["out_rel_err"] is None


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (5, 13, 7), (16, 8, 8), (40, 20, 3)])
def test_padding_for_int_mm_keeps_the_product_exact(m, k, n):
    # The CUDA path pads shapes torch._int_mm refuses; this torch also has _int_mm on the CPU,
    # which lets the padding and slicing be checked here.
    from mptrain.numerics.quant import _int_mm_padded

    a, b = _int8((m, k), 5), _int8((k, n), 6)
    try:
        torch._int_mm(_int8((32, 8), 0), _int8((8, 8), 1))
    except (AttributeError, RuntimeError, NotImplementedError):
        pytest.skip("this torch has no CPU torch._int_mm")
    assert torch.equal(_int_mm_padded(a, b), int8_matmul_reference(a, b))
