"""Non-contiguous params and grads step exactly as torch.optim steps them (layout.py)."""
import pytest
import torch

from mptrain.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD
from mptrain.optim.layout import dense_work_lists, is_dense


def _awkward_params(seed=0, dtype=torch.float32):
    """(params, bases): a transposed view, a strided slice of a bigger tensor (not dense),
    a channels_last 4-D tensor and two plain ones, all as leaf params."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    sliced_base = rnd(4, 6)
    raw = [rnd(3, 5).t(), sliced_base[:, ::2], rnd(2, 3, 4, 4).to(memory_format=torch.channels_last),
           rnd(5, 3), rnd(6)]
    return [torch.nn.Parameter(t) for t in raw], sliced_base


def _awkward_grads(params, step):
    """Grads in layouts autograd would not give: transposed, expanded (stride 0), strided."""
    g = torch.Generator().manual_seed(500 + step)
    rnd = lambda *s: torch.randn(*s, generator=g).to(params[0].dtype)  # noqa: E731
    return [rnd(5, 3), rnd(4, 6)[:, ::2], rnd(2, 3, 4, 4), rnd(3, 5).t(), rnd(1).expand(6)]


def test_the_awkward_cases_are_awkward():
    params, _ = _awkward_params()
    grads = _awkward_grads(params, 0)
    assert not is_dense(params[1]) and is_dense(params[0]) and not params[0].is_contiguous()
    assert not is_dense(grads[4]) and grads[0].stride() != params[0].stride()


def test_dense_work_lists_give_the_kernels_dense_alike_tensors():
    params, _ = _awkward_params()
    grads = _awkward_grads(params, 0)
    work_p, work_g, back = dense_work_lists(params, grads)
    for p, w, g, wg in zip(params, work_p, grads, work_g):
        assert is_dense(w) and is_dense(wg) and w.stride() == wg.stride()
        assert torch.equal(w, p) and torch.equal(wg, g)
    assert [p for p, _ in back] == [params[1]]
    assert work_p[0] is params[0] and work_p[3] is params[3]  # dense params are stepped in place
    untouched = [torch.randn(3, 4), torch.randn(2)]
    same_p, same_g, none = dense_work_lists(untouched, [t.clone() for t in untouched])
    assert same_p is untouched and none == []


CASES = [
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
]


@pytest.mark.parametrize("ours,theirs,kw", CASES, ids=[c[0].__name__ for c in CASES])
def test_awkward_layouts_step_like_torch(ours, theirs, kw):
    a, base = _awkward_params()
    b, _ = _awkward_params()
    oa, ob = ours(a, **kw), theirs(b, **kw)
    for k in range(3):
        for p, q, g in zip(a, b, _awkward_grads(a, k)):
            p.grad, q.grad = g, g.clone()
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)
        assert p.stride() == q.stride()  # still the same views
    assert torch.equal(base[:, ::2], a[1].detach())  # the update reached the sliced tensor's storage
    assert torch.equal(base[:, 1::2], _awkward_params()[1][:, 1::2])  # and nothing else in it


def test_awkward_layouts_with_master_weights_follow_the_contiguous_run():
    a, _ = _awkward_params(dtype=torch.bfloat16)
    b = [torch.nn.Parameter(p.detach().clone(memory_format=torch.contiguous_format)) for p in a]
    oa, ob = FusedLAMB(a, lr=1e-2, master_weights=True), FusedLAMB(b, lr=1e-2, master_weights=True)
    for k in range(3):
        for p, q, g in zip(a, b, _awkward_grads(a, k)):
            p.grad, q.grad = g, g.contiguous()
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(oa.state[p]["master_param"], ob.state[q]["master_param"])
