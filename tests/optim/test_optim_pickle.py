"""copy.deepcopy and pickle give back the same fused optimizer, able to step (base.py)."""
import copy
import pickle

import pytest
import torch
from _optim_data import assert_same, model, train

from mptrain.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

CASES = [
    (FusedAdam, dict(lr=1e-2, weight_decay=0.1), torch.float32),
    (FusedAdamW, dict(lr=1e-2, master_weights=True, fused=False), torch.bfloat16),
    (FusedSGD, dict(lr=0.1, momentum=0.9, nesterov=True), torch.float32),
    (FusedLAMB, dict(lr=1e-2, master_weights=True), torch.bfloat16),
]
IDS = [c[0].__name__ for c in CASES]


def _own_attributes(opt):
    """Instance attributes a fused optimizer has beyond a plain torch.optim.Optimizer's."""
    plain = set(vars(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)))
    return {k: v for k, v in vars(opt).items() if k not in plain}


def _assert_same_optimizer(a, b):
    assert type(a) is type(b)
    own = _own_attributes(a)
    assert {"master_weights", "fused"} <= set(own)
    assert _own_attributes(b) == own
    assert b.defaults == a.defaults
    assert b._mptrain_fused and b._step_supports_amp_scaling
    for ga, gb in zip(a.param_groups, b.param_groups):
        assert {k: v for k, v in ga.items() if k != "params"} == {k: v for k, v in gb.items() if k != "params"}
    for pa, pb in zip(*(sum((g["params"] for g in o.param_groups), []) for o in (a, b))):
        sa, sb = a.state[pa], b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _copies(how, net, opt):
    if how == "deepcopy":
        return copy.deepcopy((net, opt))
    return pickle.loads(pickle.dumps((net, opt)))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("cls,kw,dtype", CASES, ids=IDS)
def test_copy_of_model_and_optimizer_steps_like_the_original(how, cls, kw, dtype):
    net = model().to(dtype)
    opt = cls(net.parameters(), **kw)
    train(net, opt, 2)
    net2, opt2 = _copies(how, net, opt)
    _assert_same_optimizer(opt, opt2)
    # The copy steps the copied model's params, not the original's.
    assert [id(p) for p in opt2.param_groups[0]["params"]] == [id(p) for p in net2.parameters()]
    train(net, opt, 2, start=2)
    train(net2, opt2, 2, start=2)
    assert_same(list(net.parameters()), list(net2.parameters()))
    _assert_same_optimizer(opt, opt2)


def test_an_object_pickled_without_the_new_attributes_gets_their_defaults():
    net = model()
    opt = FusedAdamW(net.parameters(), lr=1e-2, fused=False, master_weights=True)
    state = opt.__getstate__()
    del state["master_weights"], state["fused"]
    old = FusedAdamW.__new__(FusedAdamW)
    old.__setstate__(state)
    assert old.master_weights is False and old.fused == "auto"
    train(net, old, 1)
