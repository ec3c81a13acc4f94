"""fp8-master's delayed recipe: scales from the amax history, the first step at current scales, the same bits as
the tensorwise linear when the history holds this step's amaxes, the state in checkpoints."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

float8 = pytest.importorskip("torchao.float8")

from mptrain.precision.fp8 import Fp8Precision  # noqa: E402
from mptrain.precision.fp8_delayed import HISTORY, DelayedFp8Linear, _InputGroups, use_delayed_scaling  # noqa: E402
from mptrain.precision.fp8_linear import use_single_casts  # noqa: E402

from _models import Classifier, classification_data, quiet_trainer  # noqa: E402
from test_fp8 import Blocks, fp8_on_cpu  # noqa: E402,F401


def _pair():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32, bias=False)).bfloat16()
    config = float8.Float8LinearConfig.from_recipe_name("tensorwise")
    single, delayed = copy.deepcopy(base), copy.deepcopy(base)
    for m in (single, delayed):
        float8.convert_to_float8_training(m, config=config)
        use_single_casts(m)
    return single, delayed, use_delayed_scaling(delayed, torch.device("cpu"))


def _step(model, x):
    x = x.clone().requires_grad_()
    y = model(x)
    (y.float() ** 2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return y.detach(), x.grad, grads


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and all(torch.equal(u, v) for u, v in zip(a[2], b[2]))


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_with_this_steps_amaxes_it_equals_the_tensorwise_linear_bit_for_bit(backend):
    single, delayed, scaling = _pair()
    assert [type(m) for m in scaling.layers] == [DelayedFp8Linear, DelayedFp8Linear]
    run = delayed if backend is None else torch.compile(delayed, backend=backend, fullgraph=True)
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    ref = _step(single, x)
    assert _same(ref, _step(run, x))  # the first step: current scales, amaxes recorded
    scaling.update()
    assert all(m.fp8_ready for m in scaling.layers)
    assert _same(ref, _step(run, x))  # the same input again: the delayed scales are this step's own
    x2 = 3 * x  # a larger input than the history has seen: the casts use the old scales and differ
    assert not _same(_step(single, x2), _step(run, x2))


def test_scales_follow_the_largest_amax_of_the_history_and_skip_non_finite_ones():
    _, delayed, scaling = _pair()
    first = delayed[0]
    fmax = torch.finfo(torch.float8_e4m3fn).max
    for amax in (2.0, float("inf"), 0.5):
        first.fp8_input_amax.fill_(amax)
        scaling.update()
    assert float(first.fp8_input_scale) == pytest.approx(fmax / 2.0)  # inf went in as 0; 2.0 is still there
    assert float(first.fp8_input_amax) == 0.0  # cleared for the next step
    for _ in range(HISTORY - 3):  # 2.0 went in 2 updates ago: it stays for HISTORY updates in all
        first.fp8_input_amax.fill_(0.5)
        scaling.update()
    assert float(first.fp8_input_scale) == pytest.approx(fmax / 2.0)  # 2.0 is HISTORY - 1 steps old
    first.fp8_input_amax.fill_(0.5)
    scaling.update()
    assert float(first.fp8_input_scale) == pytest.approx(fmax / 0.5)  # and now it has left the history
    assert float(delayed[2].fp8_input_scale) == 1.0  # never saw anything above 0


@pytest.mark.parametrize("fold", [True, False])
def test_the_output_gradients_amax_arrives_through_the_sink_and_a_window_keeps_its_largest(fold):
    single, delayed, scaling = _pair()
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    for _ in range(2):  # an accumulation window of two micro-batches
        y = delayed(x)
        (y.float() ** 2).sum().backward()
        if fold:  # what the plugin's post_backward does
            scaling.fold_grad_amaxes()
    sink = delayed[2].fp8_grad_amax
    expected = float((2 * delayed(x).detach().float()).abs().amax())
    # folded: the largest micro-batch's amax; backwards run outside the plugin leave the sum in the sink
    window = expected if fold else 2 * expected
    assert float(sink.grad) == pytest.approx(0.0 if fold else window, rel=1e-2)
    scaling.update()
    assert float(sink.grad) == 0.0  # cleared in place
    fmax = torch.finfo(torch.float8_e5m2).max
    assert float(delayed[2].fp8_grad_scale) == pytest.approx(fmax / window, rel=1e-2)


def test_a_cast_that_outgrew_its_scale_is_counted_as_saturated():
    _, delayed, scaling = _pair()
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    for scale in (1.0, 1.0, 4.0):  # the third step's input is 4x what the history has seen
        delayed(scale * x)
        scaling.update()
    # both layers' inputs outgrew their scales in that one step (the second's input is the first's output)
    assert scaling.saturated_steps() == {"0": {"input": 1}, "2": {"input": 1}}
    assert int(scaling.state_dict()["saturated"].sum()) == 2


class _Compilable(Classifier):
    """``compile=True`` compiles ``self.model``: the same network under that name."""

    def __init__(self):
        super().__init__(Blocks(), lr=3e-3)
        self.model = self.net


def _fit(steps: int, ckpt=None, **kw):
    torch.manual_seed(0)
    model = _Compilable() if kw.get("compile") else Classifier(Blocks(), lr=3e-3)
    plugin = Fp8Precision(recipe="delayed", keep_bf16=["-<small>"])
    trainer = quiet_trainer(plugins=[plugin], max_steps=steps, **kw)
    loader = torch.utils.data.DataLoader(classification_data(256), batch_size=32)
    trainer.fit(model, loader, ckpt_path=ckpt)
    return model, plugin, trainer


def test_the_plugin_trains_with_delayed_scales(fp8_on_cpu):
    model, plugin, trainer = _fit(30)
    layers = [m for m in model.net.modules() if type(m) is DelayedFp8Linear]
    assert len(layers) == len(plugin.fp8_layers) == 4
    assert plugin._delayed.steps == 30 and all(m.fp8_ready for m in layers)
    assert all(float(m.fp8_input_scale) != 1.0 and float(m.fp8_grad_scale) != 1.0 for m in layers)
    losses = torch.stack(model.losses).float()
    assert losses[-5:].mean() < 0.7 * losses[:5].mean()


def test_each_backward_of_an_accumulation_window_is_folded(fp8_on_cpu, monkeypatch):
    from mptrain.precision.fp8_delayed import DelayedScaling

    calls = []
    fold = DelayedScaling.fold_grad_amaxes

    def counting(self):
        calls.append(self.steps)
        fold(self)

    monkeypatch.setattr(DelayedScaling, "fold_grad_amaxes", counting)
    _, plugin, _ = _fit(3, accumulate_grad_batches=2)
    # per optimizer step: one fold after each of the window's 2 backwards (the plugin's post_backward), one in update
    assert calls == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_the_history_is_saved_and_resumed(fp8_on_cpu, tmp_path):
    model, plugin, trainer = _fit(6)
    path = tmp_path / "delayed.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    saved = ckpt[type(plugin).__qualname__]["fp8_delayed"]
    assert torch.equal(saved["history"], plugin._delayed.history) and saved["steps"] == 6
    scales = [float(m.fp8_input_scale) for m in plugin._delayed.layers]
    _, resumed, _ = _fit(7, ckpt=str(path))
    assert resumed._delayed.steps == 7
    # the resumed run went on from the saved history (one step rolled in), with no first step at current scales
    assert torch.equal(resumed._delayed.history[:, 1:], plugin._delayed.history[:, :-1])
    assert scales != [1.0] * len(scales)


def test_under_compile_the_first_step_runs_eagerly_and_the_model_is_traced_once(fp8_on_cpu):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, plugin, trainer = _fit(4, compile={"backend": backend})
    assert plugin._delayed.steps == 4 and all(m.fp8_ready for m in plugin._delayed.layers)
    # one graph, with the delayed casts (their scales are graph inputs, the amax sink's gradient an output)
    assert len(graphs) == 1
    losses = torch.stack(model.losses).float()
    assert torch.isfinite(losses).all()


def test_the_fp32_finetune_leaves_plain_linears_without_delayed_state(fp8_on_cpu):
    torch.manual_seed(0)
    model = Classifier(Blocks(), lr=3e-3)
    plugin = Fp8Precision(recipe="delayed", keep_bf16=["-<small>"])
    trainer = quiet_trainer(plugins=[plugin], max_epochs=2, fp32_finetune_epochs=1)
    trainer.fit(model, torch.utils.data.DataLoader(classification_data(64), batch_size=32))
    assert plugin.precision == "32-true" and plugin._delayed is None
    linears = [m for m in model.net.modules() if isinstance(m, nn.Linear)]
    assert all(type(m) is nn.Linear and not hasattr(m, "fp8_input_scale") for m in linears)


def test_cuda_graphs_are_refused_before_any_step(fp8_on_cpu):
    """The captured backward computes the parameters' gradients only: the output gradients' amaxes, which reach
    the layers' sinks, would stop arriving, and the scales would fall back to 1 once the history ran out."""
    from mptrain.precision.graph_capture import CudaGraphError

    with pytest.raises(CudaGraphError, match=r"delayed recipe.*recipe='tensorwise'"):
        _fit(2, cuda_graphs=True)


class _SharedInput(nn.Module):
    """A decoder's attention projections in small: q, k and v read one input; o reads their outputs."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(64, 64, bias=False) for _ in range(3))
        self.o = nn.Linear(192, 64, bias=False)

    def forward(self, x):
        return self.o(torch.cat([self.q(x), self.k(x), 2 * self.v(x)], dim=-1))


def _shared(seed: int = 0):
    torch.manual_seed(seed)
    model = _SharedInput().bfloat16()
    float8.convert_to_float8_training(model, config=float8.Float8LinearConfig.from_recipe_name("tensorwise"))
    use_single_casts(model)
    return model, use_delayed_scaling(model, torch.device("cpu"))


def _fp8_casts_in_forward(model, x) -> int:
    """The fp8 conversions in the forward graph that inductor's partitioner (with its CSE pass) hands on."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    counts, converts = [], (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)

    def forward_compiler(gm, _):
        counts.append(sum(1 for n in gm.graph.nodes if n.target in converts
                          and getattr(n.meta.get("val"), "dtype", None) == torch.float8_e4m3fn))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    _step(torch.compile(model, backend=backend, fullgraph=True), x)
    return counts[0]


def _ready(model, scaling, x):
    _step(model, x)  # the first step: current scales; the input groups are found
    scaling.update()


def test_layers_reading_one_input_share_its_scale_and_the_compiled_forward_casts_it_once(monkeypatch):
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    with monkeypatch.context() as m:  # no groups: a scale per layer, a cast of x per layer
        m.setattr(_InputGroups, "note", lambda self, index, input: None)
        ungrouped = _shared()
        _ready(*ungrouped, x)
    assert ungrouped[1].input_leader == [0, 1, 2, 3]
    model, scaling = _shared()
    _ready(model, scaling, x)
    assert scaling.input_leader == [0, 0, 0, 3]
    assert model.k.fp8_input_scale is model.q.fp8_input_scale is model.v.fp8_input_scale
    assert model.o.fp8_input_scale is not model.q.fp8_input_scale
    amax = float(x.abs().max())
    assert float(model.q.fp8_input_scale) == pytest.approx(torch.finfo(torch.float8_e4m3fn).max / amax)
    # the group's scale follows the largest amax among its layers
    scaling.history[1, 0] = 4 * amax
    scaling._set_scales()
    assert float(model.q.fp8_input_scale) == pytest.approx(torch.finfo(torch.float8_e4m3fn).max / (4 * amax))
    scaling.history[1, 0] = amax
    scaling._set_scales()
    # x cast once for q, k and v (was three times), o's input once, each weight once
    assert (_fp8_casts_in_forward(ungrouped[0], x), _fp8_casts_in_forward(model, x)) == (3 + 1 + 4, 1 + 1 + 4)


def test_a_model_pickles_in_the_middle_of_its_first_step():
    import pickle

    model, _ = _shared()
    model(torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True))  # the groups hold weak references now
    again = pickle.loads(pickle.dumps(model))
    assert again.q.fp8_inputs.leader == [0, 0, 0, 3]


def test_the_input_groups_are_resumed_with_the_history():
    model, scaling = _shared()
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    _step(model, x)
    scaling.update()
    resumed, again = _shared(seed=1)
    again.load_state_dict(scaling.state_dict())
    assert again.input_leader == [0, 0, 0, 3] and all(m.fp8_ready for m in again.layers)
    assert resumed.v.fp8_input_scale is resumed.q.fp8_input_scale
    assert all(torch.equal(a.fp8_input_scale, b.fp8_input_scale) for a, b in zip(scaling.layers, again.layers))


def test_a_transformers_llama_groups_its_attention_and_mlp_inputs():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).bfloat16()
    float8.convert_to_float8_training(model.model, config=float8.Float8LinearConfig.from_recipe_name("tensorwise"))
    use_single_casts(model)
    scaling = use_delayed_scaling(model, torch.device("cpu"))
    ids = torch.randint(0, 128, (2, 16))
    model(ids, labels=ids).loss.backward()
    scaling.update()
    # per layer: q, k, v | o | gate, up | down
    assert scaling.input_leader == [0, 0, 0, 3, 4, 4, 6, 7, 7, 7, 10, 11, 11, 13]
