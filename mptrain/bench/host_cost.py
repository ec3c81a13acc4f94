"""Host cost of one eager call: mptrain's ops against torch's nearest native op.

Per op and shape, fwd and fwd+bwd: wall time per call of a loop of N calls after a warm-up (one
sync at the end); ours, torch's and the reference's loops take turns, the fastest of five rounds
each.  At the tiny shape the GPU work is negligible, so it is the host time a host-bound step pays
per call; at the benchmark shapes, the eager wall time.  Pairs (ours / torch): ``ops.layer_norm`` /
``F.layer_norm``, ``ops.rms_norm`` / ``F.rms_norm``, ``ops.scaled_masked_softmax(x, mask)`` /
``torch.softmax(x.masked_fill(mask, -inf), -1)``, ``FusedLSTMCell`` / ``nn.LSTMCell`` (same
weights), ``ops.max_pool2d`` / ``F.max_pool2d`` (3x3/2, channels_last input).  Targets:
ratio <= 1.1 tiny, <= 1.0 at the benchmark shapes; the last column is ours with ``fused=False``
(the reference).  Printed after the table: ``autograd.grad``'s fixed cost on this host (one leaf, one op).
On the CPU only the tiny shapes run, in fp32: ours is the op's Python CPU kernel behind the
dispatcher, so "ours - reference" is the custom-op path's own cost (the CUDA path needs a GPU).

``python -m mptrain.bench.host_cost [--device cuda|cpu] [--quick] [--iters N] [--json PATH]``
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from mptrain import ops
from mptrain.bench.common import bench_parser, write_json

TINY = "tiny"
BENCH = "bench"


@dataclass
class Row:
    op: str
    shape: str
    kind: str  # "tiny" or "bench"
    pass_: str  # "fwd" or "fwd+bwd"
    ours_us: float
    torch_us: float
    reference_us: float  # ours with fused=False: the pure-PyTorch reference called directly

    @property
    def ratio(self) -> float:
        return self.ours_us / self.torch_us


def per_call_us(fns: Sequence[Callable[[], object]], iters: int, sync: Callable[[], None],
                repeats: int = 5) -> list[float]:
    """Wall time of one call of each of ``fns`` in microseconds: warm-up, then ``repeats`` rounds in
    which each fn in turn runs a loop of ``iters // repeats`` calls ended by one sync (a, b, a, b, ...),
    so that the host's drift over the measurement moves every side of a ratio alike; each fn's fastest
    loop counts (a busy machine only ever adds time)."""
    for fn in fns:
        for _ in range(max(3, iters // 10)):
            fn()
    sync()
    n = max(1, iters // repeats)
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [b / n * 1e6 for b in best]


def _fwd_bwd(forward, dy, leaves):
    """Forward, then every leaf's gradient (autograd.grad: no accumulation into .grad)."""
    return lambda: torch.autograd.grad(forward(), leaves, dy)


# the pairs: builders of (ours, torch, leaves)


def _norm_pair(rms, rows, hidden, dtype, device, fused):
    x = torch.randn(rows, hidden, dtype=dtype, device=device, requires_grad=True)
    w = torch.ones(hidden, dtype=dtype, device=device, requires_grad=True)
    if rms:
        return (lambda: ops.rms_norm(x, (hidden,), w, fused=fused)), (lambda: F.rms_norm(x, (hidden,), w)), [x, w]
    b = torch.zeros(hidden, dtype=dtype, device=device, requires_grad=True)
    return ((lambda: ops.layer_norm(x, (hidden,), w, b, fused=fused)), (lambda: F.layer_norm(x, (hidden,), w, b)),
            [x, w, b])


def _softmax_pair(batch, heads, s, dtype, device, fused):
    x = torch.randn(batch, heads, s, s, dtype=dtype, device=device, requires_grad=True)
    mask = torch.rand(batch, 1, s, s, device=device) < 0.1
    return ((lambda: ops.scaled_masked_softmax(x, mask, fused=fused)),
            (lambda: torch.softmax(x.masked_fill(mask, float("-inf")), -1)), [x])


def _pool_pair(batch, channels, side, dtype, device, fused):
    x = torch.randn(batch, channels, side, side, dtype=dtype, device=device)
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    return (lambda: ops.max_pool2d(x, 3, 2, 1, fused=fused)), (lambda: F.max_pool2d(x, 3, 2, 1)), [x]


def _lstm_pair(batch, hidden, dtype, device, fused):
    from mptrain.nn import FusedLSTMCell

    ref = torch.nn.LSTMCell(hidden, hidden, device=device, dtype=dtype)
    ours = FusedLSTMCell.from_module(ref, fused=fused)
    x, h, c = [torch.randn(batch, hidden, dtype=dtype, device=device, requires_grad=True) for _ in range(3)]
    # The modules share their Parameter objects: one set of leaves for both.
    return (lambda: ours(x, (h, c))[0]), (lambda: ref(x, (h, c))[0]), [x, h, c, *ref.parameters()]


def cases(device: str, quick: bool):
    """(op, shape label, kind, builder) for this device: tiny shapes always, benchmark shapes on CUDA
    unless ``quick``."""
    tiny_dt = torch.bfloat16 if device == "cuda" else torch.float32
    out = [
        ("layer_norm", "4x256", TINY, lambda f: _norm_pair(False, 4, 256, tiny_dt, device, f)),
        ("rms_norm", "4x256", TINY, lambda f: _norm_pair(True, 4, 256, tiny_dt, device, f)),
        ("scaled_masked_softmax", "1x2x8x8", TINY, lambda f: _softmax_pair(1, 2, 8, tiny_dt, device, f)),
        ("lstm_cell", "4x32", TINY, lambda f: _lstm_pair(4, 32, tiny_dt, device, f)),
        ("max_pool2d", "2x8x8x8 cl", TINY, lambda f: _pool_pair(2, 8, 8, tiny_dt, device, f)),
    ]
    if device == "cuda" and not quick:
        bf = torch.bfloat16
        out += [
            ("layer_norm", "16384x1024 bf16", BENCH, lambda f: _norm_pair(False, 16384, 1024, bf, device, f)),
            ("rms_norm", "16384x1024 bf16", BENCH, lambda f: _norm_pair(True, 16384, 1024, bf, device, f)),
            ("scaled_masked_softmax", "32x16x512x512 bf16", BENCH, lambda f: _softmax_pair(32, 16, 512, bf, device, f)),
            ("lstm_cell", "256x1024 bf16", BENCH, lambda f: _lstm_pair(256, 1024, bf, device, f)),
            ("lstm_cell", "1024x1024 bf16", BENCH, lambda f: _lstm_pair(1024, 1024, bf, device, f)),
            ("max_pool2d", "256x64x112x112 fp16 cl", BENCH,
             lambda f: _pool_pair(256, 64, 112, torch.float16, device, f)),
        ]
    return out


def calls_per_loop(iters: Optional[int], quick: bool, kind: str) -> int:
    """Calls per timing loop: ``iters`` if given, else 1000 at a tiny shape and 50 at a benchmark one
    (20 in a quick run)."""
    return iters or (20 if quick else (1000 if kind == TINY else 50))


def engine_us(device: str, iters: int) -> float:
    """``autograd.grad`` of one pointwise op on one leaf, µs per call: the engine's fixed cost, which both
    sides of every fwd+bwd row pay.  It differs by tens of µs between hosts of one kind, so it is printed
    with the table: the scale against which the fwd+bwd rows' differences are read."""
    x = torch.randn(4, 256, device=device, requires_grad=True)
    dy = torch.ones_like(x)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return per_call_us([lambda: torch.autograd.grad(x * 2, [x], dy)], iters, sync)[0]


def run(device: str = "cuda", quick: bool = False, iters: Optional[int] = None) -> list[Row]:
    """Measure every case; ``fused=True`` on CUDA (a missing kernel raises rather than timing the
    reference), ``"auto"`` on the CPU (the op's CPU kernel)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("host_cost --device cuda: no CUDA device here; use --device cpu")
    fused = True if device == "cuda" else "auto"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    threads = torch.get_num_threads()
    if device == "cpu":  # host work is one thread's; intra-op threads only add sync noise at tiny shapes
        torch.set_num_threads(1)
    rows = []
    try:
        for op, shape, kind, build in cases(device, quick):
            n = calls_per_loop(iters, quick, kind)
            ours, ref, leaves = build(fused)
            plain, _, plain_leaves = build(False)
            dy = torch.ones_like(ref())
            torch.testing.assert_close(ours().float(), ref().float(), atol=2e-2, rtol=2e-2)  # same computation
            bwd = [_fwd_bwd(ours, dy, leaves), _fwd_bwd(ref, dy, leaves), _fwd_bwd(plain, dy, plain_leaves)]
            for pass_, fns in (("fwd", (ours, ref, plain)), ("fwd+bwd", bwd)):
                rows.append(Row(op, shape, kind, pass_, *per_call_us(fns, n, sync)))
            del ours, ref, plain, dy, leaves, plain_leaves, bwd, fns
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(threads)
    return rows


def format_table(rows: list[Row]) -> str:
    head = (f"{'op':<22} {'shape':<20} {'pass':<8} {'ours us':>10} {'torch us':>10} {'ratio':>7}  {'target':<10}"
            f" {'reference us':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        target = 1.1 if r.kind == TINY else 1.0
        flag = "ok" if r.ratio <= target else "MISS"
        lines.append(f"{r.op:<22} {r.shape:<20} {r.pass_:<8} {r.ours_us:>10.1f} {r.torch_us:>10.1f} {r.ratio:>7.2f}"
                     f"  {'<=' + str(target) + ' ' + flag:<10} {r.reference_us:>12.1f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = bench_parser("host_cost", __doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes only, few iterations (a smoke run)")
    p.add_argument("--iters", type=int, default=None, help="calls per timing loop (default 1000 tiny, 50 bench)")
    p.add_argument("--json", default="host_cost.json", help="where to write the rows (default: %(default)s)")
    a = p.parse_args(argv)
    rows = run(a.device, a.quick, a.iters)
    engine = engine_us(a.device, calls_per_loop(a.iters, a.quick, TINY))  # a tiny op
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"host cost per eager call, {device}, torch {torch.__version__}, extension {ops.extension_status()}")
    print(format_table(rows))
    print(f"autograd.grad of x * 2 (one leaf): {engine:.1f} us per call, the engine's fixed cost in every fwd+bwd row")
    command = " ".join(["python -m mptrain.bench.host_cost"] + (argv or sys.argv[1:]))
    write_json(a.json, {"meta": {"device": device, "torch": torch.__version__, "command": command,
                                 "engine_us": engine},
                        "rows": [dict(asdict(r), ratio=r.ratio) for r in rows]}, indent=1)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
