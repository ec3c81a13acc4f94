"""Host time of a compiled forward under the fp32-fallback mode (lab tool, not shipped): the model compiled
with ``nn.Module.compile`` and called under the mode (the compiled code's tensor calls pass through the mode's
Python handler) against ``CompileModel``, which enters the mode inside the compiled region.  CPU, one thread,
inductor, a 12-layer bf16 MLP block stack small enough that the host is all there is.

    python3 dev/compiled_fallback_host.py [--layers 12] [--width 16]
"""
from __future__ import annotations

import argparse
import sys
import types

import torch
from torch import nn

from mptrain.bench.host_cost import per_call_us
from mptrain.callbacks.compile_model import CompileModel
from mptrain.precision.fallback import Fp32Fallback


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a, self.b, self.ln = nn.Linear(d, d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + self.b(nn.functional.gelu(self.a(x))).softmax(-1))


def best_us(rows, n=300, rounds=7) -> dict:
    """Best µs per call of each row (host_cost's per_call_us, one loop a round), the rows interleaved round by
    round so that the machine's drift moves every row alike."""
    best = {name: float("inf") for name, _ in rows}
    for _ in range(rounds):
        for name, fn in rows:
            best[name] = min(best[name], per_call_us(fn, n, lambda: None, repeats=1))
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=16)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(4, a.width, dtype=torch.bfloat16)
    nets = [nn.Sequential(*[Block(a.width) for _ in range(a.layers)]).to(torch.bfloat16) for _ in range(3)]
    for n in nets[1:]:
        n.load_state_dict(nets[0].state_dict())
    eager, under, inside = nets
    under.compile()
    holder = types.SimpleNamespace(model=inside)
    CompileModel().setup(None, holder, "fit")
    fb = Fp32Fallback("default")

    def run(net):
        def call():
            with fb.context():
                return net(x)
        return call

    with torch.no_grad():
        rows = [("eager, under the mode", run(eager)), ("compiled, called under the mode", run(under)),
                ("compiled, mode inside (CompileModel)", run(inside)), ("compiled, no mode", lambda: under(x))]
        ref = run(eager)()
        for name, fn in rows[1:3]:
            out = fn()
            print(f"{name}: max |diff| to eager {float((out.float() - ref.float()).abs().max()):.3g}")
        for name, us in best_us(rows).items():
            print(f"{name:40} {us:8.1f} us per forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
