"""DDP on the CPU (gloo) under torchrun: identical weights on both ranks, equal to one process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"


@pytest.mark.slow
def test_torchrun_two_ranks_bf16_master_accumulation(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29533",
           str(SCRIPT), str(tmp_path / "ddp"), "2", "8"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r1 = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "one"), "1", "16"], env=env,
                        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r1.returncode == 0, r1.stderr[-3000:]
    a = torch.load(tmp_path / "ddp.rank0.pt", weights_only=True)
    b = torch.load(tmp_path / "ddp.rank1.pt", weights_only=True)
    one = torch.load(tmp_path / "one.rank0.pt", weights_only=True)
    assert a["world_size"] == 2 and a["steps"] == one["steps"] == 8
    # mptrain's DDP defaults (mptrain.distributed.tune_ddp): the MLP has no floating buffers
    assert a["ddp"] == {"gradient_as_bucket_view": True, "broadcast_buffers": False}
    for n in a["weights"]:
        assert torch.equal(a["weights"][n], b["weights"][n]), f"ranks differ in {n}"
        # same global batch (2 ranks x 8 == 16), bf16 forward/backward: close, not bitwise
        torch.testing.assert_close(a["weights"][n], one["weights"][n], rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("with_bn", [False, True])
def test_tune_ddp_defaults_follow_the_module(with_bn):
    from lightning.fabric.strategies import DDPStrategy

    from mptrain.distributed import tune_ddp

    layers = [torch.nn.Linear(4, 4)] + ([torch.nn.BatchNorm1d(4)] if with_bn else [])
    module = torch.nn.Sequential(*layers)
    strategy = DDPStrategy()
    tune_ddp(strategy, module, "ddp")
    assert strategy._ddp_kwargs == {"gradient_as_bucket_view": True, "broadcast_buffers": with_bn}
    # a strategy object from the user is taken as given; so is anything not DDP
    given = DDPStrategy(broadcast_buffers=True)
    tune_ddp(given, module, given)
    assert given._ddp_kwargs == {"broadcast_buffers": True}
    tune_ddp(object(), module, "ddp")


def test_found_inf_sync_only_where_grads_are_not_all_reduced():
    from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    from mptrain.distributed import grads_all_reduced

    assert grads_all_reduced(DDPStrategy())
    assert not grads_all_reduced(SingleDeviceStrategy(device=torch.device("cpu")))
    # DeepSpeed derives from DDPStrategy but ZeRO partitions gradients
    assert not grads_all_reduced(DeepSpeedStrategy.__new__(DeepSpeedStrategy))
