"""The delayed recipe's fused Llama MLP: which MLPs are fused, the same numbers as the unfused layers (with the
SwiGLU rounded as eager rounds it), the amaxes recorded, the fallbacks, pickling, compile and the plugin."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

float8 = pytest.importorskip("torchao.float8")
transformers = pytest.importorskip("transformers")

from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

from mptrain.precision import fp8_mlp  # noqa: E402
from mptrain.precision.fp8_delayed import use_delayed_scaling  # noqa: E402
from mptrain.precision.fp8_linear import use_single_casts  # noqa: E402
from mptrain.precision.fp8_mlp import fused_mlp_class, unfuse_mlps, use_fused_mlps  # noqa: E402
from mptrain.precision.fp8_swiglu import E4M3, E5M2  # noqa: E402

from test_fp8 import fp8_on_cpu  # noqa: E402,F401


def _mlp(bias=False, hidden=64, ffn=128):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, mlp_bias=bias)
    mlp = LlamaMLP(cfg).bfloat16()
    float8.convert_to_float8_training(mlp, config=float8.Float8LinearConfig.from_recipe_name("tensorwise"))
    use_single_casts(mlp)
    return mlp


def _eager_rounded_swiglu(g, u, scale):
    h = (torch.nn.functional.silu(g) * u).float()
    return (h * scale).clamp(-448, 448).to(E4M3), h.abs().amax()


def _eager_rounded_swiglu_backward(dh, g, u, scale_g, scale_u):
    with torch.enable_grad():
        g, u = g.detach().requires_grad_(), u.detach().requires_grad_()
        dg, du = torch.autograd.grad(torch.nn.functional.silu(g) * u, (g, u), dh)
    top = torch.finfo(E5M2).max
    dg8, du8 = ((d.float() * s).clamp(-top, top).to(E5M2) for d, s in ((dg, scale_g), (du, scale_u)))
    return dg8, du8, dg8.t().contiguous(), du8.t().contiguous(), dg.float().abs().amax(), du.float().abs().amax()


def _two_steps(mlp, fuse, x, run=None):
    """A first step (current scales), the history updated, a second step: its output, input and weight
    gradients, and the amaxes it recorded (inputs, then output gradients)."""
    scaling = use_delayed_scaling(mlp, torch.device("cpu"))
    out = None
    for step in range(2):
        if fuse and step == 1:
            assert use_fused_mlps(mlp) == [""]
        xi = x.clone().requires_grad_()
        y = (mlp if run is None else run)(xi)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype))
        if step == 0:
            scaling.update()
            for p in mlp.parameters():
                p.grad = None
        out = y
    scaling.fold_grad_amaxes()
    amaxes = torch.stack([m.fp8_input_amax for m in scaling.layers] + scaling._grad_amax)
    return out.detach(), xi.grad, [p.grad for p in mlp.parameters()], amaxes


def test_with_the_swiglu_rounded_as_eager_it_gives_the_unfused_layers_numbers(fp8_on_cpu, monkeypatch):
    monkeypatch.setattr(fp8_mlp, "fp8_swiglu", _eager_rounded_swiglu)
    monkeypatch.setattr(fp8_mlp, "fp8_swiglu_backward", _eager_rounded_swiglu_backward)
    mlp = _mlp()
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    unfused = _two_steps(copy.deepcopy(mlp), False, x)
    fused = _two_steps(mlp, True, x)
    assert type(mlp) is fused_mlp_class("LlamaMLP")
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
    assert all(torch.equal(a, b) for a, b in zip(fused[2], unfused[2]))
    assert torch.equal(fused[3], unfused[3]) and (fused[3] > 0).all()


def test_with_the_fp32_swiglu_it_stays_within_an_e5m2_rounding_of_the_unfused_layers(fp8_on_cpu):
    mlp = _mlp()
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    unfused = _two_steps(copy.deepcopy(mlp), False, x)
    fused = _two_steps(mlp, True, x)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(fused[0], unfused[0]) < 0.05 and rel(fused[1], unfused[1]) < 0.05
    assert all(rel(a, b) < 0.05 for a, b in zip(fused[2], unfused[2]))
    assert rel(fused[3], unfused[3]) < 0.01
    assert not torch.equal(fused[0], unfused[0])  # the fused path ran: its SwiGLU is cast from fp32


def test_only_an_exact_bias_free_silu_llama_mlp_of_delayed_layers_is_fused():
    tensorwise = _mlp()  # Fp8Linear layers, not delayed
    assert use_fused_mlps(tensorwise) == []
    biased = _mlp(bias=True)
    use_delayed_scaling(biased, torch.device("cpu"))
    assert use_fused_mlps(biased) == []

    class Mine(LlamaMLP):
        pass

    sub = _mlp()
    sub.__class__ = Mine
    use_delayed_scaling(sub, torch.device("cpu"))
    assert use_fused_mlps(sub) == []
    gelu = _mlp()
    gelu.act_fn = torch.nn.GELU()
    use_delayed_scaling(gelu, torch.device("cpu"))
    assert use_fused_mlps(gelu) == []
    model = torch.nn.ModuleDict({"a": _mlp(), "b": _mlp()})
    use_delayed_scaling(model, torch.device("cpu"))
    assert use_fused_mlps(model) == ["a", "b"]
    assert unfuse_mlps(model) == ["a", "b"] and all(type(m) is LlamaMLP for m in model.values())


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_other_gated_mlps_of_the_same_forward_are_fused_and_pickle(fp8_on_cpu, family):
    import importlib

    name = {"mistral": "MistralMLP", "qwen2": "Qwen2MLP", "qwen3": "Qwen3MLP"}[family]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = getattr(transformers, {"mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[family])
    torch.manual_seed(0)
    mlp = getattr(modeling, name)(config(hidden_size=64, intermediate_size=128)).bfloat16()
    float8.convert_to_float8_training(mlp, config=float8.Float8LinearConfig.from_recipe_name("tensorwise"))
    use_single_casts(mlp)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    unfused = _two_steps(copy.deepcopy(mlp), False, x)
    fused = _two_steps(mlp, True, x)
    assert type(mlp).__name__ == "FusedFp8" + name and isinstance(mlp, getattr(modeling, name))
    assert ((fused[0].float() - unfused[0].float()).norm() / unfused[0].float().norm()) < 0.05
    again = pickle.loads(pickle.dumps(mlp))
    assert type(again) is type(mlp)
    assert unfuse_mlps(mlp) == [""] and type(mlp) is getattr(modeling, name)


def test_a_projection_that_left_fp8_runs_the_mlp_unfused(fp8_on_cpu):
    mlp = _mlp()
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    _two_steps(mlp, True, x)
    mlp.gate_proj.__class__ = torch.nn.Linear  # what auto_fp32_fallback's promotion leaves
    want = mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.equal(mlp(x), want)


def test_a_hooked_projection_runs_the_mlp_unfused_so_its_hooks_fire(fp8_on_cpu):
    mlp = _mlp()
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    _two_steps(mlp, True, x)
    with torch.no_grad():
        fused = mlp(x)
    seen = []
    handle = mlp.up_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    with torch.no_grad():
        hooked = mlp(x)
        handle.remove()
        want = mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert seen == [torch.Size([32, 128])]
    assert torch.equal(hooked, want) and not torch.equal(hooked, fused)


def test_the_first_step_runs_the_layers_unfused(fp8_on_cpu, monkeypatch):
    mlp = _mlp()
    use_delayed_scaling(mlp, torch.device("cpu"))
    use_fused_mlps(mlp)
    calls = []
    monkeypatch.setattr(fp8_mlp._FusedFp8MLP, "apply", lambda *a: calls.append(1))
    mlp(torch.randn(8, 64, dtype=torch.bfloat16))
    assert calls == []


def test_a_fused_mlp_pickles_and_keeps_its_state_dict_keys(fp8_on_cpu):
    mlp = _mlp()
    keys = list(mlp.state_dict())
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    _two_steps(mlp, True, x)
    again = pickle.loads(pickle.dumps(mlp))
    assert type(again) is fused_mlp_class("LlamaMLP") and list(again.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(again(x), mlp(x))


def test_it_compiles_into_one_graph_with_the_same_numbers(fp8_on_cpu):
    mlp = _mlp()
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    eager = _two_steps(copy.deepcopy(mlp), True, x)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    compiled = _two_steps(mlp, True, x, run=torch.compile(mlp, backend=backend))
    # one graph a step (the first step's unfused layers, then the fused MLP), the kernels' ops in the fused one
    assert len(graphs) == 2
    text = "\n".join(g.code for g in graphs[-1].modules() if isinstance(g, torch.fx.GraphModule))
    assert "mptrain.fp8_swiglu.default" in text and "mptrain.fp8_swiglu_backward.default" in text
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    assert all(torch.equal(a, b) for a, b in zip(compiled[2], eager[2]))


def test_the_plugin_fuses_a_llamas_mlps_under_the_delayed_recipe(fp8_on_cpu):
    from mptrain.precision.fp8 import Fp8Precision

    from _models import CausalLM, quiet_trainer

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=128)
    ids = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(0))
    lm, plugin = CausalLM(cfg, lr=3e-3), Fp8Precision(recipe="delayed", keep_bf16=["-<small>"])
    quiet_trainer(plugins=[plugin], max_steps=12).fit(lm, torch.utils.data.DataLoader(ids, batch_size=8))
    assert plugin.fused_mlps == ["model.model.layers.0.mlp", "model.model.layers.1.mlp"]
    assert all(type(layer.mlp) is fused_mlp_class("LlamaMLP") for layer in lm.model.model.layers)
    losses = torch.stack(lm.losses)
    assert torch.isfinite(losses).all() and losses[-3:].mean() < losses[:3].mean()
    off = Fp8Precision(recipe="delayed", keep_bf16=["-<small>"], fuse_mlps=False)
    quiet_trainer(plugins=[off], max_steps=2).fit(CausalLM(cfg), torch.utils.data.DataLoader(ids, batch_size=8))
    assert off.fused_mlps == [] and off._delayed is not None


def test_fusing_mlps_without_the_delayed_recipe_is_refused():
    from mptrain.precision.fp8 import Fp8Precision

    with pytest.raises(ValueError, match="fuse_mlps=True.*needs recipe='delayed'.*'tensorwise'"):
        Fp8Precision(recipe="tensorwise", fuse_mlps=True)
    assert not Fp8Precision(recipe="tensorwise").fuse_mlps and Fp8Precision(recipe="delayed").fuse_mlps
