"""fp8_report: the cast statistics are exact on known values, a layer whose input spans more than e4m3's range is
ranked first and kept in bf16, saturation shows only where a scale lags its tensor, one scale per step, and
`mptrain numerics --fp8` on the quickstart recipe."""
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from mptrain.cli import main  # noqa: E402
from mptrain.numerics import fp8_report  # noqa: E402
from mptrain.numerics.fp8 import CAST_KEYS, LAYER_KEYS, REPORT_KEYS, cast_stats, recipe_casts  # noqa: E402

QUICK = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml")
E4M3 = torch.float8_e4m3fn


class Squash(nn.Module):
    """Keeps two channels and scales the others by 1e-6: a dynamic range of 1e6 inside one tensor, beyond
    e4m3's 448 / 2^-9 (a uniform 1e-6 would change nothing: current scaling follows the amax)."""

    def forward(self, x):
        return torch.cat([x[:, :2], x[:, 2:] * 1e-6], 1)


def _mlp(fault: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), fault, nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def _batches(n: int, growth: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(64, 16, generator=g) * growth ** i for i in range(n)]


def _mse(model, x):
    return model(x).pow(2).mean()


def _cast(layer: dict, operand: str) -> dict:
    return next(c for c in layer["casts"] if c["operand"] == operand)


def _layer(report, name: str) -> dict:
    return next(la for la in report.layers if la["layer"] == name)


def test_cast_statistics_on_known_values():
    # scale 1, e4m3: 450 rounds to 448 (within half an ulp of 32), 500 saturates, 2^-7 lands on a subnormal
    # (the smallest normal is 2^-6), 2^-11 is below half the smallest subnormal 2^-9 and flushes to zero
    t = torch.tensor([[1.0, 450.0, 500.0, 2.0 ** -7, 2.0 ** -11, 0.0, math.inf]])
    v = cast_stats(t, torch.tensor(1.0), E4M3).tolist()
    assert [v[i] for i in range(6)] == [5, 1, 7, 1, 1, 1]  # non-zero finite, non-finite, all, sat, zero, subnormal
    assert v[6] == pytest.approx(2.0 ** 2 + 52.0 ** 2 + 2.0 ** -22)
    assert v[7] == pytest.approx(1 + 450.0 ** 2 + 500.0 ** 2 + 2.0 ** -14 + 2.0 ** -22)
    assert len(v) == 8


def test_recipe_casts_follow_torchao():
    tw = recipe_casts("tensorwise")
    assert [(c.key, c.dtype, c.scaling) for c in tw] == [
        ("x", E4M3, "tensor"), ("w", E4M3, "tensor"), ("dy", torch.float8_e5m2, "tensor")]
    rw = recipe_casts("rowwise")  # two axes per operand, e4m3 everywhere, power-of-2 scales
    assert [c.key for c in rw] == ["x.row", "x.col", "w.row", "w.col", "dy.row", "dy.col"]
    assert all(c.dtype == E4M3 and c.pow2 for c in rw)
    with pytest.raises(ValueError, match="'tensorwise', 'rowwise'"):
        recipe_casts("blockwise")


def test_wide_range_layer_is_ranked_first_and_kept_in_bf16():
    report = fp8_report(_mlp(Squash()), _batches(3), loss_fn=_mse, keep_bf16=["-<small>"])
    worst = report.layers[0]
    assert worst["layer"] == "3" and worst["fp8_master"] == "fp8"
    assert _cast(worst, "x")["underflow_frac"] > 0.5 and "underflow" in _cast(worst, "x")["over"]
    assert worst["flags"][0].startswith("x underflow") and worst["score"] > 10
    assert worst["advice"] == "keep in bf16: keep_bf16=['+3']"
    assert report.flagged() == ["3"] and report.keep_bf16 == ["-<small>", "+3"]
    normal = _layer(report, "5")  # Gaussian-like data: nothing flushed, error about 0.42 u
    assert all(c["underflow_frac"] < 1e-3 and c["saturated_frac"] == 0 for c in normal["casts"])
    assert _cast(normal, "x")["rel_err"] < 0.04 and not normal["flags"] and normal["advice"] is None
    assert _layer(report, "0")["fp8_master"].startswith("kept: <first>")
    assert _cast(_layer(report, "0"), "dy")["underflow_frac"] < 1e-3  # its 1e6-range gradient fits e5m2
    text = report.table()
    assert text.splitlines()[3].startswith("3 ") and "-> keep in bf16: keep_bf16=['+3']" in text
    assert text.splitlines()[-1] == report.summary() and "keep_bf16=['-<small>', '+3']" in report.summary()


def test_advice_for_a_layer_fp8_master_keeps_and_for_a_whole_keep_list():
    report = fp8_report(_mlp(Squash()), _batches(2), loss_fn=_mse)  # default policy: <small> keeps all three
    assert report.layers[0]["advice"].startswith("keep in bf16 (fp8-master keeps it already: <small>")
    assert report.keep_bf16 is None and "keeps them in bf16 already" in report.summary()
    report = fp8_report(_mlp(Squash()), _batches(2), loss_fn=_mse, keep_bf16=[])
    assert report.layers[0]["advice"] == "keep in bf16: add '3' to keep_bf16" and report.keep_bf16 == ["3"]


def test_current_scaling_never_saturates_delayed_scaling_lags_a_growing_tensor():
    batches = _batches(4, growth=4.0)
    current = fp8_report(_mlp(nn.Identity()), batches, loss_fn=_mse)
    assert all(c["saturated_frac"] == 0 for la in current.layers for c in la["casts"])
    x0 = _cast(_layer(current, "0"), "x")  # layer 0's input is the batch: its scale is 448 / amax, step by step
    assert x0["scale_history"] == pytest.approx([448 / b.abs().max().item() for b in batches], rel=1e-6)
    assert x0["scale"] == x0["scale_history"][-1] and x0["amax"] == pytest.approx(batches[-1].abs().max().item())
    delayed = fp8_report(_mlp(nn.Identity()), batches, loss_fn=_mse, scaling="delayed")
    d0 = _cast(_layer(delayed, "0"), "x")
    assert d0["scale_history"][1] == d0["scale_history"][0]  # step 1 uses step 0's amax
    assert d0["saturated_frac"] > 0.01 and "saturation" in d0["over"] and d0["rel_err"] > x0["rel_err"]
    assert delayed.amax_history_len == 16 and "delayed scaling, amax history 16" in delayed.table()
    with pytest.raises(ValueError, match="recipe='tensorwise'"):
        fp8_report(_mlp(nn.Identity()), batches, loss_fn=_mse, recipe="rowwise", scaling="delayed")


def test_the_delayed_recipe_lags_x_and_dy_and_keeps_w_at_its_own_amax():
    batches = _batches(4, growth=4.0)
    report = fp8_report(_mlp(nn.Identity()), batches, loss_fn=_mse, recipe="delayed")
    assert report.scaling == "delayed" and report.amax_history_len == 16  # the recipe's own history
    layer = _layer(report, "0")
    x, w = _cast(layer, "x"), _cast(layer, "w")
    assert x["scale_history"][1] == x["scale_history"][0] and x["saturated_frac"] > 0.01  # x lags the growth
    assert w["saturated_frac"] == 0  # current scaling: never saturates
    for conflicting in (dict(scaling="current"), dict(amax_history_len=4)):  # not the recipe: said, not ignored
        with pytest.raises(ValueError, match="fp8-master's delayed recipe"):
            fp8_report(_mlp(nn.Identity()), batches, loss_fn=_mse, recipe="delayed", **conflicting)


def test_rowwise_scales_are_powers_of_two_per_row_and_never_saturate():
    report = fp8_report(_mlp(Squash()), _batches(2), loss_fn=_mse, recipe="rowwise")
    for la in report.layers:
        assert [c["operand"] for c in la["casts"]] == ["x.row", "x.col", "w.row", "w.col", "dy.row", "dy.col"]
        for c in la["casts"]:
            assert c["saturated_frac"] == 0 and len(c["scale_history"]) == 2
            assert set(c["scale"]) == {"min", "median", "max"} and c["scale"]["min"] <= c["scale"]["median"]
            assert all(math.log2(v) == int(math.log2(v)) for v in c["scale"].values())
    # per-row scales rescue the 1e-6 channels along the tokens (x.col), not along the features (x.row)
    x3 = {c["operand"]: c for c in _layer(report, "3")["casts"]}
    assert x3["x.row"]["underflow_frac"] > 0.3 and x3["x.col"]["underflow_frac"] < 1e-3
    # rowwise casts dY to e4m3: behind the 1e-6 channels the first layer's output gradient spans 1e6 per row
    assert _cast(_layer(report, "0"), "dy.row")["underflow_frac"] > 0.3


def test_one_scale_per_step_training_with_an_optimizer_and_state_restored():
    model = _mlp(nn.Identity()).eval()
    grads = {p: torch.full_like(p, 7.0) for p in model.parameters()}
    for p, g in grads.items():
        p.grad = g
    report = fp8_report(model, _batches(5), loss_fn=_mse, steps=3)
    assert report.steps == 3 and not model.training and all(p.grad is grads[p] for p in model.parameters())
    for la in report.layers:
        assert la["calls"] == 3 and all(len(c["scale_history"]) == 3 for c in la["casts"])
        assert len(set(_cast(la, "w")["scale_history"])) == 1  # no optimizer: the weights do not change
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    trained = fp8_report(model, _batches(3), loss_fn=_mse, optimizer=opt)
    assert len(set(_cast(_layer(trained, "5"), "w")["scale_history"])) == 3


def test_output_grad_is_seen_before_an_in_place_successor():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 16))
    x = _batches(1)[0]
    report = fp8_report(model, [x], loss_fn=_mse)
    h = model[0](x).detach().requires_grad_()
    (dy,) = torch.autograd.grad(model[2](torch.relu(h)).pow(2).mean(), h)
    dy0 = _cast(_layer(report, "0"), "dy")
    assert dy0["amax"] == pytest.approx(dy.abs().max().item(), rel=1e-6)
    assert dy0["scale"] == pytest.approx(57344 / dy.abs().max().item(), rel=1e-6)


def test_json_has_the_documented_keys():
    report = fp8_report(_mlp(Squash()), _batches(2), loss_fn=_mse)
    data = json.loads(report.to_json())
    assert tuple(data) == REPORT_KEYS and data["summary"] == report.summary()
    assert all(tuple(la) == LAYER_KEYS for la in data["layers"])
    assert all(tuple(c) == CAST_KEYS for la in data["layers"] for c in la["casts"])


def test_clear_errors():
    with pytest.raises(TypeError, match="loss_fn=lambda model, batch"):
        fp8_report(_mlp(nn.Identity()), _batches(1))  # the output is a (64, 16) tensor, not a loss
    with pytest.raises(ValueError, match="no nn.Linear"):
        fp8_report(nn.Sequential(nn.ReLU()), _batches(1))
    with pytest.raises(ValueError, match="gave no batch"):
        fp8_report(_mlp(nn.Identity()), [], loss_fn=_mse)
    with pytest.raises(ValueError, match="scaling='late'"):
        fp8_report(_mlp(nn.Identity()), _batches(1), loss_fn=_mse, scaling="late")


def test_a_torchao_float8_linear_is_measured_as_converted():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = _mlp(nn.Identity())
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True),
                               module_filter_fn=lambda m, fqn: fqn == "3")
    report = fp8_report(model, _batches(2), loss_fn=_mse)
    layer = _layer(report, "3")
    assert layer["fp8_master"] == "fp8: already a Float8Linear" and layer["calls"] == 2
    assert all(None not in c["scale_history"] for c in layer["casts"])


def test_transformers_llama_modules():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 96, (2, 12))
    report = fp8_report(model, [{"input_ids": ids, "labels": ids}] * 2)  # the output's loss is the loss
    names = {la["layer"] for la in report.layers}
    assert len(names) == 2 * 7 + 1 and "model.layers.1.mlp.down_proj" in names and "lm_head" in names
    for la in report.layers:
        assert la["calls"] == 2 and all(None not in c["scale_history"] for c in la["casts"])
    assert _layer(report, "lm_head")["fp8_master"].startswith("kept: ")  # <small> at this size, else its name


def test_cli_fp8_on_the_quickstart_recipe(capsys, tmp_path):
    out = tmp_path / "fp8.json"
    assert main(["numerics", "--config", QUICK, "--fp8=true", "--steps=2", "--device=cpu", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].startswith("fp8 casts per linear layer: recipe tensorwise (current scaling), 2 steps")
    table = "\n".join(lines)
    assert "model.8 " in table and "model.11 " in table and lines[-1].startswith("summary: ")
    data = json.loads(out.read_text())
    assert tuple(data) == REPORT_KEYS and {la["layer"] for la in data["layers"]} == {"model.8", "model.11"}
    assert all(len(c["scale_history"]) == 2 for la in data["layers"] for c in la["casts"])
    assert main(["numerics", "--config", QUICK, "--fp8=true", "--fp8_recipe=rowwise", "--steps=1", "--top=1"]) == 0
    assert "x.col" in capsys.readouterr().out
    assert main(["numerics", "--config", QUICK, "--fp8=true", "--fp8_recipe=delayed", "--steps=2", "--device=cpu"]) == 0
    assert "recipe delayed (delayed scaling, amax history 16)" in capsys.readouterr().out


def test_cli_fp8_refuses_layerwise_options(capsys):
    assert main(["numerics", "--config", QUICK, "--fp8=true", "--backward=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--backward" in err[0]
    assert main(["numerics", "--config", QUICK, "--fp8=true", "--fp8_scaling=delayed", "--fp8_recipe=rowwise"]) == 2
    assert main(["numerics", "--config", QUICK, "--fp8=true", "--fp8_scaling=current", "--fp8_recipe=delayed"]) == 2
    assert "tensorwise" in capsys.readouterr().err
