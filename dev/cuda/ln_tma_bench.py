"""Lab: the TMA-fed LayerNorm kernels of dev/cuda/ln_tma.cu against the shipped ones, same process.

Builds dev/cuda/ln_tma.cu (which compiles csrc/layer_norm.cu into the same extension, so the
shipped kernels are the baseline without the full mptrain build), checks every config against the
shipped op (y, mean, rstd bitwise where the arithmetic is the same; dx, dgamma, dbeta close), then
graph-times forward, backward and the forward + backward pair, with the calibration row (torch's
clone + add) as mptrain.bench.cases_norm does: % of the bandwidth floor, DESIGN §5.

    python3 dev/cuda/ln_tma_bench.py [--shapes 16384x1024,65536x768] [--fwd-cfgs 0,1,2,3,4,5] [--bwd-cfgs 0,1,2,3,4,5]
"""
from __future__ import annotations

import argparse
import os
import time
import traceback
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from mptrain.bench.common import floor_ms, input_sets
from mptrain.bench.graph_timing import step_ms

ROOT = Path(__file__).resolve().parents[2]


def build(name="ln_tma", source="dev/cuda/ln_tma.cu", build_env="LN_TMA_BUILD"):
    """The lab extension ``name`` from ``source`` (which includes csrc/layer_norm.cu), with mptrain's own
    build flags (its include fixes, -O3, the arch list), in the directory $``build_env`` if set."""
    from mptrain.ops.build import _all_flags, find_cuda_home

    cflags, cuda_flags = _all_flags(find_cuda_home())
    if os.environ.get("LN_TMA_PTXAS"):
        cuda_flags = cuda_flags + ["-Xptxas=-v"]
    t = time.perf_counter()
    ext = load(name=name, sources=[str(ROOT / source)], extra_include_paths=[str(ROOT / "csrc")],
               extra_cflags=cflags, extra_cuda_cflags=cuda_flags,
               build_directory=os.environ.get(build_env) or None, verbose=False)
    print(f"build {time.perf_counter() - t:.1f} s", flush=True)
    return ext


def sets_for(rows, hidden):
    g = torch.Generator(device="cuda").manual_seed(rows + hidden)

    def make():
        x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
        w = (torch.randn(hidden, device="cuda", generator=g) * 0.1 + 1).bfloat16()
        b = torch.randn(hidden, device="cuda", generator=g).bfloat16()
        dy = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
        return x, w, b, dy

    return input_sets(make, 4 * rows * hidden * 2)


def line(name, ms, elem_bytes, rows, hidden, base=None):
    fl = floor_ms(elem_bytes * rows * hidden)
    extra = f"  vs shipped {base / ms:.3f}x" if base else ""
    print(f"{name:44s} {ms * 1e3:8.1f} us  {100 * fl / ms:5.1f}% of floor{extra}", flush=True)


def check(ext, s, fcfg, bcfg, hidden):
    x, w, b, dy = s
    y0, m0, r0, wk0 = ext.shipped_fwd(x, w, b, hidden, 1e-5, False)
    dx0, dg0, db0 = ext.shipped_bwd(dy, x, m0, r0, w, b, hidden, False, wk0)
    out = {}
    if fcfg is not None:
        y1, m1, r1, _ = ext.fwd(x, w, b, 1e-5, fcfg)
        out["fwd"] = [(y1 - y0).abs().max().item(), (m1 - m0).abs().max().item(), (r1 - r0).abs().max().item()]
        torch.testing.assert_close(y1.float(), y0.float(), rtol=1e-2, atol=2e-2)
        torch.testing.assert_close(r1, r0, rtol=1e-5, atol=0)
    if bcfg is not None:
        _, _, _, wk1 = ext.fwd(x, w, b, 1e-5, 0)
        dx1, dg1, db1 = ext.bwd(dy, x, m0, r0, w, wk1, bcfg)
        out["bwd"] = [(dx1 - dx0).abs().max().item(), (dg1.float() - dg0.float()).abs().max().item(),
                      (db1.float() - db0.float()).abs().max().item()]
        torch.testing.assert_close(dx1.float(), dx0.float(), rtol=1e-2, atol=2e-2)
        torch.testing.assert_close(dg1.float(), dg0.float(), rtol=1e-2, atol=1e-2 * dg0.float().abs().max().item())
        torch.testing.assert_close(db1.float(), db0.float(), rtol=1e-2, atol=1e-2 * db0.float().abs().max().item())
        # a second backward over the same counter (retain_graph) must finish again
        dx2, dg2, db2 = ext.bwd(dy, x, m0, r0, w, wk1, bcfg)
        assert torch.equal(dg2, dg1) and torch.equal(db2, db1), "second backward over one counter differs"
    return out


def run_shape(ext, rows, hidden, fcfgs, bcfgs, rep):
    print(f"\n== {rows}x{hidden} bf16", flush=True)
    sets = sets_for(rows, hidden)
    for c in fcfgs:
        try:
            print(f"check fwd cfg {c}: {check(ext, sets[0], c, None, hidden)}", flush=True)
        except Exception:  # noqa: BLE001
            print(f"fwd cfg {c} FAILED\n{traceback.format_exc()}", flush=True)
            fcfgs = [f for f in fcfgs if f != c]
    for c in bcfgs:
        try:
            print(f"check bwd cfg {c}: {check(ext, sets[0], None, c, hidden)}", flush=True)
        except Exception:  # noqa: BLE001
            print(f"bwd cfg {c} FAILED\n{traceback.format_exc()}", flush=True)
            bcfgs = [f for f in bcfgs if f != c]
    torch.cuda.synchronize()

    @torch.no_grad()
    def calib(s):
        x, _, _, dy = s
        return x.clone(), torch.add(x, dy)

    ms, _ = step_ms(calib, sets, rep)
    line("calibration clone + add", ms, 10, rows, hidden)
    fwd0, _ = step_ms(lambda s: ext.shipped_fwd(s[0], s[1], s[2], hidden, 1e-5, False), sets, rep)
    line("fwd shipped", fwd0, 4, rows, hidden)
    for c in fcfgs:
        ms, _ = step_ms(lambda s, c=c: ext.fwd(s[0], s[1], s[2], 1e-5, c), sets, rep)
        line(f"fwd tma cfg {c}", ms, 4, rows, hidden, fwd0)
    shipped_stats = [ext.shipped_fwd(s[0], s[1], s[2], hidden, 1e-5, False) for s in sets]
    tma_stats = [ext.fwd(s[0], s[1], s[2], 1e-5, 0) for s in sets]
    idx = list(range(len(sets)))
    bwd0, _ = step_ms(lambda i: ext.shipped_bwd(sets[i][3], sets[i][0], shipped_stats[i][1], shipped_stats[i][2],
                                                sets[i][1], sets[i][2], hidden, False, shipped_stats[i][3]), idx, rep)
    line("bwd shipped", bwd0, 6, rows, hidden)
    for c in bcfgs:
        ms, _ = step_ms(lambda i, c=c: ext.bwd(sets[i][3], sets[i][0], tma_stats[i][1], tma_stats[i][2], sets[i][1],
                                               tma_stats[i][3], c), idx, rep)
        line(f"bwd tma cfg {c}", ms, 6, rows, hidden, bwd0)

    def shipped_pair(s):
        x, w, b, dy = s
        _, m, r, wk = ext.shipped_fwd(x, w, b, hidden, 1e-5, False)
        return ext.shipped_bwd(dy, x, m, r, w, b, hidden, False, wk)

    pair0, _ = step_ms(shipped_pair, sets, rep)
    line("fwd+bwd shipped", pair0, 10, rows, hidden)
    for fc in fcfgs:
        for bc in bcfgs:
            def pair(s, fc=fc, bc=bc):
                x, w, b, dy = s
                _, m, r, wk = ext.fwd(x, w, b, 1e-5, fc)
                return ext.bwd(dy, x, m, r, w, wk, bc)

            ms, _ = step_ms(pair, sets, rep)
            line(f"fwd+bwd tma fwd {fc} bwd {bc}", ms, 10, rows, hidden, pair0)


def run_diag(ext, rows, hidden, rep):
    """The forward's pattern without its arithmetic (copy_rows), the shipped forward kernel with and
    without the PDL attribute, and torch's streaming kernels one at a time: where the fixed cost is."""
    print(f"\n== diagnostic {rows}x{hidden} bf16 (4 B/elem unless noted)", flush=True)
    sets = sets_for(rows, hidden)
    names = {0: "copy_rows R=2 BLOCK=128 (the forward's layout)", 1: "copy_rows R=1 BLOCK=128",
             2: "copy_rows R=2 BLOCK=256", 3: "copy_rows R=4 BLOCK=128", 4: "shipped ln_fwd_kernel R=2 BLOCK=128"}
    y = ext.diag(sets[0][0], sets[0][1], sets[0][2], 0, True)
    assert torch.equal(y, sets[0][0]), "copy_rows does not copy"
    for kind, name in names.items():
        for pdl in (True, False):
            ms, _ = step_ms(lambda s, k=kind, p=pdl: ext.diag(s[0], s[1], s[2], k, p), sets, rep)
            line(f"{name} pdl={int(pdl)}", ms, 4, rows, hidden)
    with torch.no_grad():
        ms, _ = step_ms(lambda s: s[0].clone(), sets, rep)
        line("torch clone", ms, 4, rows, hidden)
        ms, _ = step_ms(lambda s: s[0] * 2, sets, rep)
        line("torch x * 2", ms, 4, rows, hidden)
        ms, _ = step_ms(lambda s: torch.add(s[0], s[3]), sets, rep)
        line("torch x + dy [6 B/elem]", ms, 6, rows, hidden)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="16384x1024,65536x768")
    p.add_argument("--fwd-cfgs", default="0,1,2,3,4,5")
    p.add_argument("--bwd-cfgs", default="0,1,2,3,4,5")
    p.add_argument("--rep", type=float, default=100.0)
    p.add_argument("--diag", action="store_true", help="only the 16384x1024 pattern diagnostic")
    a = p.parse_args()
    ext = build()
    if a.diag:
        run_diag(ext, 16384, 1024, a.rep)
        return
    for shape in a.shapes.split(","):
        rows, hidden = (int(v) for v in shape.split("x"))
        run_shape(ext, rows, hidden, [int(c) for c in a.fwd_cfgs.split(",") if c],
                  [int(c) for c in a.bwd_cfgs.split(",") if c], a.rep)


if __name__ == "__main__":
    main()
