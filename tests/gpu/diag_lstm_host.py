"""Where the host time of one LSTM cell fwd + autograd.grad goes (not a test).

Prints host microseconds per call (perf_counter over N calls, one sync at the end) for
building blocks, ours and nn.LSTMCell, then a torch.profiler CPU table of each."""
import sys
from functools import partial

import torch
from torch import nn

from mptrain.bench.common import host_us as _host_us
from mptrain.nn.lstm import FusedLSTMCell

B, H = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (256, 1024)
BF16 = torch.bfloat16
dev = "cuda"
host_us = partial(_host_us, calls=300, warmup=30)


torch.manual_seed(0)
ref = nn.LSTMCell(H, H, device=dev, dtype=BF16)
ours = FusedLSTMCell(H, H, device=dev, dtype=BF16, fused=True)
ours.load_state_dict(ref.state_dict())
x, h, c = (torch.randn(B, H, device=dev, dtype=BF16, requires_grad=True) for _ in range(3))
cot = [torch.randn(B, H, device=dev, dtype=BF16) for _ in range(2)]
W = ref.weight_ih.detach()
xd = x.detach()


def step(cell):
    params = list(cell.parameters())

    def fn():
        outs = cell(x, (h, c))
        return torch.autograd.grad(outs, [x, h, c] + params, cot)
    return fn


def fwd(cell):
    return lambda: cell(x, (h, c))


def trivial_grad(k):
    leaves = [torch.randn(4, device=dev, requires_grad=True) for _ in range(k)]
    g = torch.ones(4, device=dev)

    def fn():
        y = leaves[0] * 2
        for t in leaves[1:]:
            y = y + t
        return torch.autograd.grad(y, leaves, g)
    return fn


rows = {
    "empty CUDA launch (torch.empty + add_)": lambda: xd.add_(0),
    "mm (B,H)x(H,4H) no grad": lambda: torch.mm(xd, W.t()),
    "addmm_ into (B,4H) no grad": (lambda o=torch.mm(xd, W.t()): o.addmm_(xd, W.t())),
    "autograd.grad of y=x*2 (1 leaf, CUDA)": trivial_grad(1),
    "autograd.grad of a 7-leaf sum (CUDA)": trivial_grad(7),
    "ours fwd (grad on)": fwd(ours),
    "ours fwd+grad": step(ours),
    "nn.LSTMCell fwd (grad on)": fwd(ref),
    "nn.LSTMCell fwd+grad": step(ref),
}
with torch.no_grad():
    rows["ours fwd no_grad"] = fwd(ours)
    rows["nn.LSTMCell fwd no_grad"] = fwd(ref)
print(f"B={B} H={H}")
for name, fn in rows.items():
    if "no_grad" in name:
        with torch.no_grad():
            us = host_us(fn)
    else:
        us = host_us(fn)
    print(f"{name:45s} {us:8.1f} us/call")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

for name, fn in (("ours", step(ours)), ("nn.LSTMCell", step(ref))):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
    print(f"\n=== {name}: torch.profiler CPU, 50 calls")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
