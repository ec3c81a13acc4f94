"""Launch scripts: syntax and usage, and a real 2-process torchrun (gloo, CPU) of the quickstart."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["torchrun.sh", "multinode.sh", "slurm.sbatch"]


class SaveWeights(Callback):
    """Callback used by the torchrun test: every rank saves its final weights."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def on_fit_end(self, trainer, pl_module):
        # parameters: BatchNorm running statistics may differ after the last step (DDP syncs
        # buffers at the start of each forward, from rank 0)
        state = {k: v.detach().float().cpu() for k, v in pl_module.named_parameters()}
        torch.save(state, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def teardown_rounds(rank: int, store_dir: str, rounds: int) -> None:
    """Rank ``rank`` of 2: ``rounds`` commands through ``mptrain.cli.main``, each ending as ``mptrain fit``
    does under DDP (a broadcast: ``trainer.log_dir``) and then torn down by main."""
    import torch.distributed as dist

    import mptrain.cli.lightning_cli as lightning_cli
    from mptrain.cli import main

    for i in range(rounds):
        def command(args, i=i):
            dist.init_process_group("gloo", init_method=f"file://{store_dir}/store{i}", rank=rank, world_size=2)
            dist.broadcast_object_list(["log_dir" if rank == 0 else None], src=0)

        lightning_cli.MptrainCLI = command
        assert main([]) == 0 and not dist.is_initialized()


def env():
    e = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return e


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_and_are_executable(script):
    path = ROOT / "launch" / script
    assert os.access(path, os.X_OK)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_usage_and_missing_recipe():
    for script in ("torchrun.sh", "multinode.sh"):
        path = str(ROOT / "launch" / script)
        r = subprocess.run([path, "--help"], capture_output=True, text=True, env=env())
        assert r.returncode == 0 and "RECIPE" in r.stdout
        r = subprocess.run([path], capture_output=True, text=True, env=env())
        assert r.returncode == 2
    r = subprocess.run([str(ROOT / "launch" / "torchrun.sh"), "no/such.yaml", "2"], capture_output=True, text=True, env=env())
    assert r.returncode == 2 and "not found" in r.stderr


def test_scripts_promise_only_what_works():
    """No in-place restart (torchrun's restart of a killed rank fails inside torch/gloo) and no
    resume keyword Lightning does not have: a manual relaunch with --ckpt_path=PATH resumes."""
    text = (ROOT / "launch" / "multinode.sh").read_text()
    for needle in ("--rdzv-backend=c10d", "--rdzv-endpoint", "--max-restarts=0", "--nnodes", "--ckpt_path=<log_dir>"):
        assert needle in text
    for script in SCRIPTS:
        assert "--ckpt_path=auto" not in (ROOT / "launch" / script).read_text()
    slurm = (ROOT / "launch" / "slurm.sbatch").read_text()
    assert "srun" in slurm and "--signal=SIGUSR1" in slurm and "--requeue" in slurm


def test_multinode_refuses_an_elastic_node_range(tmp_path):
    recipe = ROOT / "recipes" / "quickstart.yaml"
    r = subprocess.run([str(ROOT / "launch" / "multinode.sh"), str(recipe), "1:4", "2", "localhost:29500"],
                       capture_output=True, text=True, env=env())
    assert r.returncode == 2 and "NNODES" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_torchrun_two_processes_gloo_quickstart(tmp_path):
    out = tmp_path / "weights"
    out.mkdir()
    callbacks = f"[{{class_path: test_launch.SaveWeights, init_args: {{out_dir: {out}}}}}]"
    cmd = [str(ROOT / "launch" / "torchrun.sh"), str(ROOT / "recipes" / "quickstart.yaml"), "2",
           "--trainer.max_epochs=2", f"--trainer.default_root_dir={tmp_path}", f"--trainer.callbacks={callbacks}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    results = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith('{"subcommand"')]
    assert len(results) == 1, "only rank 0 reports"
    # 1,438 training images, 2 ranks, batch 64, drop_last: 11 steps per epoch on each rank
    assert results[0]["global_step"] == 2 * ((1797 - 359) // 2 // 64)
    assert results[0]["metrics"]["val/acc"] > 0.5
    w0, w1 = torch.load(out / "rank0.pt", weights_only=True), torch.load(out / "rank1.pt", weights_only=True)
    assert w0.keys() == w1.keys()
    for k in w0:
        assert torch.equal(w0[k], w1[k]), f"ranks disagree on {k}"


@pytest.mark.slow
def test_the_teardown_after_a_last_broadcast_does_not_hang(tmp_path):
    """torch 2.6's gloo destructor, holding the GIL, joined a worker that needed the GIL to free the last
    broadcast's tensors: a race, lost within a few dozen rounds on 2 CPU cores."""
    code = "import sys, test_launch; test_launch.teardown_rounds(int(sys.argv[1]), sys.argv[2], 100)"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(tmp_path)], env=env(), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("a rank hung in mptrain.cli.main's process-group teardown")
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
