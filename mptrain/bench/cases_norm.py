"""LayerNorm / RMSNorm benchmark cases: the shipped kernels vs torch eager, both sides as GPU work
(steps captured in one CUDA graph: graph_timing.py).

Floor (DESIGN §5), bf16: forward reads x, writes y (4 B/elem); backward reads x, dy, writes dx
(6 B/elem); params and statistics are small and not counted.  Rows per shape: ``fwd+bwd`` (the
target) for bf16-weight and fp32-weight (``*-master``) LayerNorm and RMSNorm; ``fwd`` and ``bwd``
alone for bf16-weight LayerNorm, ``bwd`` calling both backward entry points on saved statistics.
A calibration row per shape times torch's own streaming kernels moving the same 10 B/elem in two
launches (``clone(x)``, then ``x + dy``) through the same graph timing: the % of the floor that a
plain copy pair reaches in this harness, the practical ceiling of a forward + backward pair.
"""
from __future__ import annotations

import traceback

import torch
import torch.nn.functional as F

from mptrain import ops
from mptrain.bench.common import Result, floor_ms, input_sets
from mptrain.bench.graph_timing import step_ms

# (rows, hidden): the shapes of the published norm rows (docs/kernels/norm.md); all bf16.
CASES = [(16384, 1024), (16384, 4096), (65536, 768)]
QUICK_CASES = [(16384, 1024)]


def _fwd_bwd(norm, inputs):
    x, w, b, dy = inputs
    return torch.autograd.grad(norm(x, w, b), (x, w) if b is None else (x, w, b), dy)


@torch.no_grad()
def _fwd(norm, inputs):
    return norm(*inputs[:3])


def _check(got, expected):
    """Never time a broken kernel: ours against torch on the first input set (tensors or sequences)."""
    if isinstance(got, torch.Tensor):
        got, expected = [got], [expected]
    for a, t in zip(got, expected):
        torch.testing.assert_close(a.float(), t.float(), rtol=3e-2, atol=3e-2 * max(1.0, t.abs().max().item()))


def _norms(kind, hidden):
    shape = (hidden,)
    if kind == "rms":
        ours = lambda x, w, b: ops.rms_norm(x, shape, w, 1e-6, fused=True)  # noqa: E731
        theirs = lambda x, w, b: F.rms_norm(x, shape, w.to(x.dtype), 1e-6)  # noqa: E731
    else:
        ours = lambda x, w, b: ops.layer_norm(x, shape, w, b, 1e-5, fused=True)  # noqa: E731
        theirs = lambda x, w, b: F.layer_norm(x, shape, w.to(x.dtype), b.to(x.dtype), 1e-5)  # noqa: E731
    return ours, theirs


def _make_sets(rows, hidden, kind, wdtype):
    dt = torch.bfloat16
    # A private generator: a failed graph capture elsewhere can leave the default CUDA
    # generator marked as capturing, and every later torch.randn would then raise.
    g = torch.Generator(device="cuda").manual_seed(rows * 7919 + hidden)

    def rand(*size, dtype=torch.float32):
        return torch.randn(*size, device="cuda", dtype=dtype, generator=g)

    def make():
        x = rand(rows, hidden, dtype=dt).requires_grad_()
        w = (rand(hidden) * 0.1 + 1).to(wdtype).requires_grad_()
        b = None if kind == "rms" else rand(hidden).to(wdtype).requires_grad_()
        return x, w, b, rand(rows, hidden, dtype=dt)

    return input_sets(make, 4 * rows * hidden * dt.itemsize)


def _case_name(kind, wdtype, what, rows, hidden):
    wname = "fp32 w" if wdtype == torch.float32 else "bf16 w"
    return f"{'RMSNorm' if kind == 'rms' else 'LayerNorm'} {what} bf16 ({wname}) {rows}x{hidden}"


def _autograd_rows(rows, hidden, kind, wdtype, rep, what="fwd+bwd") -> list[Result]:
    """``what`` = "fwd+bwd" (10 B/elem) or "fwd" alone (4 B/elem, no grad), ours against torch."""
    sets = _make_sets(rows, hidden, kind, wdtype)
    ours, theirs = _norms(kind, hidden)
    do, elem_bytes = (_fwd_bwd, 10) if what == "fwd+bwd" else (_fwd, 4)
    expected = do(theirs, sets[0])
    # torch's LayerNorm needs the weights in x's dtype: the fp32-weight case times its casts
    # too, which is what a *-master model would have to do without the fused kernel.
    torch_timed = step_ms(lambda s: do(theirs, s), sets, rep)
    name = _case_name(kind, wdtype, what, rows, hidden) + ("" if what == "fwd+bwd" else " [4 B/elem]")
    return _row(name, lambda s: do(ours, s), sets, expected, torch_timed, rows, hidden, elem_bytes, what, rep)


def _row(name, step, inputs, expected, torch_timed, rows, hidden, elem_bytes, what, rep) -> list[Result]:
    """``step`` checked against ``expected`` on the first input set, then graph-timed over ``inputs``:
    one row, or none if the check fails (reported, the other rows go on)."""
    try:
        _check(step(inputs[0]), expected)
        timed = step_ms(step, inputs, rep)
    except Exception:  # noqa: BLE001 - reported, the family goes on
        print(f"[bench norm] {name} FAILED, skipped:\n{traceback.format_exc()}", flush=True)
        torch.cuda.synchronize()
        return []
    (t_ours, how), (t_torch, how_torch) = timed, torch_timed
    return [Result(name, t_ours, t_torch, floor_ms(elem_bytes * rows * hidden),
                   {"rows": rows, "hidden": hidden, "bytes_per_elem": elem_bytes, "pass": what, "timing": how,
                    "timing_torch": how_torch})]


def _bwd_only_rows(rows, hidden, rep) -> list[Result]:
    """The backward ops called directly (the extension's layer_norm_backward, aten's
    native_layer_norm_backward) on statistics of one forward per set: through autograd the backward
    would run on its forward's stream, outside the capture stream, and capture would fail."""
    sets = _make_sets(rows, hidden, "layer", torch.bfloat16)
    ext = ops.get_extension(required=True)
    shape, eps = [hidden], 1e-5
    ours_in, theirs_in = [], []
    with torch.no_grad():
        for x, w, b, dy in sets:
            _, mean, rstd, work = ext.layer_norm_forward(x, w, b, hidden, eps, False)
            ours_in.append((dy, x, mean, rstd, w, b, work))
            wt, bt = w.to(x.dtype), b.to(x.dtype)
            _, tmean, trstd = torch.ops.aten.native_layer_norm(x, shape, wt, bt, eps)
            theirs_in.append((dy, x, tmean, trstd, wt, bt))

    @torch.no_grad()
    def ours(a):
        dy, x, mean, rstd, w, b, work = a
        return ext.layer_norm_backward(dy, x, mean, rstd, w, b, hidden, False, work)

    @torch.no_grad()
    def theirs(a):
        dy, x, mean, rstd, w, b = a
        return torch.ops.aten.native_layer_norm_backward(dy, x, shape, mean, rstd, w, b, [True, True, True])

    expected = theirs(theirs_in[0])
    torch_timed = step_ms(theirs, theirs_in, rep)
    name = _case_name("layer", torch.bfloat16, "bwd", rows, hidden) + " [6 B/elem]"
    return _row(name, ours, ours_in, expected, torch_timed, rows, hidden, 6, "bwd", rep)


def _stream_row(rows, hidden, rep) -> list[Result]:
    """Calibration: torch's copy kernel (4 B/elem, the forward's traffic) then its add kernel (6 B/elem,
    the backward's) on the norm's inputs, graph-timed as the norm rows are; no baseline column."""
    sets = _make_sets(rows, hidden, "layer", torch.bfloat16)

    @torch.no_grad()
    def pair(s):
        x, _, _, dy = s
        return x.clone(), torch.add(x, dy)

    ms, how = step_ms(pair, sets, rep)
    return [Result(f"calibration: torch clone + add bf16 {rows}x{hidden} [10 B/elem]", ms, None,
                   floor_ms(10 * rows * hidden),
                   {"rows": rows, "hidden": hidden, "bytes_per_elem": 10, "pass": "calibration", "timing": how})]


def run(args) -> list[Result]:
    results = []
    cases = QUICK_CASES if args.quick else CASES
    rep = 50.0 if args.quick else 200.0
    for rows, hidden in cases:
        results += _autograd_rows(rows, hidden, "layer", torch.bfloat16, rep)
        results += _autograd_rows(rows, hidden, "layer", torch.bfloat16, rep, what="fwd")
        results += _bwd_only_rows(rows, hidden, rep)
        results += _stream_row(rows, hidden, rep)
    for rows, hidden in cases:
        results += _autograd_rows(rows, hidden, "layer", torch.float32, rep)
        results += _autograd_rows(rows, hidden, "rms", torch.bfloat16, rep)
    return results
