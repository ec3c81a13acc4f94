"""Where the host time of one LSTM cell fwd + autograd.grad goes (not a test).

Prints host microseconds per call (perf_counter over N calls, one sync at the end) for
building blocks, ours and nn.LSTMCell; the GPU time of the pointwise backward with the
fused bias gradient against the plain kernel + dg.sum(0); then a torch.profiler
CPU table of each cell."""
import sys
from functools import partial

import torch
from torch import nn

from mptrain.bench.common import host_us as _host_us
from mptrain.nn.lstm import FusedLSTMCell
from mptrain.ops.build import get_extension

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
# Run 8e: the pieces of our step called directly (no autograd, no module), so that
# fwd+grad minus these is the autograd engine's share.
_ext = get_extension(required=True)
_w = [t.detach() for t in ours.parameters()]
_hd, _cd = h.detach(), c.detach()
_h1, _c1, _ws = _ext.lstm_cell_forward(xd, _hd, _cd, *_w)
_gates = torch.empty(B, 4 * H, device=dev, dtype=BF16)
_dw = torch.empty(4 * H, H, device=dev, dtype=BF16)
rows.update({
    "ext.lstm_cell_forward direct": lambda: _ext.lstm_cell_forward(xd, _hd, _cd, *_w),
    "ext.lstm_cell_backward direct (all 6 grads)": lambda: _ext.lstm_cell_backward(
        cot[0], cot[1], xd, _hd, _cd, _w[0], _w[1], _ws, _c1, [True] * 6),
    "ext.lstm_gemm_rm (B,H)x(H,4H) direct cuBLAS": lambda: _ext.lstm_gemm_rm(_gates, xd, False, _w[0], True, 0.0),
    "ext.lstm_gemm_rm dW (4H,B)x(B,H) direct cuBLAS": lambda: _ext.lstm_gemm_rm(_dw, _gates, True, xd, False, 0.0),
    "ext.lstm_cell_pointwise_forward direct": lambda: _ext.lstm_cell_pointwise_forward(_gates, None, _cd, None, None),
})
print(f"B={B} H={H}")
for name, fn in rows.items():
    if "no_grad" in name:
        with torch.no_grad():
            us = host_us(fn)
    else:
        us = host_us(fn)
    print(f"{name:45s} {us:8.1f} us/call")


def gpu_us(fns, n=40, rounds=5, sleep_cycles=int(2e7)):
    """GPU microseconds per call, host excluded: a long sleep kernel keeps the GPU busy
    while the host queues n calls, which then run back to back between two events
    (inter-kernel gaps included, as in a busy stream). fns: calls cycled through (inputs
    rotated so that they do not sit in L2)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(rounds):
        torch.cuda._sleep(sleep_cycles)
        s.record()
        for i in range(n):
            fns[i % len(fns)]()
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) * 1e3 / n)
    return best


# Run 8: the bias gradient summed inside the backward kernel vs the plain kernel + at::sum.
ext = get_extension(required=True)
print("\nGPU time of the pointwise backward (us per call, bf16, inputs rotated over 4 sets)")
for b in (256, 1024):
    sets = []
    for _ in range(4):
        ig, cc = torch.randn(b, 4 * H, device=dev, dtype=BF16) * 2, torch.randn(b, H, device=dev, dtype=BF16)
        _, c1, ws = ext.lstm_cell_pointwise_forward(ig, None, cc, None, None)
        sets.append((torch.randn(b, H, device=dev, dtype=BF16), torch.randn(b, H, device=dev, dtype=BF16), cc, c1, ws,
                     torch.randn(b, H, device=dev, dtype=BF16)))
    wih, whh = torch.randn(4 * H, H, device=dev, dtype=BF16), torch.randn(4 * H, H, device=dev, dtype=BF16)
    plain = [lambda s=s: ext.lstm_cell_pointwise_backward(s[0], None, s[1], s[2], s[3], s[4]) for s in sets]
    plain_sum = [lambda s=s: ext.lstm_cell_pointwise_backward(s[0], None, s[1], s[2], s[3], s[4])[0].sum(0)
                 for s in sets]
    need = [False, False, True, False, False, True]  # dc + db: the plain kernel's dc, plus the bias sum
    fused = [lambda s=s: ext.lstm_cell_backward(s[0], s[1], s[5], s[5], s[2], wih, whh, s[4], s[3], need)
             for s in sets]
    print(f"B={b:5d}: plain kernel {gpu_us(plain):7.2f}   plain + dg.sum(0) (before) {gpu_us(plain_sum):7.2f}   "
          f"fused db {gpu_us(fused):7.2f}")
    print(f"         host: plain + dg.sum(0) {host_us(plain_sum[0]):7.2f}   fused db {host_us(fused[0]):7.2f}")

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
