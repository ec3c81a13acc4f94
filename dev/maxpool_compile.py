"""ResNet's 3x3/2 max-pool under torch.compile (lab tool, not shipped): inductor lowers its backward to a
gather kernel that recomputes the window arg-max from int8 offsets; on the H200 that kernel took 1.45 ms of a
34.7 ms ResNet-50 step (batch 256; dev/profile_e2e.py).  This script times the alternatives:

* `micro`: conv1's output shape (256x64x112x112, fp16, channels_last) through BatchNorm + ReLU + max-pool,
  forward + backward, GPU time per call: eager; compiled (inductor's lowering); compiled with the pool as an
  opaque custom op that runs ATen's kernels (max_pool2d_with_indices and its backward).
* `e2e`: `mptrain bench e2e`'s ResNet case `mptrain+compile+cuda_graphs:best` (16-master), stock model against
  the model whose pool is the custom op, alternating.

    python3 dev/maxpool_compile.py micro
    python3 dev/maxpool_compile.py e2e --repeat 2
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

lib = torch.library.Library("mptrain_dev", "DEF")
lib.define("max_pool2d(Tensor x, int[] kernel_size, int[] stride, int[] padding) -> (Tensor, Tensor)")
lib.define("max_pool2d_backward(Tensor grad, Tensor x, int[] kernel_size, int[] stride, int[] padding, "
           "Tensor indices) -> Tensor")


@torch.library.impl(lib, "max_pool2d", "CompositeExplicitAutograd")
def _pool(x, kernel_size, stride, padding):
    return torch.ops.aten.max_pool2d_with_indices(x, kernel_size, stride, padding)


@torch.library.impl(lib, "max_pool2d_backward", "CompositeExplicitAutograd")
def _pool_bwd(grad, x, kernel_size, stride, padding, indices):
    return torch.ops.aten.max_pool2d_with_indices_backward(grad, x, kernel_size, stride, padding, [1, 1], False,
                                                           indices)


@torch.library.register_fake("mptrain_dev::max_pool2d")
def _pool_fake(x, kernel_size, stride, padding):
    return torch.ops.aten.max_pool2d_with_indices(x, kernel_size, stride, padding)


@torch.library.register_fake("mptrain_dev::max_pool2d_backward")
def _pool_bwd_fake(grad, x, kernel_size, stride, padding, indices):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    x, k, s, p = inputs
    ctx.save_for_backward(x, output[1])
    ctx.args = (k, s, p)


def _backward(ctx, grad, _grad_idx):
    x, idx = ctx.saved_tensors
    return torch.ops.mptrain_dev.max_pool2d_backward(grad.contiguous(memory_format=torch.channels_last)
                                                     if x.is_contiguous(memory_format=torch.channels_last)
                                                     else grad, x, *ctx.args, idx), None, None, None


torch.library.register_autograd("mptrain_dev::max_pool2d", _backward, setup_context=_setup)


class AtenMaxPool2d(nn.Module):
    def __init__(self, pool: nn.MaxPool2d):
        super().__init__()
        two = lambda v: [v, v] if isinstance(v, int) else list(v)  # noqa: E731
        self.args = (two(pool.kernel_size), two(pool.stride), two(pool.padding))
        assert pool.dilation in (1, (1, 1)) and not pool.ceil_mode and not pool.return_indices

    def forward(self, x):
        return torch.ops.mptrain_dev.max_pool2d(x, *self.args)[0]


def gpu_ms(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def micro():
    torch.manual_seed(0)
    x = torch.randn(256, 64, 112, 112, device="cuda", dtype=torch.float16).contiguous(
        memory_format=torch.channels_last).requires_grad_()
    bn = nn.BatchNorm2d(64, device="cuda")
    pools = {"inductor": nn.MaxPool2d(3, 2, 1), "aten op": AtenMaxPool2d(nn.MaxPool2d(3, 2, 1))}
    for name, pool in pools.items():
        def f(x, pool=pool):
            return pool(torch.relu(bn(x.float()).half()))
        for label, fn in (("eager", f), ("compiled", torch.compile(f))):
            y = fn(x)
            g = torch.randn_like(y)

            def step(fn=fn, g=g):
                x.grad = None
                fn(x).backward(g)
            ms = gpu_ms(step)
            ref = x.grad.clone()
            print(f"pool={name:<9} {label:<9} fwd+bwd {ms:.3f} ms/call  grad sum {ref.float().sum().item():.4f}",
                  flush=True)


def e2e(repeat):
    from mptrain.bench import e2e as E
    from mptrain.models import classifier

    stock_build = classifier.build_image_model

    def pooled(arch, num_classes, fused=False):  # torchvision's model
        model = stock_build(arch, num_classes)
        model.maxpool = AtenMaxPool2d(model.maxpool)
        return model

    E.best_mptrain_mode = lambda results, model: "16-master"
    for r in range(repeat):
        for variant, builder in (("stock", lambda arch, n, fused=False: stock_build(arch, n)), ("aten pool", pooled)):
            classifier.build_image_model = builder
            res = E.run_case("resnet50", "mptrain+compile+cuda_graphs:best", "16-master", 6, 20, False)
            print(f"[{r}] {variant:<10} {res.status} {res.samples_per_s or 0:.1f} img/s, {res.step_ms or 0:.2f} "
                  f"ms/step, gpu {res.gpu_step_ms or 0:.2f} ms, peak {res.peak_mem_gb or 0:.2f} GB "
                  f"{res.message or ''}", flush=True)
    classifier.build_image_model = stock_build


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("micro", "e2e"))
    p.add_argument("--repeat", type=int, default=1)
    a = p.parse_args(argv)
    micro() if a.what == "micro" else e2e(a.repeat)


if __name__ == "__main__":
    sys.exit(main())
