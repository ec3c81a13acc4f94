"""Lab: the split LayerNorm backward taken apart, and finish variants, against the shipped kernel.

Builds dev/cuda/ln_bwd.cu (which compiles csrc/layer_norm.cu into the same extension), checks
every kind against the shipped backward (dx bitwise; dgamma / dbeta close, and equal between two
backwards over one counter), then graph-times the backward alone and the forward + backward pair
as mptrain.bench.cases_norm does: % of the bandwidth floor (6 B/elem backward, 10 B/elem pair).
Kinds (dev/cuda/ln_bwd.cu): 1 the lab copy of the shipped kernel, 2 no finish, 3 no partials
either (loop + dx alone), 4 one-round finish loads, 5/6/7 cluster reductions of 2/4/8 blocks.

    python3 dev/cuda/ln_bwd_bench.py [--shapes 16384x1024,65536x768] [--kinds 1,2,3,4,5,6,7] [--rep 200]
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

from mptrain.bench.common import floor_ms
from mptrain.bench.graph_timing import step_ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ln_tma_bench  # noqa: E402  (dev/cuda: the lab's build and input sets)
from ln_tma_bench import sets_for  # noqa: E402

NAMES = {1: "lab = shipped (fold, U=8)", 2: "no finish (partials only)", 3: "loop + dx only",
         4: "fold, one-round loads (U=16)", 5: "cluster 2 + fold", 6: "cluster 4 + fold", 7: "cluster 8 + fold"}
FINISHED = (1, 4, 5, 6, 7)


def build():
    return ln_tma_bench.build("ln_bwd_lab", "dev/cuda/ln_bwd.cu", "LN_BWD_BUILD")


def line(name, ms, elem_bytes, rows, hidden, base=None):
    fl = floor_ms(elem_bytes * rows * hidden)
    extra = f"  {1e3 * (ms - base):+6.1f} us vs shipped" if base else ""
    print(f"{name:44s} {ms * 1e3:8.1f} us  {100 * fl / ms:5.1f}% of floor{extra}", flush=True)


def check(ext, s, kind, hidden):
    x, w, b, dy = s
    y0, m0, r0, wk0 = ext.shipped_fwd(x, w, b, hidden, 1e-5, False)
    dx0, dg0, db0 = ext.shipped_bwd(dy, x, m0, r0, w, b, hidden, False, wk0)
    _, _, _, wk1 = ext.shipped_fwd(x, w, b, hidden, 1e-5, False)
    dx1, dg1, db1, grid = ext.bwd(dy, x, m0, r0, w, wk1, kind)
    assert torch.equal(dx1, dx0), "dx differs from the shipped kernel's"
    out = {"grid": int(grid.item())}
    if kind in FINISHED:
        torch.testing.assert_close(dg1.float(), dg0.float(), rtol=1e-2, atol=1e-2 * dg0.float().abs().max().item())
        torch.testing.assert_close(db1.float(), db0.float(), rtol=1e-2, atol=1e-2 * db0.float().abs().max().item())
        out["max |d dgamma|"] = (dg1.float() - dg0.float()).abs().max().item()
        dx2, dg2, db2, _ = ext.bwd(dy, x, m0, r0, w, wk1, kind)  # a second backward over the same counter
        assert torch.equal(dg2, dg1) and torch.equal(db2, db1), "second backward over one counter differs"
    return out


def run_shape(ext, rows, hidden, kinds, rep):
    print(f"\n== {rows}x{hidden} bf16", flush=True)
    sets = sets_for(rows, hidden)
    ok = []
    for k in kinds:
        try:
            print(f"check kind {k} ({NAMES[k]}): {check(ext, sets[0], k, hidden)}", flush=True)
            ok.append(k)
        except Exception:  # noqa: BLE001
            print(f"kind {k} FAILED\n{traceback.format_exc()}", flush=True)
    torch.cuda.synchronize()
    stats = [ext.shipped_fwd(s[0], s[1], s[2], hidden, 1e-5, False) for s in sets]
    idx = list(range(len(sets)))

    def shipped_bwd(i):
        s, st = sets[i], stats[i]
        return ext.shipped_bwd(s[3], s[0], st[1], st[2], s[1], s[2], hidden, False, st[3])

    with torch.no_grad():
        ms, _ = step_ms(lambda s: torch.add(s[0], s[3]), sets, rep)
    line("torch x + dy", ms, 6, rows, hidden)
    base, _ = step_ms(shipped_bwd, idx, rep)
    line("bwd shipped", base, 6, rows, hidden)
    for k in ok:
        ms, _ = step_ms(lambda i, k=k: ext.bwd(sets[i][3], sets[i][0], stats[i][1], stats[i][2], sets[i][1],
                                               stats[i][3], k), idx, rep)
        line(f"bwd {k}: {NAMES[k]}", ms, 6, rows, hidden, base)

    def pair(s, k=None):
        x, w, b, dy = s
        _, m, r, wk = ext.shipped_fwd(x, w, b, hidden, 1e-5, False)
        if k is None:
            return ext.shipped_bwd(dy, x, m, r, w, b, hidden, False, wk)
        return ext.bwd(dy, x, m, r, w, wk, k)

    base2, _ = step_ms(pair, sets, rep)
    line("fwd+bwd shipped", base2, 10, rows, hidden)
    for k in ok:
        if k in FINISHED:
            ms, _ = step_ms(lambda s, k=k: pair(s, k), sets, rep)
            line(f"fwd+bwd {k}: {NAMES[k]}", ms, 10, rows, hidden, base2)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="16384x1024,65536x768")
    p.add_argument("--kinds", default="1,2,3,4,5,6,7")
    p.add_argument("--rep", type=float, default=200.0)
    a = p.parse_args()
    ext = build()
    kinds = [int(k) for k in a.kinds.split(",") if k]
    for shape in a.shapes.split(","):
        rows, hidden = (int(v) for v in shape.split("x"))
        run_shape(ext, rows, hidden, kinds, a.rep)


if __name__ == "__main__":
    main()
