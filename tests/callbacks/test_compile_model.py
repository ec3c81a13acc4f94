"""CompileModel: the compiled graph holds the fp32 fallback; one compile serves every forward."""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from _models import Classifier, classification_data, mlp, quiet_trainer
from torch import nn

from mptrain.callbacks.compile_model import CompileModel
from mptrain.precision.fallback import Fp32Fallback


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


def test_the_fallback_is_in_the_compiled_graph_and_one_graph_serves_every_forward():
    """Under the forward context the graph upcasts softmax's input (the wrapped op inlined), without it it
    does not; the context's wrappers are the same objects each forward: no recompile."""
    graphs = []
    model = _compiled(graphs, fullgraph=True)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    fallback = Fp32Fallback("default", cpu_rnn=False)
    with torch.no_grad():
        with fallback.context():
            ref = model._call_impl(x)  # eager under the fallback
        for _ in range(3):
            with fallback.context():
                out = model(x)
            assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
        model(x)
    assert len(graphs) == 2  # with the fallback (once for three forwards) and without

    def upcasts(gm):
        return [n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("float", "to")]

    assert upcasts(graphs[0]) and not upcasts(graphs[1])


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
