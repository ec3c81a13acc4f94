"""ResNet's stem convolution with its 3 input channels padded to 4 or 8 (lab tool; the fp16 padding to 4
ships as mptrain.models.vision.ChannelPaddedConv2d).

In channels_last a 3-channel fp16 / bf16 image is 6 bytes per pixel: cuDNN's tensor-core kernels want
the channel count a multiple of 8 (16 bytes), NVIDIA's own ResNet pipelines feed the stem 4 padded
channels.  Zero channels with zero weights leave the convolution's output unchanged and their
weight gradient is zero (their input is zero).  This script measures whether padding pays:

* `micro`: conv1 (7x7/2, 64 filters) on 256x3x224x224 channels_last, GPU time per call of the forward
  and of forward + weight gradient (the image needs no gradient), at 3 / 4 / 8 channels; then the
  compiled stem as the e2e step runs it (cast of the fp32 batch, pad, conv, weight gradient).
* `e2e`: `mptrain bench e2e`'s ResNet case (default `mptrain+compile+cuda_graphs:best`, 16-master)
  with the stock stem against the padded one, alternating, in one process.

    python3 dev/stem_conv.py micro
    python3 dev/stem_conv.py e2e --pad 8 --repeat 2 [--case lightning+compile:bf16-true --precision bf16-true]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch import nn

CL = torch.channels_last


class PaddedConv2d(nn.Conv2d):
    """nn.Conv2d whose input channels (and weight) are zero-padded to ``pad_to`` before the
    convolution; its parameters and state_dict are the stock layer's (set ``pad_to`` after a class
    swap: ``conv.__class__ = PaddedConv2d; conv.pad_to = 8``)."""

    pad_to = 8

    def _conv_forward(self, x, weight, bias):
        extra = self.pad_to - x.shape[1]
        if extra > 0:
            x = F.pad(x, (0, 0, 0, 0, 0, extra))
            weight = F.pad(weight, (0, 0, 0, 0, 0, extra))
        return super()._conv_forward(x, weight, bias)


def gpu_ms(fn, iters=20, rounds=3):
    for _ in range(5):
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


def micro():
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    img = torch.randn(256, 3, 224, 224, device="cuda").contiguous(memory_format=CL)
    for dtype in (torch.float16, torch.bfloat16):
        w3 = (torch.randn(64, 3, 7, 7, device="cuda") * 0.05).to(dtype)
        ref = None
        for c in (3, 4, 8):
            x = F.pad(img, (0, 0, 0, 0, 0, c - 3)).to(dtype).contiguous(memory_format=CL)
            w = F.pad(w3, (0, 0, 0, 0, 0, c - 3)).contiguous(memory_format=CL).requires_grad_()
            y = F.conv2d(x, w, stride=2, padding=3)
            g = torch.randn_like(y)
            fwd = gpu_ms(lambda: F.conv2d(x, w, stride=2, padding=3))

            def step():
                w.grad = None
                F.conv2d(x, w, stride=2, padding=3).backward(g)
            both = gpu_ms(step)
            dw = w.grad[:, :3].float()
            err = "" if ref is None else (f"  max |dw - dw(C=3)| / max |dw| {(dw - ref[1]).abs().max() / ref[1].abs().max():.1e}"
                                          f"  max |y - y(C=3)| {(y.float() - ref[0]).abs().max():.1e}")
            ref = ref or (y.float(), dw)
            print(f"eager {str(dtype)[6:]:<9} C={c}  fwd {fwd:.3f} ms  fwd+wgrad {both:.3f} ms{err}", flush=True)
        for c in (3, 4, 8):
            conv = nn.Conv2d(3, 64, 7, 2, 3, bias=False, device="cuda", dtype=dtype).to(memory_format=CL)
            if c > 3:
                conv.__class__, conv.pad_to = PaddedConv2d, c
            f = torch.compile(lambda x, conv=conv: conv(x.to(dtype)))
            g = torch.randn(256, 64, 112, 112, device="cuda", dtype=dtype).contiguous(memory_format=CL)

            def cstep(f=f, conv=conv):
                conv.weight.grad = None
                f(img).backward(g)
            print(f"compiled {str(dtype)[6:]:<9} cast+pad to {c}+conv, fwd+wgrad {gpu_ms(cstep):.3f} ms", flush=True)


def e2e(case, precision, pad, repeat):
    from mptrain.bench import e2e as E
    from mptrain.models import classifier

    stock_build = classifier.build_image_model

    def stock(arch, num_classes, fused=False):  # torchvision's model, whatever ImageClassifier asks
        return stock_build(arch, num_classes)

    def padded(arch, num_classes, fused=False):
        model = stock_build(arch, num_classes)
        model.conv1.__class__, model.conv1.pad_to = PaddedConv2d, pad
        return model

    spec = E.CASES[case]
    if spec.precision == "best":
        E.CASES[case] = E.CaseSpec(spec.trainer, precision, spec.optimizer, spec.compile, spec.cuda_graphs)
    for r in range(repeat):
        order = (("stock", stock), (f"pad {pad}", padded))
        for variant, builder in (order if r % 2 == 0 else order[::-1]):
            classifier.build_image_model = builder
            res = E.run_case("resnet50", case, precision, 6, 20, False)
            print(f"[{r}] {case} @{precision} {variant:<6} {res.status} {res.samples_per_s or 0:.1f} img/s, "
                  f"{res.step_ms or 0:.2f} ms/step, gpu {res.gpu_step_ms or 0:.2f} ms {res.message or ''}", flush=True)
    classifier.build_image_model = stock_build


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("micro", "e2e"))
    p.add_argument("--case", default="mptrain+compile+cuda_graphs:best")
    p.add_argument("--precision", default="16-master")
    p.add_argument("--pad", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1)
    a = p.parse_args(argv)
    micro() if a.what == "micro" else e2e(a.case, a.precision, a.pad, a.repeat)


if __name__ == "__main__":
    main()
