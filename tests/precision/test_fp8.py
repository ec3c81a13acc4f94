"""fp8-master on the CPU: the refusal without fp8 hardware, the layer policy, and the plugin logic with the
device check lifted (torch runs fp8 ``_scaled_mm`` on the CPU; where it cannot, the GEMM is emulated by
dequantizing to fp32, which is what the tensor cores compute up to accumulation order)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchao")

import mptrain  # noqa: E402
from mptrain.precision import plugin as plugin_mod  # noqa: E402
from mptrain.precision.fp8 import Fp8Precision, unswap_fp8_linears  # noqa: E402
from mptrain.precision.fp8_policy import DEFAULT_KEEP, SMALL_WEIGHTS, plan_fp8_layers, resolve_keep_list  # noqa: E402

from _models import Classifier, classification_data, quiet_trainer  # noqa: E402


def _cpu_scaled_mm_works() -> bool:
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), torch.tensor(1.0), torch.tensor(1.0), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _emulated_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    out = (a.float() * scale_a.float()) @ (b.float() * scale_b.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or a.dtype)


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """Lift the fp8-hardware refusal for this test (the only difference from a GPU run)."""
    monkeypatch.setattr(plugin_mod, "_check_fp8_device", lambda name, device: None)
    if not _cpu_scaled_mm_works():
        monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm)


class Blocks(nn.Module):
    """An input projection, repeated blocks and a head: the shape the default policy is written for."""

    def __init__(self, d: int = 64, classes: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(),
                                                  nn.Linear(2 * d, d)) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def test_fp8_master_is_a_precision_string():
    assert "fp8-master" in mptrain.PRECISIONS
    assert isinstance(mptrain.precision.precision_plugin("fp8-master"), Fp8Precision)


def test_refused_on_cpu_before_any_step():
    model = Classifier(Blocks())
    trainer = quiet_trainer(precision="fp8-master", max_steps=2)
    loader = torch.utils.data.DataLoader(classification_data(64), batch_size=16)
    with pytest.raises(RuntimeError, match=r"fp8-master.*fp8 tensor cores.*'cpu'.*bf16-master"):
        trainer.fit(model, loader)
    assert trainer.global_step == 0 and not model.losses


def test_build_precision_refuses_cpu():
    with pytest.raises(RuntimeError, match="fp8 tensor cores"):
        mptrain.precision.build_precision("fp8-master", device="cpu")


def test_bad_recipe_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"recipe='blockwise'.*'tensorwise', 'rowwise'"):
        Fp8Precision(recipe="blockwise")


def test_keep_list_edits_and_errors():
    assert resolve_keep_list("default") == DEFAULT_KEEP
    assert resolve_keep_list([]) == ()
    edited = resolve_keep_list(["-<small>", "+blocks.0.*"])
    assert "<small>" not in edited and edited[-1] == "blocks.0.*"
    with pytest.raises(ValueError, match="unknown rule '<big>'"):
        resolve_keep_list(["<big>"])
    with pytest.raises(ValueError, match="mixes edits"):
        resolve_keep_list(["+a", "b"])
    with pytest.raises(ValueError, match="not in the default list"):
        resolve_keep_list(["-nothing"])
    with pytest.raises(ValueError, match="keep_bf16='all'"):
        resolve_keep_list("all")


def test_default_policy_keeps_input_head_small_and_ragged():
    model = Blocks(d=1024)  # block linears 1024x2048: 2^21 weights, at the <small> bound
    convert, kept = plan_fp8_layers(model, DEFAULT_KEEP)
    assert convert == ["blocks.0.1", "blocks.0.3", "blocks.1.1", "blocks.1.3"]
    assert kept["embed"].startswith("<first>")
    assert "multiples of 16" in kept["head"]  # 1024x4 is ragged before it is a head
    small = Blocks(d=64)
    convert, kept = plan_fp8_layers(small, DEFAULT_KEEP)
    assert convert == [] and all(r.startswith(("<small>", "<first>")) or "16" in r for r in kept.values())
    assert 64 * 128 < SMALL_WEIGHTS


def test_head_pattern_and_exact_linear_only():
    class Head(nn.Linear):
        pass

    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2048, 2048) for _ in range(2))
    model.lm_head = nn.Linear(2048, 32000)
    model.extra = Head(2048, 2048)
    convert, kept = plan_fp8_layers(model, DEFAULT_KEEP)
    assert convert == ["layers.0", "layers.1"]
    assert kept["lm_head"] == "keep_bf16 pattern 'lm_head'"
    assert "not an exact nn.Linear" in kept["extra"]


def test_no_fp8_layer_is_refused_not_silent(fp8_on_cpu):
    trainer = quiet_trainer(precision="fp8-master", max_steps=1)
    loader = torch.utils.data.DataLoader(classification_data(32), batch_size=16)
    with pytest.raises(ValueError, match=r"found no linear layer to run in fp8.*keep_bf16=\['-<small>'\]"):
        trainer.fit(Classifier(Blocks()), loader)


def _fit_fp8(steps: int = 30, **trainer_kw):
    torch.manual_seed(0)
    model = Classifier(Blocks(), lr=3e-3)
    plugin = Fp8Precision(keep_bf16=["-<small>"])
    trainer = quiet_trainer(plugins=[plugin], max_steps=steps, **trainer_kw)
    loader = torch.utils.data.DataLoader(classification_data(256), batch_size=32, shuffle=True)
    trainer.fit(model, loader)
    return model, plugin, trainer


def test_fp8_master_trains_with_fp32_masters(fp8_on_cpu):
    model, plugin, trainer = _fit_fp8()
    layers = {n: type(m).__name__ for n, m in model.net.named_modules() if isinstance(m, nn.Linear)}
    assert plugin.fp8_layers == ["net.blocks.0.1", "net.blocks.0.3", "net.blocks.1.1", "net.blocks.1.3"]
    assert all(layers[n.removeprefix("net.")] == "Fp8Linear" for n in plugin.fp8_layers)  # tensorwise: one cast each
    assert layers["embed"] == "Linear" and layers["head"] == "Linear"
    assert model.net.blocks[0][1].weight.dtype == torch.bfloat16
    assert model.net.blocks[0][0].weight.dtype == torch.float32  # norms keep fp32
    opt = trainer.optimizers[0]
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])  # the masters
    losses = torch.stack(model.losses).float()
    assert losses[-5:].mean() < 0.7 * losses[:5].mean()
    # the module's state dict is the fp32 masters under nn.Linear's keys
    sd = model.state_dict()
    assert sd["net.blocks.0.1.weight"].dtype == torch.float32
    assert set(sd) == set(Classifier(Blocks()).state_dict())


def test_fp8_forward_is_close_to_bf16(fp8_on_cpu):
    torch.manual_seed(0)
    net = Blocks(d=64)
    ref = Blocks(d=64)
    ref.load_state_dict(net.state_dict())
    plugin = Fp8Precision(keep_bf16=[])
    plugin.convert_module(net)
    x = torch.randn(64, 16)
    with plugin.forward_context():
        y = net(plugin.convert_input(x)).float()
    y_ref = ref(x)
    err = (y - y_ref).norm() / y_ref.norm()
    assert 0 < err < 0.1  # fp8 rounding is visible (it ran in fp8) and small
    assert plugin.fp8_layers == ["embed", "blocks.0.1", "blocks.0.3", "blocks.1.1", "blocks.1.3"]
    assert "multiples of 16" in plugin.kept_layers["head"]


def test_checkpoint_loads_into_the_plain_model(fp8_on_cpu, tmp_path):
    model, plugin, trainer = _fit_fp8(steps=4)
    path = tmp_path / "fp8.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["state_dict"]["net.blocks.0.1.weight"].dtype == torch.float32
    plain = Classifier(Blocks())
    plain.load_state_dict(ckpt["state_dict"])
    master = plugin.master_for(model.net.blocks[0][1].weight)
    assert torch.equal(plain.net.blocks[0][1].weight, master)


def test_fp32_finetune_turns_fp8_layers_back(fp8_on_cpu):
    torch.manual_seed(0)
    model = Classifier(Blocks(), lr=3e-3)
    plugin = Fp8Precision(keep_bf16=["-<small>"])
    trainer = quiet_trainer(plugins=[plugin], max_epochs=2, fp32_finetune_epochs=1)
    trainer.fit(model, torch.utils.data.DataLoader(classification_data(64), batch_size=32))
    assert plugin.precision == "32-true"
    assert all(type(m) is nn.Linear and m.weight.dtype == torch.float32
               for m in model.net.modules() if isinstance(m, nn.Linear))


def test_unswap_keeps_parameters():
    float8 = pytest.importorskip("torchao.float8")
    net = Blocks(d=64)
    w = net.blocks[0][1].weight
    float8.convert_to_float8_training(net)
    assert type(net.blocks[0][1]).__name__ == "Float8Linear"
    names = unswap_fp8_linears(net)
    assert "blocks.0.1" in names and type(net.blocks[0][1]) is nn.Linear and net.blocks[0][1].weight is w
    x = torch.randn(4, 64)
    assert torch.equal(net.blocks[0][1](x), F.linear(x, w, net.blocks[0][1].bias))
