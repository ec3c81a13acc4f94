"""load_state_dict takes every torch.optim format, and torch.optim takes ours (torch_format.py)."""
import copy

import pytest
import torch
from _optim_data import assert_same, model, train

from mptrain.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

# (ours, torch's, arguments both take): the update rules match, so states move both ways.
PAIRS = [
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.99))),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.2)),
]
IDS = [f"{p[1].__name__}-{i}" for i, p in enumerate(PAIRS)]
# Group keys torch.optim added over the years: a state saved before them lacks them.
NEWER_GROUP_KEYS = ("maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")


def _older_format(sd, step_type):
    """``sd`` as an older torch wrote it: numeric steps, groups without the newer keys."""
    sd = copy.deepcopy(sd)
    for st in sd["state"].values():
        if "step" in st:
            st["step"] = step_type(st["step"].item())
    for g in sd["param_groups"]:
        for key in NEWER_GROUP_KEYS:
            g.pop(key, None)
    return sd


def _pair(src_cls, dst_cls, kw, steps=2):
    """A model trained ``steps`` steps by ``src_cls``, and a copy whose optimizer is ``dst_cls``."""
    net = model()
    opt = src_cls(net.parameters(), **kw)
    train(net, opt, steps)
    net2 = copy.deepcopy(net)
    return net, opt, net2, dst_cls(net2.parameters(), **kw)


def _assert_next_steps_match(net, opt, net2, opt2, tol):
    train(net, opt, 3, start=2)
    train(net2, opt2, 3, start=2)
    assert_same(list(net.parameters()), list(net2.parameters()), tol=tol)


@pytest.mark.parametrize("ours,theirs,kw", PAIRS, ids=IDS)
@pytest.mark.parametrize("theirs_kw", [{}, {"fused": True}], ids=["default", "fused"])
def test_torch_state_dict_loads_and_the_next_steps_match_torch(ours, theirs, kw, theirs_kw):
    net, opt, net2, opt2 = _pair(lambda ps, **k: theirs(ps, **k, **theirs_kw), ours, kw)
    opt2.load_state_dict(opt.state_dict())
    _assert_next_steps_match(net, opt, net2, opt2, tol=1e-6)


@pytest.mark.parametrize("ours,theirs,kw", PAIRS, ids=IDS)
def test_our_state_dict_loads_into_torch_and_the_next_steps_match(ours, theirs, kw):
    net, opt, net2, opt2 = _pair(ours, theirs, kw)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's loader keeps the tensors it is given
    _assert_next_steps_match(net, opt, net2, opt2, tol=1e-6)


@pytest.mark.parametrize("step_type", [int, float])
@pytest.mark.parametrize("ours,theirs,kw", PAIRS, ids=IDS)
def test_older_format_numeric_step_and_missing_group_keys(ours, theirs, kw, step_type):
    net, opt, net2, opt2 = _pair(ours, ours, kw)
    old = _older_format(opt.state_dict(), step_type)
    opt2.load_state_dict(old)
    for p in net2.parameters():
        step = opt2.state[p]["step"]
        assert torch.is_tensor(step) and step.dtype == torch.float32 and step.dim() == 0 and step.item() == 2
    # The filled-in group keys are the ones torch fills into the same old state.
    ref = theirs(copy.deepcopy(net).parameters(), **kw)
    ref.load_state_dict(_older_format(opt.state_dict(), step_type))
    for key in NEWER_GROUP_KEYS:
        if key in opt2.param_groups[0] and key in ref.param_groups[0] and key != "fused":
            assert opt2.param_groups[0][key] == ref.param_groups[0][key], key
    _assert_next_steps_match(net, opt, net2, opt2, tol=0.0)


def test_lamb_older_format_loads():
    net, opt, net2, opt2 = _pair(FusedLAMB, FusedLAMB, dict(lr=1e-2))
    old = _older_format(opt.state_dict(), int)
    for g in old["param_groups"]:
        del g["bias_correction"]
    opt2.load_state_dict(old)
    assert opt2.param_groups[0]["bias_correction"] is True
    _assert_next_steps_match(net, opt, net2, opt2, tol=0.0)


def test_torch_sgd_state_before_its_first_momentum_step_loads():
    net, opt, net2, opt2 = _pair(torch.optim.SGD, FusedSGD, dict(lr=0.1, momentum=0.9), steps=0)
    opt2.load_state_dict(opt.state_dict())
    _assert_next_steps_match(net, opt, net2, opt2, tol=1e-6)


@pytest.mark.parametrize("theirs,ours,saved_group,error", [
    (torch.optim.Adam, FusedAdam, dict(amsgrad=True), NotImplementedError),
    # Adam's coupled decay is not AdamW.  torch >= 2.7 writes the key into Adam's groups; torch 2.6's
    # Adam and AdamW groups have none (they then load as the loading class's own default).
    (torch.optim.Adam, FusedAdamW, dict(decoupled_weight_decay=False), ValueError),
    (torch.optim.SGD, FusedSGD, dict(differentiable=True), ValueError),
])
def test_a_state_we_cannot_run_raises_and_changes_nothing(theirs, ours, saved_group, error):
    net, opt, net2, _ = _pair(theirs, theirs, dict(lr=1e-2))
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0].update(saved_group)
    opt2 = ours(net2.parameters(), lr=1e-2)
    train(net2, opt2, 1)
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(error, match="amsgrad|decoupled_weight_decay|differentiable"):
        opt2.load_state_dict(saved)
    after = opt2.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][i][k], v) for i, st in before["state"].items() for k, v in st.items())


def test_a_state_of_another_shape_names_the_mismatch():
    net, opt, _, _ = _pair(FusedAdamW, FusedAdamW, dict(lr=1e-2))
    other = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    with pytest.raises(ValueError, match="different model"):
        FusedAdamW(other.parameters()).load_state_dict(opt.state_dict())
