"""Every recipe: --print_config, and a 2-step run on synthetic data on the CPU; the quickstart
trains to >= 95% validation accuracy on real data and validates from its checkpoint."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mptrain import cli

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
SMOKE = ["--data.synthetic=true", "--data.batch_size=2", "--trainer.max_steps=2", "--trainer.accelerator=cpu"]
SLOW = {"bert_base"}  # BERT-base's 110M parameters take ~30 s of CPU for two steps
VAL_METRICS = {"quickstart": {"val/acc", "val/acc_top5"}, "resnet50": {"val/acc", "val/acc_top5"},
               "bert_base": {"val/mlm_acc", "val/perplexity"}, "lstm_lm": {"val/perplexity"}}


def recipe(name: str) -> str:
    return str(ROOT / "recipes" / f"{name}.yaml")


def last_json(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{") and '"subcommand"' in ln]
    assert lines, f"no result line in output:\n{out[-2000:]}"
    return json.loads(lines[-1])


def read_metrics(log_dir: str) -> list[dict]:
    with open(Path(log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_all_four_recipes_exist():
    assert {"quickstart", "resnet50", "bert_base", "lstm_lm"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_print_config(name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["fit", "--config", recipe(name), *SMOKE, "--print_config"])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert "synthetic: true" in out and "max_steps: 2" in out and "class_path:" in out


def test_the_literal_smoke_command(tmp_path):
    """Exactly the documented overrides, through ``python -m mptrain``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "mptrain", "fit", "--config", recipe("quickstart"), *SMOKE],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert last_json(r.stdout)["global_step"] == 2


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in RECIPES])
def test_two_synthetic_steps_on_cpu(name, tmp_path, capsys):
    # limit_train_batches=2 makes step 2 the epoch's last batch, so the epoch's validation runs too
    rc = cli.main(["fit", "--config", recipe(name), *SMOKE, f"--trainer.default_root_dir={tmp_path}",
                   "--trainer.log_every_n_steps=1", "--trainer.limit_train_batches=2"])
    out = capsys.readouterr().out
    assert rc == 0
    result = last_json(out)
    assert result["global_step"] == 2
    rows = read_metrics(result["log_dir"])
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    logged = {k for r in rows for k, v in r.items() if v}
    assert VAL_METRICS.get(name, set()) <= logged, logged
    assert (Path(result["log_dir"]) / "config.yaml").is_file()
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


@pytest.fixture
def one_thread():
    """The quickstart's layers are too small for intra-op threads: on a shared 2-core machine a
    second thread only adds contention (10x slower under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_quickstart_reaches_95_percent_and_validates_from_checkpoint(tmp_path, capsys, one_thread):
    rc = cli.main(["fit", "--config", recipe("quickstart"), f"--trainer.default_root_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 0
    result = last_json(out)
    assert result["metrics"]["val/acc"] >= 0.95, result

    # Independent of the logged number: evaluate the checkpoint's weights on the whole split.
    from mptrain.checkpoint import load_checkpoint
    from mptrain.data import DigitsDataModule
    from mptrain.models import ImageClassifier

    model = ImageClassifier(arch="digits_cnn", num_classes=10)
    model.load_state_dict(load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["state_dict"])
    dm = DigitsDataModule()
    dm.setup()
    x, y = dm.val_set.tensors
    with torch.no_grad():
        acc = (model.eval()(x).argmax(1) == y).float().mean().item()
    assert acc >= 0.95, acc

    rc = cli.main(["validate", "--config", recipe("quickstart"), f"--trainer.default_root_dir={tmp_path}",
                   "--ckpt_path=last", "--trainer.logger=none"])
    validated = last_json(capsys.readouterr().out)
    assert rc == 0 and validated["subcommand"] == "validate"
    assert abs(validated["metrics"]["val/acc"] - result["metrics"]["val/acc"]) < 0.02
