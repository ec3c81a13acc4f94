"""LSTM benchmark cases, each against PyTorch in the same process, bf16, fwd+bwd
with autograd.grad over inputs and parameters; ours and torch's timed alike, in interleaved rounds.

* FusedLSTMCell vs nn.LSTMCell, batch x hidden 256x1024 and 1024x1024.  Both sides are host-bound
  (H200: ~0.39 ms per call for ~0.05-0.1 ms of GPU work), so the row is the wall time per call of a
  200-call loop (common.loop_ms; CUDA events per call miss the host time before the first launch);
  the "[CUDA graph: GPU time]" row replays the same fwd+bwd captured (GPU work and launch gaps only).
  Its floor counts the pointwise bytes alone (a bound, not an efficiency); extra has the GEMM floor.
* the pointwise kernels alone vs torch's fused cell kernels (_thnn_fused_lstm_cell): 28 elems of B*H.
* 2-layer LSTM, hidden 1024, T=128, batch 64: FusedLSTM(impl="auto"/"fused") vs nn.LSTM (cuDNN; in
  bf16 it copies its unflattened weights every call, FusedLSTM flattens them), and a FusedLSTMCell
  loop vs an nn.LSTMCell loop.  No floor (a latency-bound recurrence).
The host time of one call alone is `mptrain.bench.host_cost`'s table.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from mptrain.bench.common import Result, floor_ms, input_sets, loop_ms, median_ms
from mptrain.bench.graph_timing import step_ms
from mptrain.compat import torch as compat
from mptrain.nn.lstm import FusedLSTM, FusedLSTMCell

BF16 = torch.bfloat16
GEMM_FLOPS = 690e12


def _timed(fns: dict, rep_ms: float, rounds: int = 2, timer=median_ms) -> dict:
    """Each fn's best ``timer`` time over interleaved rounds (a, b, a, b): none is favoured by being
    timed first (FusedLSTM's cuDNN path came out 2% slower timed after nn.LSTM, the same call)."""
    best = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = timer(fn, rep_ms=rep_ms)
            best[name] = min(best.get(name, t), t)
    return best


def _cell_case(batch: int, hidden: int, quick: bool) -> list[Result]:
    torch.manual_seed(0)
    ref = nn.LSTMCell(hidden, hidden, device="cuda", dtype=BF16)
    ours = FusedLSTMCell(hidden, hidden, device="cuda", dtype=BF16, fused=True)
    ours.load_state_dict(ref.state_dict())

    sets = input_sets(lambda: [torch.randn(batch, hidden, device="cuda", dtype=BF16, requires_grad=True)
                               for _ in range(3)], 3 * batch * hidden * 2)
    rot = itertools.cycle(sets)

    def run(cell):
        params = list(cell.parameters())
        cot = [torch.randn(batch, hidden, device="cuda", dtype=BF16) for _ in range(2)]

        def step(xhc):
            x, h, c = xhc
            return torch.autograd.grad(cell(x, (h, c)), [x, h, c] + params, cot)

        return step

    steps = {"ref": run(ref), "ours": run(ours)}
    rep = 50 if quick else 200
    calls = {k: (lambda s=s: s(next(rot))) for k, s in steps.items()}
    t = _timed(calls, rep_ms=rep, timer=lambda fn, rep_ms: loop_ms(fn, calls=50 if quick else 200), rounds=3)
    gemm_flops = 6 * 2 * batch * hidden * 4 * hidden  # 2 fwd + 4 bwd GEMMs of (B, H) x (H, 4H)
    floor = floor_ms(24 * batch * hidden * 2)
    base = {"floor": "pointwise bytes only (fwd 11 + bwd 13 elems of B*H)",
            "gemm_floor_ms": 1e3 * gemm_flops / GEMM_FLOPS}
    extra = dict(base, measures="eager module call + autograd.grad, wall time per call of a 200-call loop "
                 "(common.loop_ms, best of 3 interleaved rounds): host-bound on both sides")
    results = [Result(f"lstm cell fwd+bwd bf16 {batch}x{hidden} vs nn.LSTMCell", t["ours"], t["ref"], floor, extra)]
    results += _graph_rows(f"lstm cell fwd+bwd bf16 {batch}x{hidden}", steps, sets, rep,
                           floor, base, results[0])
    return results


def _graph_rows(name, steps, sets, rep_ms, floor, extra, eager, min_steps=4):
    """The same fwd+bwd of ours and torch's, CUDA-graph captured and replayed (GPU time, no host):
    a row only when both captured, else the reason goes into the eager row's extra."""
    g = {k: step_ms(s, sets, rep_ms=rep_ms, min_steps=min_steps) for k, s in steps.items()}
    methods = {k: m for k, (_, m) in g.items()}
    if not all(m.startswith("graph") for m in methods.values()):
        eager.extra["cuda_graph"] = f"not reported: capture failed ({methods})"
        return []
    return [Result(f"{name} [CUDA graph: GPU time]", g["ours"][0], g["ref"][0], floor,
                   dict(extra, measures="CUDA-graph replay: GPU work + launch gaps, no host", timing=methods["ours"]))]


def _pointwise_case(batch: int, hidden: int, quick: bool) -> list[Result]:
    from mptrain.ops.build import get_extension

    ext = get_extension(required=True)
    H4 = 4 * hidden

    def make():  # input gates, hidden gates, c, dh, dc
        return [torch.randn(batch, n, device="cuda", dtype=BF16) for n in (H4, H4, hidden, hidden, hidden)]

    rot = itertools.cycle(input_sets(make, 11 * batch * hidden * 2))

    def ours():
        ig, hg, c, dh, dc = next(rot)
        h1, c1, ws = ext.lstm_cell_pointwise_forward(ig, hg, c, None, None)
        return ext.lstm_cell_pointwise_backward(dh, None, dc, c, c1, ws)

    def theirs():
        ig, hg, c, dh, dc = next(rot)
        ig, hg = ig.detach().requires_grad_(), hg.detach().requires_grad_()
        hy, cy, _ = compat.thnn_fused_lstm_cell(ig, hg, c)
        return torch.autograd.grad((hy, cy), (ig, hg), (dh, dc))

    rep = 50 if quick else 200
    torch_ms = median_ms(theirs, rep_ms=rep)  # timed before ours, as this row always was
    return [Result(f"lstm pointwise fwd+bwd bf16 {batch}x{hidden} (torch fused)", median_ms(ours, rep_ms=rep),
                   torch_ms, floor_ms(28 * batch * hidden * 2),
                   {"floor": "fwd reads 2 gate tensors + c, writes h, c, 4H workspace; bwd 13 elems of B*H"})]


def _sequence_cases(quick: bool) -> list[Result]:
    T, B, H, L = (32 if quick else 128), 64, 1024, 2
    torch.manual_seed(0)
    ref = nn.LSTM(H, H, num_layers=L, device="cuda", dtype=BF16)
    auto, fused = [FusedLSTM(H, H, num_layers=L, device="cuda", dtype=BF16, impl=i) for i in ("auto", "fused")]
    for m in (auto, fused):
        m.load_state_dict(ref.state_dict())
    ref_cells = [nn.LSTMCell(H, H, device="cuda", dtype=BF16) for _ in range(L)]
    our_cells = [FusedLSTMCell(H, H, device="cuda", dtype=BF16, fused=True) for _ in range(L)]
    for k in range(L):  # the cells of a loop get the weights of nn.LSTM's layer k
        layer = {name: getattr(ref, f"{name}_l{k}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
        ref_cells[k].load_state_dict(layer)
        our_cells[k].load_state_dict(layer)

    sets = [torch.randn(T, B, H, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3)]
    rot = itertools.cycle(sets)
    cot = torch.randn(T, B, H, device="cuda", dtype=BF16) * 1e-2

    def seq(module):
        params = list(module.parameters())

        def fn():
            x = next(rot)
            out, _ = module(x)
            return torch.autograd.grad(out, [x] + params, cot)

        return fn

    def cell_loop(cells):
        params = [p for c in cells for p in c.parameters()]

        def fn(x=None):
            x = next(rot) if x is None else x
            layer_in = x.unbind(0)
            for cell in cells:
                h = c = torch.zeros(B, H, device="cuda", dtype=BF16)
                outs = []
                for xt in layer_in:
                    h, c = cell(xt, (h, c))
                    outs.append(h)
                layer_in = outs
            return torch.autograd.grad(torch.stack(layer_in), [x] + params, cot)

        return fn

    loops = {"ref": cell_loop(ref_cells), "ours": cell_loop(our_cells)}
    t = _timed({"cudnn": seq(ref), "auto": seq(auto), "fused": seq(fused), "ref_loop": loops["ref"],
                "our_loop": loops["ours"]}, rep_ms=100 if quick else 400)
    tag = f"{L}x{H} T={T} B={B} bf16"
    probe = torch.zeros(1, 1, H, device="cuda", dtype=BF16)
    loop_row = Result(f"FusedLSTMCell loop {tag} vs LSTMCell loop", t["our_loop"], t["ref_loop"], None,
                      {"measures": f"eager: {L}x{T} module calls + one autograd.grad; host-bound (both sides)"})
    return [
        Result(f"FusedLSTM auto ({auto.resolved_impl(probe)}) {tag} vs nn.LSTM", t["auto"], t["cudnn"], None,
               {"note": "same cuDNN call; FusedLSTM flattens bf16 weights, bf16 nn.LSTM copies them per call"}),
        Result(f"FusedLSTM fused {tag} vs nn.LSTM", t["fused"], t["cudnn"], None),
        loop_row,
    ] + _graph_rows(f"FusedLSTMCell loop {tag}", loops, sets[:1], 100 if quick else 400,
                    None, {}, loop_row, min_steps=1)


def run(args) -> list[Result]:
    from mptrain.ops.build import extension_status, get_extension

    if get_extension(required=False) is None:
        raise RuntimeError(f"LSTM benchmarks: the mptrain extension did not load: {extension_status().describe()}")
    results = [r for batch in (256, 1024) for r in _cell_case(batch, 1024, args.quick)]
    results += [r for batch in (256, 1024) for r in _pointwise_case(batch, 1024, args.quick)]
    return results + _sequence_cases(args.quick)
