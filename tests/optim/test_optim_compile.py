"""torch.compile of the fused step (and of a whole training step) gives eager's numbers,
without graph breaks in the step (base.py under dynamo; CPU backends eager/aot_eager).

(An LRScheduler wraps ``optimizer.step`` in a function dynamo skips: compiling that
wrapper breaks the graph once at its call, for torch's optimizers as for ours; the step
inside is still compiled whole.)"""
import copy

import pytest
import torch
from _optim_data import assert_same, loss_of, model
from torch._dynamo.utils import counters

from mptrain.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

# A tensor lr keeps one graph across a schedule (a float lr may recompile: slow here).
CASES = [
    (FusedAdam, dict(lr=torch.tensor(1e-2), weight_decay=0.1), "aot_eager"),
    (FusedAdamW, dict(lr=torch.tensor(1e-2)), "aot_eager"),
    (FusedAdamW, dict(lr=1e-2), "eager"),
    (FusedSGD, dict(lr=torch.tensor(0.1), momentum=0.9, nesterov=True), "aot_eager"),
    (FusedLAMB, dict(lr=torch.tensor(1e-2)), "aot_eager"),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _state_tensors(opt):
    return [v for g in opt.param_groups for p in g["params"] for v in opt.state[p].values()]


def _pair(cls, kw):
    net = model()
    net2 = copy.deepcopy(net)
    return net, cls(net.parameters(), **copy.deepcopy(kw)), net2, cls(net2.parameters(), **copy.deepcopy(kw))


@pytest.mark.parametrize("cls,kw,backend", CASES, ids=[f"{c[0].__name__}-{c[2]}" for c in CASES])
def test_compiled_step_equals_eager_without_graph_breaks(cls, kw, backend):
    net, opt, net2, opt2 = _pair(cls, kw)
    compiled = torch.compile(opt.step, backend=backend)
    for k in range(4):
        for n, o in ((net, opt), (net2, opt2)):
            o.zero_grad()
            loss_of(n, k).backward()
            _set_lr(o, 0.05 / (k + 1))  # a schedule
        compiled()
        opt2.step()
    assert_same(list(net.parameters()), list(net2.parameters()))
    assert_same(_state_tensors(opt), _state_tensors(opt2))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    if torch.is_tensor(kw["lr"]):  # (older torch specializes on a float lr: one graph per value)
        # one graph for the first step (it creates the state), one for every later step
        assert counters["stats"]["unique_graphs"] <= 2


def _set_lr(opt, lr):
    """What torch's LRScheduler does: a tensor lr is filled in place, a float replaced."""
    for g in opt.param_groups:
        if torch.is_tensor(g["lr"]):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


def test_compiled_step_under_the_gradscaler_protocol_equals_eager():
    net, opt, net2, opt2 = _pair(FusedAdamW, dict(lr=1e-2))
    compiled = torch.compile(opt.step, backend="eager")
    for k in range(4):
        for n, o in ((net, opt), (net2, opt2)):
            o.zero_grad()
            (loss_of(n, k) * 64).backward()
            o.grad_scale, o.found_inf = torch.tensor(64.0), torch.tensor(float(k == 2))  # step 2 is skipped
        compiled()
        opt2.step()
        assert_same([p.grad for p in net.parameters()], [p.grad for p in net2.parameters()])
    assert_same(list(net.parameters()), list(net2.parameters()))
    assert all(opt.state[p]["step"].item() == 3 for p in net.parameters())
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_compiled_training_step_equals_eager():
    """forward, backward and step in one compiled function (backward is where dynamo
    splits the graph, as for any optimizer)."""
    net, opt, net2, opt2 = _pair(FusedSGD, dict(lr=0.1, momentum=0.9))

    def train_step(n, o, k):
        o.zero_grad()
        loss = loss_of(n, k)
        loss.backward()
        o.step()
        return loss.detach()

    compiled = torch.compile(train_step, backend="eager")
    for k in range(3):
        torch.testing.assert_close(compiled(net, opt, k), train_step(net2, opt2, k), rtol=0, atol=0)
    assert_same(list(net.parameters()), list(net2.parameters()))
