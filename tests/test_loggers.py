"""Logger specs, W&B offline mode without prompting, and the API key never leaking."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mptrain.loggers import build_loggers, has_wandb_credentials, redact, wandb_logger

ROOT = Path(__file__).resolve().parents[1]


def names(loggers):
    return [type(lg).__name__ for lg in loggers]


def test_default_is_csv_and_none_is_nothing(tmp_path):
    assert names(build_loggers(None, str(tmp_path))) == ["CSVLogger"]
    assert names(build_loggers("csv", str(tmp_path))) == ["CSVLogger"]
    assert build_loggers("none", str(tmp_path)) == []
    assert build_loggers(False, str(tmp_path)) == []


def test_every_run_keeps_a_metrics_csv(tmp_path):
    got = names(build_loggers("tensorboard", str(tmp_path)))
    assert got == ["CSVLogger", "TensorBoardLogger"]


def test_class_path_and_instances(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    mine = CSVLogger(str(tmp_path), name="mine")
    assert build_loggers([mine], str(tmp_path)) == [mine]
    built = build_loggers({"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"name": "tb"}},
                          str(tmp_path))
    assert names(built) == ["CSVLogger", "TensorBoardLogger"]
    assert Path(built[1].save_dir) == tmp_path


def test_unknown_logger_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="csv, tensorboard, wandb, none"):
        build_loggers("mlflowx", str(tmp_path))


def test_hparams_are_written_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-1234567890")
    lg = build_loggers("csv", str(tmp_path), hparams={"model": {"lr": 0.1}, "api_key": "abc", "note": "tok-1234567890"})[0]
    lg.save()
    text = (Path(lg.log_dir) / "hparams.yaml").read_text()
    assert "lr: 0.1" in text and "abc" not in text and "tok-1234567890" not in text


def test_redact_nested():
    out = redact({"a": [{"wandb_api_key": "x"}, "keep"], "password": 1}, secrets=["SECRETVALUE"])
    assert out == {"a": [{"wandb_api_key": "<redacted>"}, "keep"], "password": "<redacted>"}
    assert redact("x SECRETVALUE y", secrets=["SECRETVALUE"]) == "x <redacted> y"


def test_missing_wandb_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'mptrain\[wandb\]'"):
        build_loggers("wandb", str(tmp_path))


def test_wandb_without_credentials_goes_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert not has_wandb_credentials()
    lg = wandb_logger(str(tmp_path))
    assert lg._offline is True  # WandbLogger starts the run with mode="offline"


def test_wandb_refuses_a_key_as_init_arg(tmp_path):
    pytest.importorskip("wandb")
    with pytest.raises(ValueError, match="WANDB_API_KEY"):
        wandb_logger(str(tmp_path), api_key="abc")


def test_wandb_offline_run_logs_metrics_and_never_the_key(tmp_path):
    pytest.importorskip("wandb")
    sentinel = "mptrain-sentinel-" + "9f" * 16
    env = dict(os.environ, WANDB_API_KEY=sentinel, WANDB_MODE="offline", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "mptrain", "fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
           "--trainer.logger=wandb", "--trainer.max_epochs=2", "--trainer.limit_train_batches=6",
           "--trainer.log_every_n_steps=4",
           "--trainer.limit_val_batches=2", f"--trainer.default_root_dir={tmp_path}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sentinel not in r.stdout and sentinel not in r.stderr
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))
    records = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
    for metric in (b"train/loss", b"lr", b"samples_per_sec", b"val/acc", b"grad_norm"):
        assert metric in records, metric
    assert b"ImageClassifier" in records  # the resolved config went in as hyperparameters
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and sentinel.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert list(tmp_path.rglob("metrics.csv")), "the CSV log is kept next to W&B"
