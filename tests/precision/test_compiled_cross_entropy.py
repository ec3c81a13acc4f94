"""compiled_cross_entropy: the fallback's traced cross_entropy equals the fp32 loss and gradient of
``F.cross_entropy(x.float(), target)`` (up to reduction order), steps aside in eager mode and for the cases it
does not cover."""
import pytest
import torch
import torch.nn.functional as F

from mptrain.precision.compiled_cross_entropy import compiled_cross_entropy


def _traced(x, target, **kwargs):
    def loss(x, target):
        out = compiled_cross_entropy(F.cross_entropy, (x, target), kwargs)
        assert out is not None, "the traced form must be taken while compiling"
        return out
    return torch.compile(loss, backend="aot_eager", fullgraph=True)(x, target)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_and_grad_match_fp32_cross_entropy(reduction, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 1000, generator=g) * 4).to(dtype)
    target = torch.randint(0, 1000, (64,), generator=g)
    target[::5] = -100  # ignored rows
    a = x.clone().requires_grad_()
    ours = _traced(a, target, reduction=reduction)
    b = x.clone().requires_grad_()
    ref = F.cross_entropy(b.float(), target, reduction=reduction)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    seed = torch.rand(ref.shape, generator=g)
    (ours * seed).sum().backward()
    (ref * seed).sum().backward()
    assert a.grad.dtype == dtype
    torch.testing.assert_close(a.grad, b.grad)  # both rounded to the half dtype from fp32


def test_every_row_ignored_gives_nan_as_torch():
    x = torch.randn(4, 10, dtype=torch.bfloat16)
    target = torch.full((4,), -100)
    assert torch.isnan(_traced(x, target)) and torch.isnan(F.cross_entropy(x.float(), target))


def test_steps_aside_in_eager_and_uncovered_cases():
    x = torch.randn(4, 10, dtype=torch.bfloat16)
    t = torch.randint(0, 10, (4,))
    assert compiled_cross_entropy(F.cross_entropy, (x, t), {}) is None  # eager: the plain / block-wise path

    seen = []

    def probe(*args, **kwargs):
        seen.append(compiled_cross_entropy(F.cross_entropy, args, kwargs))
        return x.float().sum()
    run = torch.compile(probe, backend="eager", fullgraph=True)
    run(x, t, label_smoothing=0.1)
    run(x.float(), t)
    run(x, t, weight=torch.ones(10))
    assert seen == [None, None, None]


def test_inductor_compiles_it_and_matches():
    """The real compiler (inductor, CPU code here), not only the traced graph."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 300, generator=g).to(torch.bfloat16)
    target = torch.randint(0, 300, (32,), generator=g)

    def loss(x, target):
        return compiled_cross_entropy(F.cross_entropy, (x, target), {})
    a = x.clone().requires_grad_()
    ours = torch.compile(loss, fullgraph=True)(a, target)
    ours.backward()
    b = x.clone().requires_grad_()
    ref = F.cross_entropy(b.float(), target)
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.grad, b.grad)


def _aten_ops(fn, *args):
    """The aten ops of the forward and backward graphs AOT autograd traces for ``fn`` inside the fp32 fallback."""
    from torch._dynamo.backends.common import aot_autograd

    from mptrain.precision.factory import precision_plugin

    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    plugin = precision_plugin("bf16-master")
    plugin.convert_module(torch.nn.Linear(2, 2))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=grab, bw_compiler=grab))
    with plugin.forward_context():
        compiled(*args).backward()
    return {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("spelling", ["functional", "module built in the forward", "module"])
def test_every_spelling_is_traced_as_logsumexp(spelling):
    """transformers' BertForMaskedLM builds ``nn.CrossEntropyLoss()`` inside its forward; dynamo (torch 2.11)
    replaces that by one opaque ``F.cross_entropy`` call in its graph, which AOT autograd traces outside dynamo."""
    loss = torch.nn.CrossEntropyLoss()
    fns = {"functional": lambda x, t: F.cross_entropy(x, t),
           "module built in the forward": lambda x, t: torch.nn.CrossEntropyLoss()(x, t),
           "module": lambda x, t: loss(x, t)}
    x = torch.randn(32, 1000, dtype=torch.bfloat16, requires_grad=True)
    ops = _aten_ops(fns[spelling], x, torch.randint(0, 1000, (32,)))
    assert "aten.logsumexp.default" in ops and not any("nll_loss" in o or "log_softmax" in o for o in ops), ops


# -- large losses in eager code of a compiling run -----------------------------------------------------------------
def _large(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, c = 520, 32768  # just over MIN_ELEMENTS
    x = (torch.randn(n, c, generator=g) * 3).to(dtype)
    target = torch.randint(0, c, (n,), generator=g)
    target[::7] = -100
    return x, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_compiled_loss_matches_fp32_cross_entropy(dtype):
    from mptrain.precision.compiled_cross_entropy import MIN_ELEMENTS, eager_compiled_cross_entropy

    x, target = _large(dtype)
    assert x.numel() >= MIN_ELEMENTS
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    a = x.clone().requires_grad_()
    ours = eager_compiled_cross_entropy(F.cross_entropy, (a, target), {}, {"backend": backend})
    assert ours is not None and len(graphs) == 1  # the loss ran as a compiled graph
    b = x.clone().requires_grad_()
    ref = F.cross_entropy(b.float(), target)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    ours.backward()
    ref.backward()
    assert a.grad.dtype == dtype
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7 if dtype == torch.float32 else 1e-5)


def test_eager_compiled_loss_steps_aside_for_small_logits_and_uncovered_cases():
    from mptrain.precision.compiled_cross_entropy import eager_compiled_cross_entropy

    x, t = torch.randn(8, 10), torch.randint(0, 10, (8,))
    assert eager_compiled_cross_entropy(F.cross_entropy, (x, t), {}, {"backend": "eager"}) is None
    big, bt = _large(torch.float32)
    assert eager_compiled_cross_entropy(F.cross_entropy, (big, bt), {"label_smoothing": 0.1},
                                        {"backend": "eager"}) is None
    assert eager_compiled_cross_entropy(F.cross_entropy, (big.double(), bt), {}, {"backend": "eager"}) is None


def test_a_compiling_run_compiles_the_training_steps_loss_on_the_models_output():
    """compile=True compiles ``self.model``; the training_step's ``F.cross_entropy(logits.float(), y)`` on large
    logits runs compiled by the fallback (the back end sees a graph with the logsumexp form), once for every
    step, and the run trains as the same run without compile."""
    import lightning as L

    from mptrain import Trainer

    c = 32768

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, c))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(3 * 520, 16, generator=g),
                                          torch.randint(0, c, (3 * 520,), generator=g))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    common = dict(precision="bf16-master", max_steps=3, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    runs = {}
    for compile_arg in ({"backend": backend}, False):
        module = LM()
        trainer = Trainer(compile=compile_arg, **common)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=520))
        runs[bool(compile_arg)] = [p.detach().clone() for p in module.parameters()]
        assert trainer.precision_plugin.fallback.loss_compile is None  # reset at teardown
    loss_graphs = [gm for gm in graphs if any("logsumexp" in str(n.target) for n in gm.graph.nodes)]
    assert len(loss_graphs) == 1 and len(graphs) == 2  # the model's graph and the loss's, each traced once
    for p, q in zip(runs[True], runs[False]):
        torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-3)  # bf16 weights: the loss differs by rounding
