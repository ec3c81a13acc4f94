import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture(autouse=True)
def _chdir_tmp(tmp_path, monkeypatch):
    """Every test writes its logs and checkpoints under its own temp dir."""
    monkeypatch.chdir(tmp_path)
    yield
