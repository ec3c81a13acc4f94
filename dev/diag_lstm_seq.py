"""FusedLSTM's fused C++ loop against its cuDNN path over a few shapes (not a test).

Both are FusedLSTM with the same (flattened) weights, so the only difference is the
implementation; prints fwd+bwd ms (do_bench median) and the host time per call."""
import torch

from mptrain.bench.common import host_us, median_ms
from mptrain.nn.lstm import FusedLSTM

SHAPES = [  # (layers, hidden, T, batch)
    (2, 256, 128, 16), (2, 512, 64, 32), (2, 1024, 128, 64), (1, 1024, 32, 256), (2, 2048, 64, 32), (4, 768, 256, 8)]
BF16 = torch.bfloat16
print(f"{'L':>2} {'H':>5} {'T':>4} {'B':>4}  cudnn ms  fused ms  fused/cudnn  host us cudnn / fused")
for layers, hidden, steps, batch in SHAPES:
    torch.manual_seed(0)
    m = FusedLSTM(hidden, hidden, layers, device="cuda", dtype=BF16)
    x = torch.randn(steps, batch, hidden, device="cuda", dtype=BF16, requires_grad=True)
    cot = torch.randn(steps, batch, hidden, device="cuda", dtype=BF16)
    params = list(m.parameters())

    def step(impl):
        m.impl = impl

        def fn():
            out, _ = m(x)
            return torch.autograd.grad(out, [x] + params, cot)
        return fn

    t = {i: min(median_ms(step(i), rep_ms=150) for _ in range(2)) for i in ("cudnn", "fused")}
    h = {i: host_us(step(i), calls=20, warmup=3) for i in ("cudnn", "fused")}
    print(f"{layers:>2} {hidden:>5} {steps:>4} {batch:>4}  {t['cudnn']:8.3f}  {t['fused']:8.3f}  {t['fused'] / t['cudnn']:10.2f}x"
          f"  {h['cudnn']:8.0f} / {h['fused']:.0f}", flush=True)
