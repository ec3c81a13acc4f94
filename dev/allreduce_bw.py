"""All-reduce bandwidth between the GPUs of one host (run under torchrun): is DDP comm-bound?"""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
for mb in (50, 220):
    x = torch.randn(mb * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / 10 * 1e3
    n = dist.get_world_size()
    busbw = 2 * (n - 1) / n * x.numel() * 2 / (ms / 1e3) / 1e9
    if rank == 0:
        print(f"all_reduce {mb} MB bf16: {ms:.2f} ms, bus bandwidth {busbw:.1f} GB/s")
dist.destroy_process_group()
