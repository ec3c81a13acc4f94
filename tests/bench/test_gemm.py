"""mptrain bench gemm: the CPU-side logic (sizes, FLOPs, support table, operands, table, exit codes)."""

import pytest
import torch

from mptrain.bench import gemm


def test_parse_sizes_and_dtypes():
    assert gemm.parse_sizes("1024, 4096,8192") == [1024, 4096, 8192]
    for bad in ("", "1024,x", "0", "-5"):
        with pytest.raises(ValueError, match="--sizes"):
            gemm.parse_sizes(bad)
    assert gemm.parse_dtypes("bf16,int8") == ["bf16", "int8"]
    with pytest.raises(ValueError, match="fp4"):
        gemm.parse_dtypes("bf16,fp4")


def test_flops():
    assert gemm.gemm_flops(8192) == 2 * 8192**3


def test_support_table():
    h200, a100, v100 = (9, 0), (8, 0), (7, 0)
    assert all(gemm.unsupported_reason(d, h200) is None for d in gemm.DTYPES)
    assert gemm.unsupported_reason("fp8", a100).startswith("needs compute capability >= 8.9")
    assert gemm.unsupported_reason("bf16", a100) is None
    assert gemm.unsupported_reason("bf16", v100) is not None and gemm.unsupported_reason("fp16", v100) is None
    assert gemm.unsupported_reason("int8", v100) is not None
    assert gemm.unsupported_reason("fp32", None) == "no CUDA device"


@pytest.mark.parametrize("dtype", gemm.DTYPES)
def test_operands_are_random_never_zero_and_laid_out_for_the_kernel(dtype):
    a, b = gemm.make_operands(dtype, 64, "cpu", torch.Generator().manual_seed(0))
    assert a.shape == b.shape == (64, 64)
    for t in (a, b):
        v = t.float()
        assert (v != 0).float().mean() > 0.9 and v.std() > 0
    if dtype in ("int8", "fp8"):
        assert b.stride() == (1, 64)  # column-major, as _int_mm / _scaled_mm take it
        assert a.stride() == (64, 1)


def test_run_cases_computes_tflops_and_speedup_with_a_fake_timer(monkeypatch):
    times = {"fp32": 4.0, "tf32": 2.0, "fp16": 1.0, "bf16": 1.0, "int8": 0.5, "fp8": 0.5}
    state = {}

    def fake_timer(fn):
        fn()  # the real product runs once (CPU here)
        return times[state["dtype"]]

    real_fn = gemm.gemm_fn

    def spy(dtype):
        state["dtype"] = dtype
        return real_fn(dtype)

    monkeypatch.setattr(gemm, "gemm_fn", spy)
    monkeypatch.setattr(gemm, "products_per_call", lambda n: 2)  # keep the CPU work small
    rows = gemm.run_cases([128], list(gemm.DTYPES), (9, 0), device="cpu", timer=fake_timer)
    by = {r["dtype"]: r for r in rows}
    assert by["fp32"]["speedup_vs_fp32"] == 1.0
    assert by["bf16"]["speedup_vs_fp32"] == 4.0 and by["int8"]["speedup_vs_fp32"] == 8.0
    reps = 2  # the timed call runs `reps` products
    assert by["bf16"]["ms"] == pytest.approx(1.0 / reps)
    assert by["bf16"]["tflops"] == pytest.approx(2 * 128**3 / (1e-3 / reps) / 1e12)
    text = gemm.format_rows(rows)
    assert "TOP/s" in text and "bf16" in text


def test_unsupported_dtypes_become_rows():
    rows = gemm.run_cases([64], ["fp32", "bf16", "fp8"], (7, 0), device="cpu", timer=lambda fn: 1.0)
    by = {r["dtype"]: r for r in rows}
    assert by["fp32"]["status"] == "ok"
    assert by["bf16"]["status"].startswith("unsupported: needs compute capability")
    assert by["fp8"]["tflops"] is None and by["fp8"]["speedup_vs_fp32"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit path")
def test_main_without_gpu_exits_2(capsys):
    assert gemm.main(["--sizes", "64"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_main_rejects_bad_sizes():
    with pytest.raises(SystemExit):
        gemm.main(["--sizes", "abc"])


def test_small_products_are_batched_per_timed_call():
    assert gemm.products_per_call(8192) == 1
    assert gemm.products_per_call(4096) == 1
    assert gemm.products_per_call(1024) == 17
    assert gemm.products_per_call(64) == 64  # capped
