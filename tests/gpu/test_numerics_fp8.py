"""fp8_report on the GPU: the same numbers as on the CPU, and real torchao Float8Linear layers (fp8 GPUs)."""
import copy

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from mptrain.numerics import fp8_report  # noqa: E402


class Squash(nn.Module):
    def forward(self, x):
        return torch.cat([x[:, :2], x[:, 2:] * 1e-6], 1)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), Squash(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64))


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(256, 64, generator=g) for _ in range(n)]


def _mse(model, x):
    return model(x).float().pow(2).mean()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cuda_report_equals_the_cpu_report(recipe):
    model = _mlp()
    cpu = fp8_report(model, _batches(3), loss_fn=_mse, recipe=recipe)
    gpu = fp8_report(copy.deepcopy(model).cuda(), _batches(3), loss_fn=_mse, recipe=recipe)
    assert [la["layer"] for la in gpu.layers] == [la["layer"] for la in cpu.layers]
    for lc, lg in zip(cpu.layers, gpu.layers):
        for cc, cg in zip(lc["casts"], lg["casts"]):
            assert cg["operand"] == cc["operand"]
            for key in ("saturated_frac", "underflow_frac", "subnormal_frac"):
                assert cg[key] == pytest.approx(cc[key], abs=5e-3), (lc["layer"], cc["operand"], key)
            assert cg["rel_err"] == pytest.approx(cc["rel_err"], rel=1e-2)
            assert cg["amax"] == pytest.approx(cc["amax"], rel=5e-3)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 GEMMs need compute capability 8.9+")
def test_real_float8_linears_in_bf16():
    from torchao.float8 import convert_to_float8_training

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64))
    model = model.to(device="cuda", dtype=torch.bfloat16)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn == "2")
    batches = [b.to(torch.bfloat16) for b in _batches(2)]
    report = fp8_report(model, batches, loss_fn=_mse)
    layer = next(la for la in report.layers if la["layer"] == "2")
    assert layer["fp8_master"] == "fp8: already a Float8Linear" and layer["calls"] == 2
    for c in layer["casts"]:
        assert None not in c["scale_history"] and c["saturated_frac"] == 0 and c["rel_err"] < 0.07
