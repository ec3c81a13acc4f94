"""mptrain.optim on the CPU (reference path): same trajectories as torch.optim, master
weights, grad_scale / found_inf, GradScaler protocol, state_dict round trips."""
import copy

import pytest
import torch

from mptrain.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

SHAPES = [(7, 3), (5,), (1,), (33, 2)]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def _grads(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _run(opt, params, steps, start=0, **step_kw):
    for k in range(start, start + steps):
        for p, g in zip(params, _grads(k, params[0].dtype)):
            p.grad = g.clone()
        opt.step(**step_kw)


def _assert_close(a_list, b_list, tol=1e-6):
    for a, b in zip(a_list, b_list):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=tol, atol=tol)


CASES = [
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05, maximize=True)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, betas=(0.0, 0.0))),
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
    (FusedAdamW, torch.optim.AdamW, dict(lr=3e-2, weight_decay=0.3, maximize=True)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02, maximize=True)),
]


@pytest.mark.parametrize("ours,theirs,kw", CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_matches_torch_optim_fp32(ours, theirs, kw):
    a, b = _params(), _params()
    oa, ob = ours(a, **kw), theirs(b, **kw)
    _run(oa, a, 6)
    _run(ob, b, 6)
    _assert_close(a, b)
    if "momentum" in kw and kw["momentum"]:
        _assert_close([oa.state[p]["momentum_buffer"] for p in a], [ob.state[p]["momentum_buffer"] for p in b])
    if ours is not FusedSGD:
        _assert_close([oa.state[p]["exp_avg_sq"] for p in a], [ob.state[p]["exp_avg_sq"] for p in b])


def test_adam_with_decoupled_weight_decay_flag_is_adamw():
    a, b = _params(), _params()
    oa, ob = FusedAdam(a, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True), torch.optim.AdamW(b, lr=1e-2,
                                                                                                      weight_decay=0.1)
    _run(oa, a, 4)
    _run(ob, b, 4)
    _assert_close(a, b)


def test_param_groups_with_their_own_options():
    a, b = _params(), _params()
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.5, "weight_decay": 0.2}]  # noqa: E731
    oa, ob = FusedAdamW(groups(a), lr=1e-2), torch.optim.AdamW(groups(b), lr=1e-2)
    _run(oa, a, 3)
    _run(ob, b, 3)
    _assert_close(a, b)


def _lamb_formula(params, steps, lr, beta1, beta2, eps, wd):
    """LAMB written out in float64, independently of the reference."""
    ws = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for t in range(1, steps + 1):
        for i, g in enumerate(_grads(t - 1)):
            g = g.double()
            ms[i] = beta1 * ms[i] + (1 - beta1) * g
            vs[i] = beta2 * vs[i] + (1 - beta2) * g * g
            u = (ms[i] / (1 - beta1**t)) / ((vs[i] / (1 - beta2**t)).sqrt() + eps) + wd * ws[i]
            wn, un = ws[i].norm(), u.norm()
            ratio = wn / un if wn > 0 and un > 0 else 1.0
            ws[i] = ws[i] - lr * ratio * u
    return ws


def test_lamb_matches_formula():
    ps = _params()
    opt = FusedLAMB(ps, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    _run(opt, ps, 5)
    _assert_close(ps, _lamb_formula(_params(), 5, 1e-2, 0.9, 0.99, 1e-6, 0.01), tol=2e-6)


def test_lamb_zero_weight_uses_ratio_one():
    p = torch.zeros(4, requires_grad=True)
    opt = FusedLAMB([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.ones(4)
    opt.step()
    # u = m_hat / (sqrt(v_hat) + eps) = 1 / (1 + 1e-6); ratio 1 since ||w|| = 0.
    torch.testing.assert_close(p.detach(), torch.full((4,), -0.1 / (1 + 1e-6)))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls,tcls,kw", [(FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                         (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9))])
def test_master_weights_follow_the_fp32_trajectory(half, cls, tcls, kw):
    fp32 = _params()
    params = [p.detach().to(half).requires_grad_() for p in fp32]
    opt = cls(params, master_weights=True, **kw)
    for p, q in zip(params, fp32):  # seed the masters with the exact fp32 weights
        opt.master_param(p).copy_(q.detach())
    ref = tcls(fp32, **kw)
    for k in range(4):
        grads = _grads(k, half)
        for p, q, g in zip(params, fp32, grads):
            p.grad, q.grad = g.clone(), g.float()
        opt.step()
        ref.step()
    for p, q in zip(params, fp32):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and p.dtype == half
        torch.testing.assert_close(master, q.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(p.detach(), master.to(half))
    assert all(opt.state[p][k].dtype == torch.float32 for p in params for k in opt._buffers(opt.param_groups[0]))


def _snapshot(opt, params):
    return [p.detach().clone() for p in params] + [
        v.clone() for p in params for v in opt.state[p].values() if torch.is_tensor(v)]


@pytest.mark.parametrize("cls,kw", [(FusedAdamW, dict(lr=1e-2)), (FusedSGD, dict(lr=0.1, momentum=0.9)),
                                    (FusedLAMB, dict(lr=1e-2)), (FusedAdam, dict(lr=1e-2, weight_decay=0.1))])
@pytest.mark.parametrize("master", [False, True])
def test_found_inf_skips_the_step_bit_exactly(cls, kw, master):
    params = _params(torch.bfloat16 if master else torch.float32)
    opt = cls(params, master_weights=master, **kw)
    _run(opt, params, 2)
    before = _snapshot(opt, params)
    # 1) the caller says so
    _run(opt, params, 1, start=2, found_inf=torch.ones(1))
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(opt, params), before))
    # 2) the step finds a NaN itself and reports it
    found = torch.zeros(1)
    for p, g in zip(params, _grads(3, params[0].dtype)):
        p.grad = g
    params[1].grad[0] = float("nan")
    opt.step(found_inf=found)
    assert found.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(opt, params), before))
    # 3) the step counts did not move: the next clean step is step 3
    assert all(opt.state[p]["step"].item() == 2 for p in params)


def test_skipped_steps_leave_the_trajectory_of_a_run_without_them():
    a, b = _params(), _params()
    oa, ob = FusedAdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2)
    for k in range(5):
        grads = _grads(k)
        if k == 2:
            for p, g in zip(a, grads):
                p.grad = g * float("inf")
            found = torch.zeros(1)
            oa.step(found_inf=found)
            assert found.item() == 1
            continue
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        oa.step(found_inf=torch.zeros(1))
        ob.step()
    _assert_close(a, b)


def test_sgd_skipped_first_step_keeps_the_next_one_first():
    a, b = _params(), _params()
    oa, ob = FusedSGD(a, lr=0.1, momentum=0.9, dampening=0.5), torch.optim.SGD(b, lr=0.1, momentum=0.9,
                                                                                dampening=0.5)
    _run(oa, a, 1, found_inf=torch.ones(1))
    _run(oa, a, 3, start=1)
    _run(ob, b, 3, start=1)
    _assert_close(a, b)


@pytest.mark.parametrize("cls,tcls,kw", [(FusedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
                                         (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9))])
def test_grad_scale_divides_the_grads(cls, tcls, kw):
    a, b = _params(), _params()
    oa, ob = cls(a, **kw), tcls(b, **kw)
    for k in range(3):
        for p, q, g in zip(a, b, _grads(k)):
            p.grad, q.grad = g * 1024, g.clone()
        found = torch.zeros(1)
        oa.step(grad_scale=torch.tensor([1024.0]), found_inf=found)
        ob.step()
        assert found.item() == 0
    _assert_close(a, b)
    assert torch.equal(a[0].grad, _grads(2)[0])  # left unscaled, as torch's fused optimizers leave them
    a[0].grad = _grads(3)[0] * 1024
    oa.step(grad_scale=1024.0, unscale_grads=False)
    assert torch.equal(a[0].grad, _grads(3)[0] * 1024)  # asked to leave them scaled


def test_gradscaler_attribute_protocol():
    a, b = _params(), _params()
    oa, ob = FusedAdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2)
    for p, q, g in zip(a, b, _grads(0)):
        p.grad, q.grad = g * 8, g.clone()
    oa.grad_scale, oa.found_inf = torch.tensor(8.0), torch.zeros(())
    oa.step()
    ob.step()
    _assert_close(a, b)
    before = _snapshot(oa, a)
    oa.found_inf = torch.ones(())
    oa.step()
    assert all(torch.equal(x, y) for x, y in zip(_snapshot(oa, a), before))


def test_torch_amp_gradscaler_drives_the_step():
    params = _params()
    opt = FusedAdamW(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ref_params = _params()
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    for k in range(2):
        loss = sum((p * g).sum() for p, g in zip(params, _grads(k)))
        scaler.scale(loss).backward()
        try:
            scaler.step(opt)
        except (RuntimeError, NotImplementedError) as e:  # no CPU unscale kernel in this torch
            pytest.skip(f"torch.amp.GradScaler('cpu') cannot check CPU grads here: {e}")
        scaler.update()
        opt.zero_grad()
        for q, g in zip(ref_params, _grads(k)):
            q.grad = g.clone()
        ref.step()
    _assert_close(params, ref_params, tol=1e-5)


@pytest.mark.parametrize("cls,kw", [(FusedAdamW, dict(lr=1e-2)), (FusedSGD, dict(lr=0.1, momentum=0.9)),
                                    (FusedLAMB, dict(lr=1e-2))])
@pytest.mark.parametrize("master", [False, True])
def test_state_dict_round_trip(cls, kw, master):
    dtype = torch.bfloat16 if master else torch.float32
    a = _params(dtype)
    oa = cls(a, master_weights=master, **kw)
    _run(oa, a, 2)
    sd = copy.deepcopy(oa.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    ob = cls(b, master_weights=master, **kw)
    ob.load_state_dict(sd)
    for p, q in zip(a, b):
        for k, v in oa.state[p].items():
            assert ob.state[q][k].dtype == v.dtype and torch.equal(ob.state[q][k], v), k
    if master:
        assert all(ob.state[q]["master_param"].dtype == torch.float32 for q in b)
    _run(oa, a, 2, start=2)
    _run(ob, b, 2, start=2)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_loads_a_torch_optim_state_dict():
    a, b = _params(), _params()
    oa, ob = torch.optim.SGD(a, lr=0.1, momentum=0.9, dampening=0.5), None
    _run(oa, a, 2)
    ob = FusedSGD(b, lr=0.1, momentum=0.9, dampening=0.5)
    for p, q in zip(a, b):
        q.data.copy_(p.data)
    ob.load_state_dict(oa.state_dict())
    _run(oa, a, 2, start=2)
    _run(ob, b, 2, start=2)
    _assert_close(a, b)


def test_lr_as_tensor_and_arguments_validated():
    a, b = _params(), _params()
    oa, ob = FusedAdamW(a, lr=torch.tensor(1e-2)), torch.optim.AdamW(b, lr=1e-2)
    _run(oa, a, 2)
    _run(ob, b, 2)
    _assert_close(a, b)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        FusedAdam(_params(), amsgrad=True)
    with pytest.raises(ValueError, match="Nesterov"):
        FusedSGD(_params(), nesterov=True)
    with pytest.raises(ValueError, match="Nesterov"):  # per group too
        FusedSGD([{"params": _params()[:2]}, {"params": _params()[2:], "nesterov": True}], lr=0.1, momentum=0.9,
                 dampening=0.5)
    with pytest.raises(ValueError, match="differentiable"):
        FusedAdamW(_params(), differentiable=True)
    with pytest.raises(ValueError, match="fused"):
        FusedSGD(_params(), fused="sometimes")
    with pytest.raises(ValueError, match="FusedAdam: invalid learning rate -1"):
        FusedAdam(_params(), lr=-1)
    with pytest.raises(ValueError, match=r"FusedLAMB: invalid betas \(0.9, 1.0\)"):
        FusedLAMB(_params(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="FusedSGD: invalid momentum value -0.5"):
        FusedSGD(_params(), momentum=-0.5)
    with pytest.raises(ValueError, match="capturable"):
        FusedAdamW(_params(), capturable=True)
    with pytest.raises(TypeError, match="found_inf"):
        opt = FusedAdamW(a)
        _run(opt, a, 1, found_inf=torch.zeros(3))


def test_enable_and_disable_master_weights():
    params = _params(torch.bfloat16)
    opt = FusedAdamW(params, lr=1e-2)
    _run(opt, params, 1)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.bfloat16
    opt.enable_master_weights()
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt.state[params[0]]["master_param"], params[0].detach().float())
    _run(opt, params, 2, start=1)
    masters = [opt.state[p]["master_param"].clone() for p in params]
    opt.disable_master_weights()
    assert all(p.dtype == torch.float32 and torch.equal(p.detach(), m) for p, m in zip(params, masters))
    assert all("master_param" not in opt.state[p] for p in params)
    _run(opt, params, 1, start=3)  # continues in fp32 with the same moments
    assert all(opt.state[p]["step"].item() == 4 for p in params)
