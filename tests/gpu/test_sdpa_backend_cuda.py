"""The attention back end mptrain prefers on this GPU: it is the one that runs, and its output and gradients match
the math back end within bf16 tolerance, at the user BERT's and the user Llama's attention shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from mptrain.precision import sdpa_backend as S
from mptrain.precision.factory import precision_plugin

pytestmark = pytest.mark.cuda

# (batch, heads, seq, head dim, causal, dropout, additive padding mask): the user BERT (train mode), the 1.2B Llama
SHAPES = {"bert": (16, 12, 128, 64, False, 0.0, True), "llama": (2, 16, 2048, 128, True, 0.0, False)}


def _inputs(b, h, s, d, mask):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    m = None
    if mask:  # transformers' expanded 4-D float mask: the last 16 keys of every other row padded away
        m = torch.zeros(b, 1, s, s, device="cuda", dtype=torch.bfloat16)
        m[::2, :, :, -16:] = torch.finfo(torch.bfloat16).min
    return q, k, v, m


def _run(q, k, v, m, causal, p, ctx):
    for t in (q, k, v):
        t.grad = None
    with ctx:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, is_causal=causal)
    out.float().square().mean().backward()
    return out.detach().float(), [t.grad.float() for t in (q, k, v)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_preferred_back_end_runs_and_matches_math(shape):
    b, h, s, d, causal, p, mask = SHAPES[shape]
    order = S.resolve("auto", torch.device("cuda"))
    if order is None:
        pytest.skip(f"no measured order for {torch.cuda.get_device_name()}: torch's own order runs")
    q, k, v, m = _inputs(b, h, s, d, mask)
    plugin = precision_plugin("bf16-true")
    plugin.convert_module(torch.nn.Linear(2, 2, device="cuda"))
    got, got_grads = _run(q, k, v, m, causal, p, plugin.forward_context())
    ref, ref_grads = _run(q, k, v, m, causal, p, sdpa_kernel(S.BACKENDS["math"]))
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    for a, r, name in zip(got_grads, ref_grads, "qkv"):
        err = (a - r).norm() / r.norm()
        assert err < 2e-2, f"d{name}: relative error {err:.3g} against the math back end"
    # the first back end of the order that can take the call is the one that ran: the same bits as forcing it
    for name in order:
        try:
            forced, _ = _run(q, k, v, m, causal, p, sdpa_kernel(S.BACKENDS[name]))
        except RuntimeError:
            continue  # this back end cannot take the call: torch passed over it as well
        assert torch.equal(forced, got), f"{name} is first in {order} and can run, but another back end ran"
        break


def test_off_switch_leaves_torch_order():
    plugin = precision_plugin("bf16-true", sdpa="torch")
    plugin.convert_module(torch.nn.Linear(2, 2, device="cuda"))
    before = torch._C._get_sdp_priority_order()
    with plugin.forward_context():
        assert torch._C._get_sdp_priority_order() == before
