"""Host cost of the fp32-fallback context: a tiny 12-layer BERT forward (host-bound) with and
without it. CPU, one thread.  python dev/fallback_mode_host.py"""
import time, torch
from mptrain.models.bert import build_bert_mlm
from mptrain.precision.fallback import Fp32Fallback
torch.set_num_threads(1)
m = build_bert_mlm(vocab_size=64, hidden_size=16, num_layers=12, num_heads=2, intermediate_size=32).eval()
ids = torch.randint(0, 64, (1, 8))
fb = Fp32Fallback("default")
def run(ctx, n=200):
    with torch.no_grad():
        for _ in range(20):
            with ctx(): m(input_ids=ids)
        t = time.perf_counter()
        for _ in range(n):
            with ctx(): m(input_ids=ids)
        return (time.perf_counter() - t) / n * 1e6
import contextlib
for _ in range(2):
    a = run(contextlib.nullcontext); b = run(fb.context)
    print(f"plain {a:.0f} us/forward, with the fp32-fallback context {b:.0f} us ({b/a:.2f}x)")
n = [0]
class Count(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        n[0] += 1; return func(*args, **(kwargs or {}))
with torch.no_grad(), Count(): m(input_ids=ids)
print("torch function calls per forward:", n[0])
