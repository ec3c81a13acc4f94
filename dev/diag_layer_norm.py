"""Driver for an ncu profile of the LayerNorm kernels at one shape (not a test).

    ncu --clock-control none -k regex:ln_ python3 dev/diag_layer_norm.py 16384 1024

Calls the extension's forward and backward directly, ITERS times each, on inputs larger
than L2 in rotation so every launch reads from DRAM as in the benchmark."""
import sys

import torch

from mptrain.ops.build import get_extension

rows, hidden = (int(a) for a in sys.argv[1:3])
iters = int(sys.argv[3]) if len(sys.argv) > 3 else 8
ext = get_extension(required=True)
g = torch.Generator(device="cuda").manual_seed(0)
sets = []
for _ in range(4):
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    sets.append((x, dy))
w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
b = torch.zeros(hidden, device="cuda", dtype=torch.bfloat16)
for i in range(iters):
    x, dy = sets[i % len(sets)]
    y, mean, rstd, work = ext.layer_norm_forward(x, w, b, hidden, 1e-5, False)
    ext.layer_norm_backward(dy, x, mean, rstd, w, b, hidden, False, work)
torch.cuda.synchronize()
print("done", rows, hidden, iters)
