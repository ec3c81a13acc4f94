"""Lab: ResNet's stem max-pool (3x3/2, channels_last) as an opaque op on dev/cuda/maxpool.cu's kernels,
against ATen's kernels and inductor's lowering (not shipped).

Inductor lowers the pool's backward to a kernel that took 1.45 ms of the 34.9 ms ResNet-50 step
(batch 256, 16-master, dev/profile_e2e.py): ~0.6 GB moved at ~0.4 TB/s.  Session 14 replaced the
pool by an opaque op on ATen's kernels and lost 0.9 ms a step (fusions lost, ATen's kernels slow).
This tries an opaque op whose kernels stream: one thread per output (forward) or input (backward)
pixel and 16-byte channel vector.

    python3 dev/cuda/maxpool_bench.py [check] [micro] [e2e --repeat 2]

check: forward bitwise ATen's, window offsets consistent, backward close to ATen's (fp16 / bf16 /
fp32; vector and scalar paths; NaN / inf / ties).  micro: GPU time per call at the stem's shape,
ATen vs lab, forward and backward, % of the bandwidth floor; then BatchNorm + ReLU + pool, forward +
backward, compiled, with inductor's pool vs the lab op.  e2e: `mptrain bench e2e`'s
`mptrain+compile+cuda_graphs:best` (16-master) with the stem conv padded to 4 channels
(dev/stem_conv.py) and inductor's pool vs the lab op, alternating.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CL = torch.channels_last
ext = None


def setup():
    global ext
    from ln_tma_bench import build

    ext = build("mpt_maxpool_lab", "dev/cuda/maxpool.cu", "MAXPOOL_BUILD")

    @torch.library.custom_op("mptrain_lab::max_pool2d", mutates_args=())
    def max_pool2d(x: torch.Tensor, k: int, s: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        y, idx = ext.fwd(x, k, s, p)
        return y, idx

    @max_pool2d.register_fake
    def _(x, k, s, p):
        n, c, h, w = x.shape
        shape = (n, c, (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1)
        return (torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=CL),
                torch.empty(shape, dtype=torch.int8, device=x.device, memory_format=CL))

    @torch.library.custom_op("mptrain_lab::max_pool2d_backward", mutates_args=())
    def max_pool2d_backward(dy: torch.Tensor, idx: torch.Tensor, h: int, w: int, k: int, s: int,
                            p: int) -> torch.Tensor:
        return ext.bwd(dy, idx, h, w, k, s, p)

    @max_pool2d_backward.register_fake
    def _(dy, idx, h, w, k, s, p):
        return torch.empty((dy.shape[0], dy.shape[1], h, w), dtype=dy.dtype, device=dy.device, memory_format=CL)

    def setup_context(ctx, inputs, output):
        x, k, s, p = inputs
        ctx.save_for_backward(output[1])
        ctx.args = (x.shape[2], x.shape[3], k, s, p)

    def backward(ctx, dy, _didx):
        (idx,) = ctx.saved_tensors
        dx = torch.ops.mptrain_lab.max_pool2d_backward(dy.contiguous(memory_format=CL), idx, *ctx.args)
        return dx, None, None, None

    max_pool2d.register_autograd(backward, setup_context=setup_context)


class LabMaxPool2d(nn.Module):
    """nn.MaxPool2d(k, s, p) on the lab kernels for 4-d CUDA input (made channels_last)."""

    def __init__(self, k=3, s=2, p=1):
        super().__init__()
        self.k, self.s, self.p = k, s, p

    def forward(self, x):
        if not x.is_cuda or x.dim() != 4:
            return F.max_pool2d(x, self.k, self.s, self.p)
        return torch.ops.mptrain_lab.max_pool2d(x.contiguous(memory_format=CL), self.k, self.s, self.p)[0]


def gpu_ms(fn, iters=20, rounds=3):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / iters)
    return statistics.median(out)


def check():
    torch.manual_seed(0)
    cases = [((256, 64, 112, 112), torch.float16, (3, 2, 1)), ((8, 64, 57, 55), torch.bfloat16, (3, 2, 1)),
             ((4, 32, 20, 21), torch.float32, (3, 2, 1)), ((4, 3, 17, 16), torch.float16, (3, 2, 1)),
             ((4, 16, 16, 16), torch.float16, (2, 2, 0)), ((4, 16, 15, 15), torch.bfloat16, (3, 1, 1)),
             ((2, 24, 9, 9), torch.float16, (5, 2, 2))]
    bad = 0
    for shape, dtype, (k, s, p) in cases:
        x = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=CL)
        if shape[0] <= 8 and shape[1] >= 4:  # specials: a NaN, an inf, a row of ties, an all -inf channel
            x[0, 0, 1, 1] = float("nan")
            x[0, 1, 2, 2] = float("inf")
            x[1, 2, :4, :4] = 1.0
            x[1, 3] = float("-inf")
        x.requires_grad_()
        ref = F.max_pool2d(x, k, s, p)
        g = torch.randn_like(ref)
        (dref,) = torch.autograd.grad(ref, x, g)
        y = torch.ops.mptrain_lab.max_pool2d(x, k, s, p)[0]
        (dx,) = torch.autograd.grad(y, x, g)
        same_y = torch.equal(torch.nan_to_num(y, 7.0), torch.nan_to_num(ref, 7.0)) and torch.equal(y.isnan(), ref.isnan())
        err = (dx.float() - dref.float()).abs().max().item()
        ok = same_y and err <= 1e-2 * dref.float().abs().max().item()
        bad += not ok
        print(f"check {tuple(shape)} {str(dtype)[6:]} k{k}s{s}p{p}: y bitwise {same_y}, dx bitwise "
              f"{torch.equal(dx, dref)}, max |dx - ATen| {err:.3g} -> {'ok' if ok else 'FAIL'}", flush=True)
    return bad


def micro():
    from mptrain.bench.common import floor_ms

    torch.manual_seed(0)
    shape = (256, 64, 112, 112)
    xs = [torch.randn(shape, device="cuda", dtype=torch.float16).contiguous(memory_format=CL) for _ in range(2)]
    n_in = xs[0].numel()
    n_out = n_in // 4
    for name, pool in (("ATen", lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True)),
                       ("lab", lambda x: torch.ops.mptrain_lab.max_pool2d(x, 3, 2, 1))):
        i = [0]

        def fwd():
            i[0] ^= 1
            return pool(xs[i[0]])
        ms = gpu_ms(fwd)
        idx_bytes = 8 if name == "ATen" else 1
        fl = floor_ms(n_in * 2 + n_out * (2 + idx_bytes))
        print(f"pool fwd {name:<5} {ms:.3f} ms  {100 * fl / ms:.1f}% of floor", flush=True)
        outs = [pool(x) for x in xs]
        dys = [torch.randn_like(o[0]) for o in outs]
        if name == "ATen":
            def bwd():
                i[0] ^= 1
                return torch.ops.aten.max_pool2d_with_indices_backward(dys[i[0]], xs[i[0]], [3, 3], [2, 2], [1, 1],
                                                                      [1, 1], False, outs[i[0]][1])
        else:
            def bwd():
                i[0] ^= 1
                return torch.ops.mptrain_lab.max_pool2d_backward(dys[i[0]], outs[i[0]][1], 112, 112, 3, 2, 1)
        ms = gpu_ms(bwd)
        fl = floor_ms(n_out * (2 + idx_bytes) + n_in * 2)
        print(f"pool bwd {name:<5} {ms:.3f} ms  {100 * fl / ms:.1f}% of floor", flush=True)

    x = xs[0].clone().requires_grad_()
    bn = nn.BatchNorm2d(64, device="cuda")
    for name, pool in (("inductor", nn.MaxPool2d(3, 2, 1)), ("lab op", LabMaxPool2d())):
        def f(x, pool=pool):
            return pool(torch.relu(bn(x.float()).half()))
        fn = torch.compile(f)
        g = torch.randn_like(fn(x))

        def step(fn=fn, g=g):
            x.grad = None
            fn(x).backward(g)
        ms = gpu_ms(step)
        print(f"compiled BN + ReLU + pool fwd+bwd, {name:<8} {ms:.3f} ms  grad sum {x.grad.float().sum().item():.4f}",
              flush=True)


def e2e(repeat):
    from stem_conv import PaddedConv2d

    from mptrain.bench import e2e as E
    from mptrain.models import classifier

    stock_build = classifier.build_image_model

    def builder(lab_pool):
        def build(arch, num_classes):
            model = stock_build(arch, num_classes)
            model.conv1.__class__, model.conv1.pad_to = PaddedConv2d, 4
            if lab_pool:
                model.maxpool = LabMaxPool2d()
            return model
        return build

    case = "mptrain+compile+cuda_graphs:best"
    spec = E.CASES[case]
    E.CASES[case] = E.CaseSpec(spec.trainer, "16-master", spec.optimizer, spec.compile, spec.cuda_graphs)
    for r in range(repeat):
        order = (("pad4 + inductor pool", False), ("pad4 + lab pool", True))
        for variant, lab in (order if r % 2 == 0 else order[::-1]):
            classifier.build_image_model = builder(lab)
            res = E.run_case("resnet50", case, "16-master", 6, 20, False)
            print(f"[{r}] {variant:<21} {res.status} {res.samples_per_s or 0:.1f} img/s, {res.step_ms or 0:.2f} "
                  f"ms/step, gpu {res.gpu_step_ms or 0:.2f} ms {res.message or ''}", flush=True)
    classifier.build_image_model = stock_build


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="*", default=["check", "micro"], choices=("check", "micro", "e2e"))
    p.add_argument("--repeat", type=int, default=1)
    a = p.parse_args(argv)
    setup()
    rc = 0
    if "check" in a.what:
        rc = int(check() > 0)
    if "micro" in a.what:
        micro()
    if "e2e" in a.what and rc == 0:
        e2e(a.repeat)
    return rc


if __name__ == "__main__":
    sys.exit(main())
