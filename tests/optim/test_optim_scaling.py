"""Under torch.amp.GradScaler the fused step does what torch's fused=True optimizers do:
grads divided by the scale in the step and left unscaled, the step skipped on inf with
the grads left as they were, the scaler backing off alike (scaling.py)."""
import pytest
import torch
from _optim_data import loss_of, model

from mptrain.optim import FusedAdam, FusedAdamW, FusedSGD

PAIRS = [
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
]
INF_AT = (1, 4)  # steps whose loss is made infinite: the scaler must skip them


def _amp_run(make_opt, steps, clip):
    """Train under GradScaler; per step: (params, grads after the step, scale)."""
    net = model()
    opt = make_opt(net.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    record = []
    for k in range(steps):
        opt.zero_grad()
        loss = loss_of(net, k) * (float("inf") if k in INF_AT else 1.0)
        scaler.scale(loss).backward()
        if clip:  # the user unscales first to clip: the step then gets no grad_scale
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        record.append(([p.detach().clone() for p in net.parameters()], [p.grad.clone() for p in net.parameters()],
                       scaler.get_scale()))
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # GradScaler removed them
    return record


@pytest.mark.parametrize("clip", [False, True], ids=["scaled", "unscale_first"])
@pytest.mark.parametrize("ours,theirs,kw", PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_gradscaler_drives_ours_like_torchs_fused_optimizer(ours, theirs, kw, clip):
    mine = _amp_run(lambda ps: ours(ps, **kw), 6, clip)
    torchs = _amp_run(lambda ps: theirs(ps, fused=True, **kw), 6, clip)
    for k, ((p_a, g_a, s_a), (p_b, g_b, s_b)) in enumerate(zip(mine, torchs)):
        assert s_a == s_b, k
        for a, b in zip(p_a, p_b):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        for a, b in zip(g_a, g_b):  # unscaled after a taken step, untouched (inf/NaN) after a skipped one
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
        if k in INF_AT:
            assert all(torch.equal(a, b) for a, b in zip(p_a, mine[k - 1][0]))  # skipped
            assert not all(torch.isfinite(g).all() for g in g_a)
        else:
            assert all(torch.isfinite(g).all() for g in g_a)


def test_unscaled_grads_are_exactly_the_scaled_ones_divided():
    net = model()
    opt = FusedAdamW(net.parameters(), lr=1e-2)
    (loss_of(net, 0) * 1024).backward()
    scaled = [p.grad.clone() for p in net.parameters()]
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.zeros(())
    opt.step()
    assert all(torch.equal(p.grad, g / 1024) for p, g in zip(net.parameters(), scaled))


def test_grads_of_any_layout_are_left_unscaled():
    p, q = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6))
    opt = FusedSGD([p, q], lr=0.1)
    g_p, g_q = torch.randn(4, 6).t() * 64, (torch.randn(1) * 64).expand(6)  # transposed, expanded
    p.grad, q.grad = g_p.clone(), g_q
    assert q.grad.stride() == (0,)
    opt.step(grad_scale=torch.tensor(64.0))
    assert torch.equal(p.grad, g_p / 64) and torch.equal(q.grad, g_q / 64)
