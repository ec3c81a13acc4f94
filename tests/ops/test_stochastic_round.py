"""Stochastic rounding to bf16 (the bf16-sr mode): the Philox generator against Random123's known answers, the
rounding against a direct formula, its statistics (unbiased, probability proportional to the distance,
reproducible, different per seed/step/tensor/element), the SR optimizer-step ops (opcheck; same update as the
round-to-nearest step apart from the rounding) on the CPU reference."""
import math

import pytest
import torch

import mptrain.ops  # noqa: F401  (defines the ops)
from mptrain import ops
from mptrain.ops import reference as R

OPS = torch.ops.mptrain
TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

# Random123's kat_vectors for philox4x32_10: (counter, key, output)
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in R.philox4x32_10(counter, key)) == expected


def _philox_scalar(c, k):
    """Philox-4x32-10 on Python ints (arbitrary precision: no tricks), the oracle of the tensor version."""
    m = (0xD2511F53, 0xCD9E8D57)
    w = (0x9E3779B9, 0xBB67AE85)
    c0, c1, c2, c3 = c
    k0, k1 = k
    for _ in range(10):
        p0, p1 = m[0] * c0, m[1] * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c3 ^ k1, p0 & 0xFFFFFFFF
        k0, k1 = (k0 + w[0]) & 0xFFFFFFFF, (k1 + w[1]) & 0xFFFFFFFF
    return c0, c1, c2, c3


def _direct_round(x: torch.Tensor, seed: int, step: int, tensor: int) -> torch.Tensor:
    """The documented rule element by element in Python ints: bits of element e = low 16 bits of word e % 4 of
    Philox(counter=(q lo, q hi, tensor, seed hi), key=(seed lo, step)), q = e // 4; add to the fp32 pattern, keep
    the upper half; inf/NaN keep their upper half (NaN with the quiet bit)."""
    out = []
    for e, v in enumerate(x.flatten().tolist()):
        u = torch.tensor(v, dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF
        q = e // 4
        words = _philox_scalar((q & 0xFFFFFFFF, q >> 32, tensor, seed >> 32), (seed & 0xFFFFFFFF, step))
        if (u & 0x7F800000) == 0x7F800000:
            bits = (u >> 16) | (0x40 if u & 0x7FFFFF else 0)
        else:
            bits = (u + (words[e % 4] & 0xFFFF)) >> 16
        out.append(bits - 0x10000 if bits >= 0x8000 else bits)
    return torch.tensor(out, dtype=torch.int16).view(torch.bfloat16).view(x.shape)


@pytest.mark.parametrize("seed,step,tensor", [(0, 1, 0), (123456789, 77, 5), (2 ** 63 + 12345, 2 ** 32 - 1, 2 ** 31)])
def test_reference_equals_the_direct_formula(seed, step, tensor):
    torch.manual_seed(0)
    x = torch.randn(37) * torch.logspace(-30, 30, 37)
    x[3], x[4], x[5], x[6] = math.inf, -math.inf, math.nan, -0.0
    x[7] = torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32)  # NaN whose payload is in the low bits
    x[8] = 1e-41  # subnormal
    got = R.stochastic_round(x, seed, step, tensor)
    want = _direct_round(x, seed, step, tensor)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got[3] == math.inf and got[4] == -math.inf and got[5].isnan() and got[7].isnan()


def test_rounds_to_one_of_the_two_neighbours():
    torch.manual_seed(1)
    x = torch.randn(10000)
    y = R.stochastic_round(x, 3, 1, 0).float()
    lo = x.bfloat16().float()  # not necessarily below x: compare with the truncated and the next value
    trunc = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    up = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    assert bool(((y == trunc) | (y == up)).all())
    exact = x == trunc
    assert torch.equal(y[exact], x[exact])  # a value bf16 holds is never moved
    assert lo.shape == y.shape


@pytest.mark.parametrize("frac", [0.25, 0.5, 0.01, 0.9])
def test_unbiased_and_probability_proportional_to_distance(frac):
    n = 200_000
    base = 1.5  # ulp of bf16 at 1.5 is 2^-7
    ulp = 2.0 ** -7
    x = torch.full((n,), base + frac * ulp, dtype=torch.float32)
    y = R.stochastic_round(x, 2024, 3, 1).float()
    up = (y > base).double().mean().item()
    sigma = math.sqrt(frac * (1 - frac) / n)
    assert abs(up - frac) < 5 * sigma, (up, frac)
    # mean within 5 sigma of the fp32 value
    assert abs(y.double().mean().item() - (base + frac * ulp)) < 5 * sigma * ulp
    assert bool(((y == base) | (y == base + ulp)).all())


def test_unbiased_on_random_values_of_every_sign_and_scale():
    torch.manual_seed(2)
    x = torch.randn(64) * torch.logspace(-20, 20, 64)
    reps = 4000
    acc = torch.zeros(64, dtype=torch.float64)
    for step in range(1, reps + 1):
        acc += R.stochastic_round(x, 9, step, 0).double()
    mean = acc / reps
    trunc = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).double()
    ulp = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32).double() - trunc
    # per element: mean - x within 5 sigma of a Bernoulli(p) mean times the ulp (sigma <= 0.5 / sqrt(reps))
    assert bool(((mean - x.double()).abs() <= 5 * 0.5 / math.sqrt(reps) * ulp.abs() + 1e-300).all())


def test_reproducible_and_different_per_seed_step_tensor_element():
    x = torch.full((4096,), 1.0 + 2.0 ** -8, dtype=torch.float32)  # half an ulp: each element a fair coin
    a = R.stochastic_round(x, 5, 10, 2)
    assert torch.equal(a, R.stochastic_round(x, 5, 10, 2))
    bits = R.stochastic_round_bits(x, 5, 10, 2)
    assert bits.unique().numel() > 3900  # 16-bit values, 4096 draws: nearly all distinct, not repeated per word
    for other in (R.stochastic_round(x, 6, 10, 2), R.stochastic_round(x, 5, 11, 2), R.stochastic_round(x, 5, 10, 3),
                  R.stochastic_round(x, 5 + 2 ** 32, 10, 2)):
        differ = (other != a).float().mean().item()
        assert 0.4 < differ < 0.6, differ  # independent coins disagree half the time
    # the step may be a device tensor (a step count: no host read)
    assert torch.equal(a, R.stochastic_round(x, 5, torch.tensor(10.0).long(), 2))


def test_memory_order_is_the_element_order():
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    y = R.stochastic_round(x, 1, 2, 3)
    flat_in_memory = x.permute(0, 2, 3, 1).reshape(-1)
    assert torch.equal(y.permute(0, 2, 3, 1).reshape(-1), R.stochastic_round(flat_in_memory.contiguous(), 1, 2, 3))


def test_stochastic_round_op_opcheck_and_wrapper():
    x = torch.randn(7, 5)
    torch.library.opcheck(OPS.stochastic_round.default, (x, 3, 4, 5), test_utils=TESTS)
    assert torch.equal(OPS.stochastic_round(x, 3, 4, 5), R.stochastic_round(x, 3, 4, 5))
    assert torch.equal(ops.stochastic_round(x, 3, 4, 5), R.stochastic_round(x, 3, 4, 5))
    cl = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert OPS.stochastic_round(cl, 1, 1, 1).stride() == cl.stride()
    with pytest.raises(TypeError, match="float32"):
        OPS.stochastic_round(x.double(), 1, 1, 1)
    with pytest.raises(ValueError, match="2\\^32"):
        OPS.stochastic_round(x, 1, 2 ** 32, 1)


# ---- the optimizer-step ops


def _lists(n=3, numel=(33, 64, 5), momentum=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = [torch.randn(k, generator=g).bfloat16() for k in numel[:n]]
    gr = [torch.randn(k, generator=g).bfloat16() for k in numel[:n]]
    m = [torch.randn(k, generator=g).abs() * 0.1 for k in numel[:n]]
    v = [torch.rand(k, generator=g) * 0.01 for k in numel[:n]]
    s = [torch.full((), 3.0) for _ in range(n)]
    return p, gr, m, v, s


def test_sr_ops_opcheck():
    p, g, m, v, s = _lists()
    torch.library.opcheck(OPS.multi_tensor_adam_sr_.default,
                          (g, p, m, v, s, 1e-3, None, 0.9, 0.999, 1e-8, 0.01, True, False, None, None, 7, 0),
                          test_utils=TESTS)
    p, g, m, v, s = _lists()
    torch.library.opcheck(OPS.multi_tensor_sgd_sr_.default,
                          (g, p, m, s, 1e-2, None, 0.9, 0.0, 0.0, False, False, None, None, 7, 3), test_utils=TESTS)
    p, g, m, v, s = _lists()
    torch.library.opcheck(OPS.multi_tensor_lamb_sr_.default,
                          (g, p, m, v, s, 1e-3, None, 0.9, 0.999, 1e-6, 0.01, True, False, None, None, 7, 0),
                          test_utils=TESTS)


@pytest.mark.parametrize("opt", ["adam", "adamw", "sgd", "lamb"])
def test_sr_step_is_the_fp32_update_rounded_stochastically(opt):
    """The SR step computes what the fp32-master step computes from the same bf16 weight, and writes the bf16 param
    with stochastic_round(new fp32 weight, seed, step, offset + i)."""
    p, g, m, v, s = _lists()
    masters = [t.float() for t in p]
    p2 = [t.clone() for t in p]
    m2, v2, s2 = [t.clone() for t in m], [t.clone() for t in v], [t.clone() for t in s]
    seed, offset = 99, 10
    if opt in ("adam", "adamw"):
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=opt == "adamw")
        ops.multi_tensor_adam(g, p, m, v, s, sr=(seed, offset), **kw)
        ops.multi_tensor_adam(g, p2, m2, v2, s2, masters, **kw)
    elif opt == "sgd":
        kw = dict(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.1, nesterov=True)
        ops.multi_tensor_sgd(g, p, m, s, sr=(seed, offset), **kw)
        ops.multi_tensor_sgd(g, p2, m2, s2, masters, **kw)
    else:
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.1)
        ops.multi_tensor_lamb(g, p, m, v, s, sr=(seed, offset), **kw)
        ops.multi_tensor_lamb(g, p2, m2, v2, s2, masters, **kw)
    for i in range(len(p)):
        assert torch.equal(p[i], R.stochastic_round(masters[i], seed, 4, offset + i))  # step count 3 -> step 4
        assert torch.equal(m[i], m2[i])
        if opt != "sgd":
            assert torch.equal(v[i], v2[i])
        assert s[i].item() == 4.0


def test_sr_step_skips_on_found_inf_and_checks_its_lists():
    p, g, m, v, s = _lists()
    before = [t.clone() for t in p]
    found = torch.ones(1)
    ops.multi_tensor_adam(g, p, m, v, s, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
                          found_inf=found, sr=(1, 0))
    assert all(torch.equal(a, b) for a, b in zip(p, before)) and s[0].item() == 3.0
    with pytest.raises(TypeError, match="bfloat16"):
        ops.multi_tensor_adam([t.float() for t in g], [t.float() for t in p], m, v, s, lr=1e-2, beta1=0.9,
                              beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, sr=(1, 0))
    with pytest.raises(ValueError, match="masters"):
        ops.multi_tensor_adam(g, p, m, v, s, [t.float() for t in p], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.0, decoupled=True, sr=(1, 0))


def test_sr_moves_a_weight_that_round_to_nearest_never_moves():
    """lr * update far below half a bf16 ulp: round-to-nearest leaves the weight, SR moves it by the update in
    expectation (SGD without momentum: the update is exact)."""
    n = 100_000
    w = torch.ones(n, dtype=torch.bfloat16)
    grad = torch.ones(n, dtype=torch.bfloat16)
    lr, steps = 2.0 ** -12, 8  # each update is 1/16 of the bf16 ulp just below 1.0 (2^-8)
    p_sr, p_rn = [w.clone()], [w.clone()]
    s_sr, s_rn = [torch.zeros(())], [torch.zeros(())]
    for _ in range(steps):
        ops.multi_tensor_sgd([grad], p_sr, [], s_sr, lr=lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                             nesterov=False, sr=(3, 0))
        ops.multi_tensor_sgd([grad], p_rn, [], s_rn, lr=lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                             nesterov=False)
    assert torch.equal(p_rn[0], w)  # every update lost
    moved = 1.0 - p_sr[0].double().mean().item()
    assert moved == pytest.approx(steps * lr, rel=0.05)
