"""W&B through Lightning's WandbLogger: offline without credentials, what a run logs lands in the offline run's
``.wandb`` file, the files follow ``--trainer.default_root_dir``, and the API key is in no file or output of a run."""
from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mptrain.cli import wandb_offline_without_key

ROOT = Path(__file__).resolve().parents[1]
FAKE_KEY = "0123456789abcdef0123456789abcdef01fake42"


def wandb_records(path: Path) -> list:
    """The protobuf ``Record``s of a ``.wandb`` file: wandb's 7-byte header (":W&B", magic 0xBEE1, version 0), then a
    LevelDB log (32 KiB blocks; each chunk a 7-byte header: crc32, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a .wandb file"
    pos, chunks, records = 7, [], []
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST: a record is complete
            records.append(pb.Record.FromString(b"".join(chunks)))
            chunks = []
    return records


def _item(item) -> tuple[str, object]:
    """(key, value) of a history / config item: the value typed (newer wandb) or as JSON."""
    key = item.key or "/".join(item.nested_key)
    oneof = item.WhichOneof("value") if "value" in item.DESCRIPTOR.oneofs_by_name else None
    return key, getattr(item, oneof) if oneof else json.loads(item.value_json)


def logged(records: list) -> tuple[list[dict], dict]:
    """(history rows, config) an offline run recorded."""
    rows = [dict(map(_item, r.history.item)) for r in records if r.WhichOneof("record_type") == "history"]
    config = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind in ("config", "run"):
            config.update(map(_item, (r.config if kind == "config" else r.run.config).update))
    return rows, config


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb offline, quiet, with every file it writes under tmp_path and no key anywhere; the service process is
    torn down after the test."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_CODE": "true",
                        "WANDB_DISABLE_GIT": "true", "WANDB_CONSOLE": "off", "HOME": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    yield wandb
    wandb.finish()
    wandb.teardown()


def test_wandb_offline_run_records_the_metrics_and_config(wandb_offline, tmp_path):
    """A fit logs through WandbLogger (next to a CSVLogger): the offline run's .wandb file holds every train_loss
    the CSV holds, step by step, the validation metrics and the model's hyperparameters."""
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from _models import Classifier, classification_data, mlp, quiet_trainer

    class Model(Classifier):
        def __init__(self, lr: float = 0.02, width: int = 16):
            super().__init__(mlp(width), lr=lr)
            self.save_hyperparameters()

    wb = WandbLogger(save_dir=tmp_path / "wb", project="mptrain-test", offline=True)
    data = torch.utils.data.DataLoader(classification_data(48), batch_size=16)  # 3 steps: one epoch, then validation
    trainer = quiet_trainer(max_steps=3, log_every_n_steps=1, precision="bf16-mixed", enable_model_summary=False,
                            logger=[wb, CSVLogger(tmp_path / "csv")])
    trainer.fit(Model(), data, data)
    run_id = wb.version
    wandb_offline.finish()
    wandb_offline.teardown()  # the service process writes the .wandb file: it is complete once the service is gone

    files = list((tmp_path / "wb" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1, sorted(p.name for p in (tmp_path / "wb").rglob("*"))
    rows, config = logged(wandb_records(files[0]))
    assert config.get("lr") == 0.02 and config.get("width") == 16, config
    wandb_loss = {int(r["trainer/global_step"]): r["train_loss"] for r in rows if "train_loss" in r}
    with open(Path(trainer.loggers[1].log_dir) / "metrics.csv") as f:
        csv_loss = {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")}
    assert sorted(wandb_loss) == [0, 1, 2] and wandb_loss == pytest.approx(csv_loss, rel=1e-6)
    assert any("val_loss" in r and "val_acc" in r for r in rows), rows


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


@pytest.mark.slow  # two subprocesses: whole `mptrain fit` runs
def test_wandb_runs_each_have_their_folder_under_the_root_dir_and_never_show_the_api_key(tmp_path):
    """Two ``mptrain fit`` runs with a WandbLogger given no save_dir: each run's folder (the JSON summary's log_dir,
    the last line of stdout) holds its own config.yaml and checkpoints; wandb's run files and debug logs land under
    --trainer.default_root_dir, none in the home directory; the key is in no output and no file."""
    pytest.importorskip("wandb")
    env = dict(os.environ, WANDB_API_KEY=FAKE_KEY, WANDB_MODE="offline", WANDB_SILENT="false",
               WANDB_DISABLE_CODE="true", PYTHONPATH=str(ROOT), HOME=str(tmp_path / "home"))
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "XDG_CACHE_HOME"):
        env.pop(name, None)
    logger = "{class_path: lightning.pytorch.loggers.WandbLogger, init_args: {project: mptrain-test, offline: true}}"
    root = tmp_path / "root"
    folders, outputs = [], ""
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "mptrain", "fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
                            "--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
                            f"--trainer.logger={logger}", f"--trainer.default_root_dir={root}"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        summary = json.loads(r.stdout.strip().splitlines()[-1])  # the summary is the last line, after wandb's own
        folder = Path(summary["log_dir"])
        assert folder.parent == root / "mptrain-test"  # <save_dir>/<project>/<run id>
        assert (folder / "config.yaml").is_file() and (folder / "checkpoints" / "last.ckpt").is_file()
        folders.append(folder)
        outputs += r.stdout + r.stderr
    assert folders[0] != folders[1]
    assert not (root / "config.yaml").exists()  # no config shared by the runs
    runs = sorted((root / "wandb").glob("offline-run-*/*.wandb"))
    assert {p.stem.removeprefix("run-") for p in runs} == {f.name for f in folders}  # W&B's run id names the folder
    rows, _ = logged(wandb_records(runs[0]))
    assert [r["trainer/global_step"] for r in rows if "train/loss" in r] == [0, 1]
    assert list((root / "wandb").rglob("core-debug-*.log"))  # wandb's service logs under the root too
    home = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "home").rglob("*") if "wandb" in str(p))
    assert not home, home
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "runs").exists()
    assert FAKE_KEY not in outputs
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert not leaks, leaks
