"""DDP on the CPU (2 gloo ranks, Lightning's launcher): identical weights on both ranks, one shared skip."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
PRECISIONS = ("32-true", "bf16-master", "bf16-sr")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> dict:
    """precision -> (rank 0's dump, rank 1's), every precision from one launch (each pays two ranks' imports)."""
    tmp = tmp_path_factory.mktemp("ddp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp / "ddp"), ",".join(PRECISIONS)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=tmp)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {p: tuple(torch.load(tmp / f"ddp-{p}.rank{rank}.pt", weights_only=True) for rank in (0, 1))
            for p in PRECISIONS}


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_two_ranks_end_with_identical_weights_and_skip_together(ddp_runs, precision):
    a, b = ddp_runs[precision]
    # 128 samples, 2 ranks, batch 8: 8 batches a rank an epoch, 4 steps (accumulation 2), 2 epochs
    assert a["world_size"] == 2 and a["steps"] == b["steps"] == 8
    assert a["skipped"] == b["skipped"] == 1, "the inf on rank 1 must skip the step on both ranks"
    assert not torch.equal(a["losses"], b["losses"]), "the ranks must have seen different data"
    # checkpoints hold fp32 weights, except bf16-sr's matrices: bf16, the only copy there is (norms stay fp32)
    weight_dtype = torch.bfloat16 if precision == "bf16-sr" else torch.float32
    for name, t in a["weights"].items():
        assert t.dtype == (weight_dtype if name.endswith("weight") and t.dim() == 2 else t.dtype), name
        assert t.dtype in (torch.float32, weight_dtype) and torch.isfinite(t).all(), name
        assert torch.equal(t, b["weights"][name]), f"ranks differ in {name}"


@pytest.fixture(scope="module")
def ddp_resumes(tmp_path_factory) -> dict:
    """precision -> (rank 0's dump, rank 1's) of tests/scripts/ddp_resume.py, every precision from one launch."""
    tmp = tmp_path_factory.mktemp("ddp_resume")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    r = subprocess.run([sys.executable, str(SCRIPT.parent / "ddp_resume.py"), str(tmp), ",".join(PRECISIONS)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=tmp)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {p: tuple(torch.load(tmp / f"resume-{p}.rank{rank}.pt", weights_only=True) for rank in (0, 1))
            for p in PRECISIONS}


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_two_ranks_resume_bitwise_from_every_kind_of_position(ddp_resumes, precision):
    """Mid-epoch, the last batch of an epoch, Lightning's end-of-epoch checkpoint, mid-epoch in the second epoch and
    a checkpoint written after fit: each resumed run replays the uninterrupted one on each rank (DistributedSampler
    order of the right epoch, every RNG, an accumulation window that does not divide the epoch)."""
    for rank, d in enumerate(ddp_resumes[precision]):
        assert d["steps"] == 8 and len(d["straight"]) == 20  # 2 epochs of 10 batches, 4 steps each
        for position, batches_left in (("step=2", 14), ("step=4", 10), ("epoch=0", 10), ("step=6", 4),
                                       ("after_fit", 10)):
            run = d[position]
            where = f"rank {rank}, resumed from {position}"
            assert run["steps"] == 8, f"{where}: ended at global_step {run['steps']}"
            assert torch.equal(run["losses"], d["straight"][20 - batches_left:]), f"{where}: other losses"
            for name, t in d["straight_weights"].items():
                assert torch.equal(t, run["weights"][name]), f"{where}: {name}"


@pytest.mark.slow
def test_one_process_checkpoint_resumed_by_two_ranks_is_refused_naming_both_world_sizes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    script = str(SCRIPT.parent / "ddp_resize.py")
    saved = subprocess.run([sys.executable, script, str(tmp_path), "save"], env=env, capture_output=True, text=True,
                           timeout=600, cwd=tmp_path)
    assert saved.returncode == 0, saved.stdout[-3000:] + saved.stderr[-3000:]
    r = subprocess.run([sys.executable, script, str(tmp_path), "resume"], env=env, capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-3000:]
    assert "REFUSED" in out and "world_size 1 -> 2" in out, out[-3000:]
    assert "StopIteration" not in out
