"""CompileModel: the fp32-fallback mode runs inside the compiled region, not around it."""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from _models import Classifier, classification_data, counting_fallback_mode, mlp, quiet_trainer
from torch import nn

from mptrain.callbacks.compile_model import CompileModel
from mptrain.precision.fallback import Fp32Fallback, Fp32OpsMode


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return F.softmax(self.b(F.gelu(self.a(x))), -1) + x  # softmax is listed: fp32 inside, bf16 out


def _compiled(graphs: list, **kwargs):
    def backend(gm, example_inputs):  # counts compilations, runs the captured graph as it is
        graphs.append(gm)
        return gm.forward

    holder = types.SimpleNamespace(model=_Net().to(torch.bfloat16))
    CompileModel(backend=backend, **kwargs).setup(None, holder, "fit")
    return holder.model


def test_the_mode_is_entered_inside_the_compiled_call_and_the_graph_is_reused():
    graphs = []
    model = _compiled(graphs, fullgraph=True)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    funcs = Fp32Fallback("default")._funcs
    with torch.no_grad():
        with Fp32OpsMode(funcs):
            ref = model._call_impl(x)  # eager under the mode: the fallback's result
        for _ in range(3):  # a new mode object per forward, as the plugin's forward context makes
            outer = counting_fallback_mode(funcs)
            with outer:
                out = model(x)
            assert outer.calls == 0  # the compiled code's tensor calls skip the outer mode's handler
            assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert len(graphs) == 1  # one compile: the inner mode is one object per op table


def test_the_fallback_is_in_the_compiled_graph():
    """The inner mode is traced: the graph upcasts softmax's input; without a mode it does not."""
    graphs = []
    model = _compiled(graphs)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        with Fp32Fallback("default").context():
            model(x)
        model(x)
    assert len(graphs) == 2  # with the mode and without: two graphs

    def upcasts(gm):
        return [n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("float", "to")]

    assert upcasts(graphs[0]) and not upcasts(graphs[1])


def test_another_mode_above_the_fallback_keeps_the_plain_compiled_call():
    graphs = []
    model = _compiled(graphs)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    funcs = Fp32Fallback("default")._funcs

    class Other(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Fp32OpsMode(funcs), Other():
        model(x)
        assert isinstance(torch.overrides._get_current_function_mode_stack()[-1], Other)  # left as it was
    assert len(graphs) == 1


def test_a_compiled_half_precision_run_traces_the_forward_once():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    class Wrapped(Classifier):
        def __init__(self):
            super().__init__(mlp())
            self.model = self.net

    model = Wrapped()
    trainer = quiet_trainer(precision="bf16-master", compile={"backend": backend}, max_steps=3)
    trainer.fit(model, torch.utils.data.DataLoader(classification_data(n=32), batch_size=8))
    assert trainer.global_step == 3 and len(graphs) == 1
