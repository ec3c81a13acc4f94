"""CompileModel on the GPU (inductor, Triton kernels): the fp32-fallback mode is entered inside the compiled
region, so the compiled code's own tensor calls never reach the mode's Python handler, one graph serves every
forward context, and the result is the compiled forward's under the mode."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _models import counting_fallback_mode  # noqa: E402
from mptrain.callbacks.compile_model import CompileModel  # noqa: E402
from mptrain.precision.fallback import Fp32Fallback, Fp32OpsMode  # noqa: E402


class _Block(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.a, self.b, self.ln = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + F.softmax(self.b(F.gelu(self.a(x))), -1))


def test_compiled_forward_runs_without_the_outer_mode_and_matches_the_compiled_reference():
    torch.manual_seed(0)
    nets = [nn.Sequential(*[_Block() for _ in range(4)]).cuda().to(torch.bfloat16) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    ours, ref = nets
    CompileModel(fullgraph=True).setup(None, types.SimpleNamespace(model=ours), "fit")
    funcs = Fp32Fallback("default")._funcs

    def ref_call(x):
        with Fp32OpsMode(funcs):
            return ref(x)

    ref_compiled = torch.compile(ref_call, fullgraph=True)  # the same graph, the mode entered the same way
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):  # a new outer mode per forward, as the precision plugin makes them
            outer = counting_fallback_mode(funcs)
            with outer:
                out = ours(x)
            assert outer.calls == 0
        expected = ref_compiled(x)
        under = counting_fallback_mode(funcs)
        with under:
            ref(x)  # eager under the mode, for the count printed below
    assert out.dtype == torch.bfloat16
    # two compilations of one graph may autotune different reduction configs: bf16 rounding apart at most
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)
    print(f"eager forward under the mode: {under.calls} handler calls; compiled by CompileModel: 0")
