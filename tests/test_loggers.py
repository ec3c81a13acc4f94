"""W&B through Lightning's WandbLogger: offline without credentials, and the API key in no
file or output of a run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mptrain.cli import wandb_offline_without_key

ROOT = Path(__file__).resolve().parents[1]
FAKE_KEY = "0123456789abcdef0123456789abcdef01fake42"


def test_no_credentials_means_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    wandb_offline_without_key()
    assert os.environ["WANDB_MODE"] == "offline"


def test_a_login_or_an_explicit_mode_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    wandb_offline_without_key()
    assert os.environ["WANDB_MODE"] == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("HOME", str(tmp_path))
    netrc = tmp_path / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password xyz\n")
    netrc.chmod(0o600)
    wandb_offline_without_key()
    assert "WANDB_MODE" not in os.environ


def test_wandb_run_never_shows_the_api_key(tmp_path):
    pytest.importorskip("wandb")
    env = dict(os.environ, WANDB_API_KEY=FAKE_KEY, WANDB_MODE="offline", WANDB_SILENT="false",
               WANDB_DIR=str(tmp_path), PYTHONPATH=str(ROOT), HOME=str(tmp_path))
    logger = ("{class_path: lightning.pytorch.loggers.WandbLogger, init_args: "
              f"{{save_dir: {tmp_path / 'wb'}, project: mptrain-test, offline: true}}}}")
    r = subprocess.run([sys.executable, "-m", "mptrain", "fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
                        "--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
                        f"--trainer.logger={logger}", f"--trainer.default_root_dir={tmp_path / 'root'}"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert list((tmp_path / "wb").rglob("*.wandb")), "no offline W&B run was written"
    assert FAKE_KEY not in r.stdout and FAKE_KEY not in r.stderr
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert not leaks, leaks
