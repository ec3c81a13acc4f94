"""Launched by tests/test_checkpoint.py: save a large checkpoint to one path in a loop until killed."""
import sys

import torch

from mptrain.resume import AtomicCheckpointIO

path = sys.argv[1]
io = AtomicCheckpointIO()
for i in range(10_000):
    io.save_checkpoint({"state_dict": {"w": torch.full((16, 1024, 1024), float(i))}, "i": i}, path)  # 64 MB
    print(f"saved {i}", flush=True)
