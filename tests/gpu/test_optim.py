"""CUDA optimizer kernels against the reference, float64 and torch.optim: every dtype and
master-weight mix, awkward sizes, misaligned views, guard bands, 1..500 tensors,
inf/NaN skipping bit-exactly, GradScaler, and a capturable step in a CUDA graph."""
import pytest
import torch

from mptrain import ops
from mptrain.ops import reference
from mptrain.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

SIZES = [1, 3, 5, 2047, 2048, 2049, 4096 + 3, 30001]
GUARD = 64
CONFIGS = [(torch.float32, False), (torch.float16, False), (torch.bfloat16, False),
           (torch.float16, True), (torch.bfloat16, True)]
CFG_IDS = ["fp32", "fp16", "bf16", "fp16-master", "bf16-master"]


@pytest.fixture(scope="module")
def ext():
    return ops.get_extension(required=True)


def _guarded(n, dtype, offset, values):
    buf = torch.full((n + 2 * GUARD + offset,), 777.0, device="cuda").to(dtype)
    t = buf[GUARD + offset:GUARD + offset + n]
    t.copy_(values)
    return buf, t


class Lists:
    """Every list an optimizer op takes, each tensor inside a guard-banded buffer;
    tensor 1, 4, 7 ... are misaligned views (storage offset 1)."""

    def __init__(self, cfg, sizes=SIZES, seed=0, buffers=("exp_avg", "exp_avg_sq")):
        pdtype, master = cfg
        sdtype = torch.float32 if master else pdtype
        g = torch.Generator(device="cuda").manual_seed(seed)
        rnd = lambda n: torch.randn(n, device="cuda", generator=g)  # noqa: E731
        self.bufs = []
        self.lists = {k: [] for k in ("grads", "params", "masters", "steps") + buffers}
        for i, n in enumerate(sizes):
            off = 1 if i % 3 == 1 else 0
            w = rnd(n)
            for name, dtype, val in (("grads", pdtype, rnd(n)), ("params", pdtype, w)) + tuple(
                    (b, sdtype, rnd(n).abs() * 0.1 if b == "exp_avg_sq" else rnd(n) * 0.1) for b in buffers):
                buf, t = _guarded(n, dtype, off, val)
                self.bufs.append(buf)
                self.lists[name].append(t)
            if master:
                buf, t = _guarded(n, torch.float32, off, w)
                self.bufs.append(buf)
                self.lists["masters"].append(t)
            self.lists["steps"].append(torch.full((), float(i % 4), device="cuda"))
        self.sentinels = [b.clone() for b in self.bufs]

    def clone(self):
        other = Lists.__new__(Lists)
        other.lists = {k: [t.clone() for t in v] for k, v in self.lists.items()}
        return other

    def guards_intact(self):
        for b, s in zip(self.bufs, self.sentinels):
            if not (torch.equal(b[:GUARD], s[:GUARD]) and torch.equal(b[-GUARD:], s[-GUARD:])):
                return False
        return True

    def snapshot(self):
        return [t.clone() for v in self.lists.values() for t in v]


def _tol(dtype):
    return {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=1e-5),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=0)}[dtype]


def _compare(a, b):
    for k in a.lists:
        for x, y in zip(a.lists[k], b.lists[k]):
            torch.testing.assert_close(x, y, **_tol(x.dtype), msg=lambda m: f"{k}: {m}")


OPS = {
    "adam": (lambda L, fused, **kw: ops.multi_tensor_adam(
        L["grads"], L["params"], L["exp_avg"], L["exp_avg_sq"], L["steps"], L["masters"], lr=1e-2, beta1=0.9,
        beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=False, fused=fused, **kw), ("exp_avg", "exp_avg_sq")),
    "adamw": (lambda L, fused, **kw: ops.multi_tensor_adam(
        L["grads"], L["params"], L["exp_avg"], L["exp_avg_sq"], L["steps"], L["masters"], lr=1e-2, beta1=0.8,
        beta2=0.99, eps=1e-6, weight_decay=0.05, decoupled=True, maximize=True, fused=fused, **kw),
        ("exp_avg", "exp_avg_sq")),
    "sgd": (lambda L, fused, **kw: ops.multi_tensor_sgd(
        L["grads"], L["params"], L["momentum_buffer"], L["steps"], L["masters"], lr=0.1, momentum=0.9,
        dampening=0.2, weight_decay=0.01, nesterov=False, fused=fused, **kw), ("momentum_buffer",)),
    "sgd-nesterov": (lambda L, fused, **kw: ops.multi_tensor_sgd(
        L["grads"], L["params"], L["momentum_buffer"], L["steps"], L["masters"], lr=0.1, momentum=0.9,
        dampening=0.0, weight_decay=0.0, nesterov=True, maximize=True, fused=fused, **kw), ("momentum_buffer",)),
    "sgd-plain": (lambda L, fused, **kw: ops.multi_tensor_sgd(
        L["grads"], L["params"], [], L["steps"], L["masters"], lr=0.1, momentum=0.0, dampening=0.0,
        weight_decay=0.01, nesterov=False, fused=fused, **kw), ()),
    "lamb": (lambda L, fused, **kw: ops.multi_tensor_lamb(
        L["grads"], L["params"], L["exp_avg"], L["exp_avg_sq"], L["steps"], L["masters"], lr=1e-2, beta1=0.9,
        beta2=0.999, eps=1e-6, weight_decay=0.01, fused=fused, **kw), ("exp_avg", "exp_avg_sq")),
}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("cfg", CONFIGS, ids=CFG_IDS)
def test_kernel_matches_reference(ext, op, cfg):
    fn, buffers = OPS[op]
    ours = Lists(cfg, buffers=buffers)
    ref = ours.clone()
    scale = torch.tensor(64.0, device="cuda")
    for L in (ours, ref):
        for g in L.lists["grads"]:
            g.mul_(64)
    for _ in range(3):
        fn(ours.lists, True, grad_scale=scale)
        fn(ref.lists, False, grad_scale=scale)
    _compare(ours, ref)
    assert ours.guards_intact()


@pytest.mark.parametrize("op", ["adam", "adamw"])
def test_master_adam_against_float64(ext, op):
    """fp32 masters, m and v stay within fp32 rounding of a float64 run of the same update
    (the bf16 params and grads are exact inputs to both)."""
    fn, buffers = OPS[op]
    ours = Lists((torch.bfloat16, True), buffers=buffers, sizes=SIZES + [8192 * 3 + 5], seed=7)
    exact = ours.clone()
    exact.lists = {k: [t.double() if k in ("masters",) + buffers else t for t in v] for k, v in exact.lists.items()}
    for _ in range(3):
        fn(ours.lists, True)
        fn(exact.lists, False)
    for k in ("masters",) + buffers:
        for x, y in zip(ours.lists[k], exact.lists[k]):
            torch.testing.assert_close(x.double(), y, rtol=2e-5, atol=2e-6, msg=lambda m: f"{k}: {m}")
    assert [s.item() for s in ours.lists["steps"]] == [s.item() for s in exact.lists["steps"]]
    assert ours.guards_intact()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_queue_skip_bit_exactly_then_step(ext, bad):
    """A skipped queue launch touches nothing (step counts included) and leaves its chunk
    counters zeroed: the next, finite step must then update every chunk."""
    fn, buffers = OPS["adamw"]
    L = Lists((torch.bfloat16, True), buffers=buffers, seed=4, sizes=SIZES + [0, 8192 * 5 + 1])
    ref = L.clone()
    L.lists["grads"][4][-1] = bad
    before = L.snapshot()
    found = torch.zeros(1, device="cuda")
    ops.multi_tensor.multi_tensor_check_finite_(L.lists["grads"], found, fused=True)
    fn(L.lists, True, grad_scale=torch.tensor(8.0, device="cuda"), found_inf=found)
    assert found.item() == 1.0
    assert all(torch.equal(a, b) or (a.isnan() & b.isnan()).any() and torch.equal(a.nan_to_num(), b.nan_to_num())
               for a, b in zip(L.snapshot(), before))
    L.lists["grads"][4][-1] = ref.lists["grads"][4][-1]
    for _ in range(2):
        fn(L.lists, True, found_inf=torch.zeros(1, device="cuda"))
        fn(ref.lists, False)
    _compare(L, ref)
    assert L.guards_intact()


@pytest.mark.parametrize("n_tensors", [1, 500, 1200])  # 1200: several launches, each with its own last block
def test_queue_many_tensors(ext, n_tensors):
    sizes = [(13 * i + 5) % 2500 for i in range(n_tensors)]  # includes empty tensors (step still advances)
    fn, buffers = OPS["adamw"]
    ours = Lists((torch.bfloat16, True), sizes=sizes, buffers=buffers, seed=3)
    ref = ours.clone()
    for _ in range(2):
        fn(ours.lists, True)
        fn(ref.lists, False)
    _compare(ours, ref)
    assert ours.guards_intact()


def test_queue_in_a_cuda_graph(ext):
    """The queue counters reset themselves: a captured step replays correctly."""
    fn, buffers = OPS["adamw"]
    ours = Lists((torch.bfloat16, True), buffers=buffers, seed=9, sizes=SIZES + [8192 * 7])
    ref = ours.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(ours.lists, True)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    fn(ref.lists, False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(ours.lists, True)
    for _ in range(3):
        graph.replay()
        fn(ref.lists, False)
    torch.cuda.synchronize()
    _compare(ours, ref)
    assert ours.guards_intact()


@pytest.mark.parametrize("op", list(OPS))
def test_fp32_kernel_against_float64(ext, op):
    fn, buffers = OPS[op]
    ours = Lists((torch.float32, False), buffers=buffers, seed=5)
    exact = ours.clone()
    exact.lists = {k: [t.double() if k != "steps" else t for t in v] for k, v in exact.lists.items()}
    for _ in range(3):
        fn(ours.lists, True)
        fn(exact.lists, False)
    for k in ours.lists:
        for x, y in zip(ours.lists[k], exact.lists[k]):
            torch.testing.assert_close(x.double(), y.double(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("cfg", CONFIGS, ids=CFG_IDS)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_grad_skips_bit_exactly(ext, op, cfg, bad):
    fn, buffers = OPS[op]
    L = Lists(cfg, buffers=buffers, seed=2)
    L.lists["grads"][4][-1] = bad  # a misaligned tensor's tail
    before = L.snapshot()
    found = torch.zeros(1, device="cuda")
    ops.multi_tensor.multi_tensor_check_finite_(L.lists["grads"], found, fused=True)
    fn(L.lists, True, grad_scale=torch.tensor(8.0, device="cuda"), found_inf=found)
    assert found.item() == 1.0
    assert all(torch.equal(a, b) or (a.isnan() & b.isnan()).any() and torch.equal(a.nan_to_num(), b.nan_to_num())
               for a, b in zip(L.snapshot(), before))
    assert L.guards_intact()


@pytest.mark.parametrize("cfg", [(torch.bfloat16, True), (torch.float32, False)], ids=["bf16-master", "fp32"])
@pytest.mark.parametrize("n_tensors", [1, 2, 100, 500, 1200])  # 1200: more than one launch's worth
@pytest.mark.parametrize("op", ["adamw", "lamb"])
def test_many_tensors_per_list(ext, cfg, n_tensors, op):
    sizes = [(13 * i + 5) % 2500 + 1 for i in range(n_tensors)]
    fn, buffers = OPS[op]
    ours = Lists(cfg, sizes=sizes, buffers=buffers, seed=3)
    ref = ours.clone()
    fn(ours.lists, True)
    fn(ref.lists, False)
    _compare(ours, ref)
    assert ours.guards_intact()


def _params(dtype=torch.float32, misaligned=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for i, n in enumerate(SIZES):
        base = torch.randn(n + 1, device="cuda", generator=g).to(dtype)
        t = base[1:] if misaligned and i % 2 else base[1:].clone()  # same values either way
        out.append(torch.nn.Parameter(t))
    return out


def _grads(k, like):
    g = torch.Generator(device="cuda").manual_seed(100 + k)
    return [torch.randn(p.shape, device="cuda", generator=g).to(p.dtype) for p in like]


@pytest.mark.parametrize("ours,theirs,kw", [
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
])
def test_optimizer_matches_torch_on_cuda(ext, ours, theirs, kw):
    a, b = _params(), _params(misaligned=False)
    oa, ob = ours(a, fused=True, **kw), theirs(b, **kw)
    for k in range(4):
        for p, q, g in zip(a, b, _grads(k, a)):
            p.grad, q.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_master_weights_bf16_follow_fp32(ext):
    fp32 = _params(misaligned=False)
    half = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in fp32]
    opt = FusedAdamW(half, lr=1e-2, master_weights=True, fused=True)
    for p, q in zip(half, fp32):
        opt.master_param(p).copy_(q.detach())
    ref = torch.optim.AdamW(fp32, lr=1e-2)
    for k in range(4):
        for p, q, g in zip(half, fp32, _grads(k, half)):
            p.grad, q.grad = g, g.float()
        opt.step()
        ref.step()
    for p, q in zip(half, fp32):
        torch.testing.assert_close(opt.state[p]["master_param"], q.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16))


@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD, FusedLAMB])
def test_optimizer_step_finds_nan_itself(ext, cls):
    params = _params(torch.bfloat16)
    opt = cls(params, lr=1e-2, master_weights=True, fused=True)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    opt.step()
    before = [p.detach().clone() for p in params] + [v.clone() for p in params for v in opt.state[p].values()]
    params[3].grad[7] = float("nan")
    found = torch.zeros(1, device="cuda")
    opt.step(grad_scale=torch.tensor(1.0, device="cuda"), found_inf=found)
    after = [p.detach().clone() for p in params] + [v.clone() for p in params for v in opt.state[p].values()]
    assert found.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("ours,theirs,kw", [
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
])
def test_gradscaler_drives_ours_like_torchs_fused(ext, ours, theirs, kw):
    """Grads left unscaled by a taken step, untouched by a skipped one; same params and scale."""
    a, b = _params(misaligned=False), _params(misaligned=False)
    oa, ob = ours(a, fused=True, **kw), theirs(b, fused=True, **kw)
    sa, sb = torch.amp.GradScaler("cuda", init_scale=2.0**8), torch.amp.GradScaler("cuda", init_scale=2.0**8)
    for k in range(4):
        for ps, opt, sc in ((a, oa, sa), (b, ob, sb)):
            opt.zero_grad()
            loss = sum((p * g).sum() for p, g in zip(ps, _grads(k, ps)))
            if k == 2:
                loss = loss * float("inf")
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        for p, q in zip(a, b):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, equal_nan=True)
    assert sa.get_scale() == sb.get_scale() == 2.0**7
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _awkward(dtype, seed):
    """A transposed view, a strided slice (not dense), channels_last, a plain param; and
    grads transposed, expanded and strided: fused=True must step them all."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(dtype)  # noqa: E731
    params = [torch.nn.Parameter(t) for t in (rnd(300, 70).t(), rnd(40, 600)[:, ::3],
                                              rnd(4, 8, 9, 9).to(memory_format=torch.channels_last), rnd(70, 300))]
    grads = [[rnd(70, 300), rnd(40, 600)[:, ::3], rnd(4, 8, 9, 9), rnd(300, 70).t()] for _ in range(3)]
    grads[1][3] = rnd(1, 300).expand(70, 300)
    return params, grads


@pytest.mark.parametrize("ours,theirs,kw", [
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
])
def test_non_contiguous_params_and_grads_with_fused_kernels(ext, ours, theirs, kw):
    a, grads = _awkward(torch.float32, 0)
    b, _ = _awkward(torch.float32, 0)
    oa, ob = ours(a, fused=True, **kw), theirs(b, **kw)
    for step_grads in grads:
        for p, q, g in zip(a, b, step_grads):
            p.grad, q.grad = g, g.clone()
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        assert p.stride() == q.stride()
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_non_contiguous_bf16_params_with_master_weights(ext):
    a, grads = _awkward(torch.bfloat16, 1)
    b = [torch.nn.Parameter(p.detach().clone(memory_format=torch.contiguous_format)) for p in a]
    oa = FusedAdamW(a, lr=1e-2, master_weights=True, fused=True)
    ob = FusedAdamW(b, lr=1e-2, master_weights=True, fused=True)
    for step_grads in grads:
        for p, q, g in zip(a, b, step_grads):
            p.grad, q.grad = g, g.contiguous()
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q) and torch.equal(oa.state[p]["master_param"], ob.state[q]["master_param"])


def test_capturable_float_lr_lives_on_the_device_and_a_scheduler_drives_the_graph(ext):
    def make():
        ps = [torch.nn.Parameter(p.detach().clone()) for p in _params(misaligned=False)]
        opt = FusedAdamW(ps, lr=1e-2, capturable=True, fused=True)
        return ps, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))

    (pa, oa, sa), (pb, ob, sb) = make(), make()
    lr = oa.param_groups[0]["lr"]
    assert torch.is_tensor(lr) and lr.is_cuda and lr.dtype == torch.float32
    for ps, opt in ((pa, oa), (pb, ob)):
        for p, g in zip(ps, _grads(0, ps)):
            p.grad = g
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: creates the state outside the capture
        oa.step()
    torch.cuda.current_stream().wait_stream(side)
    ob.step()
    sa.step()
    sb.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        oa.step()
    for k in range(1, 4):
        for p, q, g in zip(pa, pb, _grads(k, pa)):
            p.grad.copy_(g)
            q.grad = g.clone()
        graph.replay()
        ob.step()
        sa.step()
        sb.step()
        assert oa.param_groups[0]["lr"] is lr  # filled in place, so the graph reads each new value
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)


def test_compiled_fused_step_equals_eager(ext):
    """Until the kernels are custom ops, dynamo breaks the graph at the extension call;
    the numbers must be eager's either way."""
    a, b = _params(misaligned=False), _params(misaligned=False)
    oa = FusedAdamW(a, lr=torch.tensor(1e-2, device="cuda"), fused=True)
    ob = FusedAdamW(b, lr=torch.tensor(1e-2, device="cuda"), fused=True)
    compiled = torch.compile(oa.step, backend="aot_eager")
    for k in range(3):
        for p, q, g in zip(a, b, _grads(k, a)):
            p.grad, q.grad = g.clone(), g.clone()
        compiled()
        ob.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.parametrize("cls,kw", [(FusedAdamW, dict(weight_decay=0.1)), (FusedSGD, dict(momentum=0.9)),
                                    (FusedLAMB, {})])
def test_capturable_step_in_a_cuda_graph(ext, cls, kw):
    def make():
        ps = [torch.nn.Parameter(p.detach().clone()) for p in _params(torch.bfloat16, misaligned=False)]
        return ps, cls(ps, lr=torch.tensor(1e-2, device="cuda"), master_weights=True, capturable=True,
                       fused=True, **kw)

    (pa, oa), (pb, ob) = make(), make()
    scale, found = torch.tensor(4.0, device="cuda"), torch.zeros(1, device="cuda")
    for p, g in zip(pa, _grads(0, pa)):
        p.grad = g * 4
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: creates the state outside the capture
        oa.step(grad_scale=scale, found_inf=found)
    torch.cuda.current_stream().wait_stream(side)
    for p, g in zip(pb, _grads(0, pb)):
        p.grad = g * 4
    ob.step(grad_scale=scale, found_inf=torch.zeros(1, device="cuda"))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        found.zero_()
        oa.step(grad_scale=scale, found_inf=found)
    for k in range(1, 4):
        lr = 1e-2 / k
        oa.param_groups[0]["lr"].fill_(lr)
        ob.param_groups[0]["lr"].fill_(lr)
        for p, q, g in zip(pa, pb, _grads(k, pa)):
            p.grad.copy_(g * 4)
            q.grad = g * 4
        graph.replay()
        ob.step(grad_scale=scale, found_inf=torch.zeros(1, device="cuda"))
        assert found.item() == 0
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
        assert torch.equal(oa.state[p]["master_param"], ob.state[q]["master_param"])
    before = [p.detach().clone() for p in pa]
    pa[0].grad[0] = float("inf")
    graph.replay()
    assert found.item() == 1.0
    assert all(torch.equal(p, b) for p, b in zip(pa, before))
    assert all(oa.state[p]["step"].item() == 4 for p in pa)
