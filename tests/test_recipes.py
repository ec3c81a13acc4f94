"""Every recipe runs where the README says: --print_config; two synthetic steps on the CPU
with a tiny model; the quickstart trains to >= 95% validation accuracy on real data in under
a minute and validates from its checkpoint."""
from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from mptrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
SMOKE = ["--data.synthetic=true", "--data.batch_size=2", "--trainer.max_steps=2", "--trainer.accelerator=cpu",
         "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
         "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
TINY = {  # model overrides that keep each architecture but make two CPU steps take seconds
    "quickstart": [],
    "resnet50": ["--data.image_size=32", "--model.num_classes=10", "--data.num_classes=10",
                 "--trainer.channels_last=false"],
    "bert_base": ["--model.hidden_size=32", "--model.num_layers=2", "--model.num_heads=2",
                  "--model.intermediate_size=64", "--data.vocab_size=200", "--data.seq_len=16",
                  "--model.warmup_steps=1", "--trainer.checkpoint_every_n_steps=1"],
    "lstm_lm": ["--model.embedding_dim=16", "--model.hidden_size=16", "--data.vocab_size=100", "--data.seq_len=8"],
    "llama_1b": ["--model.hidden_size=64", "--model.num_layers=2", "--model.num_heads=4", "--model.intermediate_size=128",
                 "--data.vocab_size=512", "--data.seq_len=32", "--model.warmup_steps=1",
                 "--trainer.checkpoint_every_n_steps=1", "--trainer.compile=false"],
}
# FSDP is GPU-only in Lightning: the sharded recipe's CPU smoke run is the same model unsharded
TINY["bert_large"] = TINY["bert_base"] + ["--trainer.strategy=auto"]
VAL_METRICS = {"quickstart": {"val/acc", "val/acc_top5"}, "resnet50": {"val/acc", "val/acc_top5"},
               "bert_base": {"val/mlm_acc", "val/perplexity"}, "bert_large": {"val/mlm_acc", "val/perplexity"},
               "lstm_lm": {"val/perplexity"}, "llama_1b": {"val/perplexity"}}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def recipe(name: str) -> str:
    return str(ROOT / "recipes" / f"{name}.yaml")


def result_line(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{") and '"subcommand"' in ln]
    assert lines, f"no result line in output:\n{out[-2000:]}"
    return json.loads(lines[-1])


def read_metrics(log_dir: str) -> list[dict]:
    with open(Path(log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_all_four_recipes_exist_and_use_lightnings_logger_form():
    assert {"quickstart", "resnet50", "bert_base", "lstm_lm"} <= set(RECIPES)
    for name in RECIPES:
        assert "class_path: lightning.pytorch.loggers.CSVLogger" in Path(recipe(name)).read_text()


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_writes_under_its_default_root_dir(name):
    """runs/<recipe> by default; --trainer.default_root_dir moves logs, config.yaml and checkpoints (docs/cli.md)."""
    trainer = yaml.safe_load(Path(recipe(name)).read_text())["trainer"]
    assert trainer.get("default_root_dir") == f"runs/{name}"
    assert trainer["logger"]["init_args"].get("save_dir") == "${trainer.default_root_dir}"


@pytest.mark.parametrize("name", RECIPES)
def test_print_config(name, workdir, capsys):
    assert main(["fit", "--config", recipe(name), *SMOKE, "--print_config"]) == 0
    out = capsys.readouterr().out
    assert "synthetic: true" in out and "max_steps: 2" in out and "class_path:" in out


@pytest.mark.parametrize("name", RECIPES)
def test_two_synthetic_steps_on_cpu(name, workdir, capsys):
    rc = main(["fit", "--config", recipe(name), *SMOKE, *TINY[name]])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    result = result_line(out)
    assert result["global_step"] == 2
    assert Path(result["log_dir"]).parts[:2] == ("runs", name)
    rows = read_metrics(result["log_dir"])
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    logged = {k for r in rows for k, v in r.items() if v}
    assert VAL_METRICS[name] <= logged, logged
    assert (Path(result["log_dir"]) / "config.yaml").is_file()
    assert (Path(result["log_dir"]) / "checkpoints" / "last.ckpt").is_file()  # what --ckpt_path=last resumes
    # the recipe's own checkpointing is what a resume finds: one more step from where the run stopped
    rc = main(["fit", "--config", recipe(name), *SMOKE, *TINY[name], "--trainer.max_steps=3", "--ckpt_path=last"])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    resumed = result_line(out)
    assert resumed["global_step"] == 3 and resumed["log_dir"] != result["log_dir"]
    steps = [int(r["step"]) for r in read_metrics(resumed["log_dir"]) if r.get("train/loss")]
    assert steps == [2], steps  # only the step after the resumed position was trained


def readme_resume_lines() -> list[list[str]]:
    """The README's stop-and-resume commands of the quickstart, as argv lists (comments dropped)."""
    import shlex

    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines()
             if ln.startswith("mptrain fit --config recipes/quickstart.yaml --trainer.max_steps=")]
    return [shlex.split(ln, comments=True) for ln in lines]


def test_the_readme_resume_lines_resume_the_quickstart(workdir, capsys, one_thread):
    """Exactly the README's two lines: the first stops mid-epoch at step 30 and writes last.ckpt, the second resumes
    there with --ckpt_path=last and trains steps 30..59 only."""
    first, second = readme_resume_lines()
    assert "--ckpt_path=last" not in first and "--ckpt_path=last" in second
    results = []
    for argv in (first, second):
        assert argv[:4] == ["mptrain", "fit", "--config", "recipes/quickstart.yaml"]
        rc = main(["fit", "--config", recipe("quickstart"), *argv[4:]])
        out, err = capsys.readouterr()
        assert rc == 0, err[-3000:]
        results.append(result_line(out))
    assert [r["global_step"] for r in results] == [30, 60]
    steps = [int(r["step"]) for r in read_metrics(results[1]["log_dir"]) if r.get("train/loss")]
    assert steps and min(steps) >= 30, steps


def test_lstm_recipe_with_the_readme_command_runs_on_this_cpu(workdir, capsys):
    """`mptrain fit --config recipes/lstm_lm.yaml --data.synthetic=true --trainer.accelerator=cpu`
    (bf16-mixed) must not crash in oneDNN's bf16 LSTM on CPUs without native bf16."""
    rc = main(["fit", "--config", recipe("lstm_lm"), "--data.synthetic=true", "--trainer.accelerator=cpu",
               "--trainer.max_steps=1", "--trainer.limit_val_batches=1", "--data.batch_size=2", "--data.seq_len=8",
               "--trainer.enable_progress_bar=false"])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    assert result_line(out)["global_step"] == 1


@pytest.fixture
def one_thread():
    """The quickstart's layers are too small for intra-op threads: on a shared 2-core machine a
    second thread only adds contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_quickstart_reaches_95_percent_and_validates_from_checkpoint(workdir, capsys, one_thread):
    start = time.perf_counter()
    rc = main(["fit", "--config", recipe("quickstart"), "--trainer.enable_progress_bar=false"])
    took = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    result = result_line(out)
    assert result["metrics"]["val/acc"] >= 0.95, result
    assert took < 90, f"quickstart took {took:.0f} s (README: under a minute on an idle CPU)"

    ckpts = sorted((Path(result["log_dir"]) / "checkpoints").glob("*.ckpt"))
    assert ckpts
    from mptrain.models import ImageClassifier

    model = ImageClassifier.load_from_checkpoint(ckpts[-1], map_location="cpu")
    rc = main(["validate", "--config", recipe("quickstart"), f"--ckpt_path={ckpts[-1]}",
               "--trainer.logger=false", "--trainer.enable_progress_bar=false"])
    validated = result_line(capsys.readouterr().out)
    assert rc == 0 and validated["subcommand"] == "validate"
    assert abs(validated["metrics"]["val/acc"] - result["metrics"]["val/acc"]) < 0.02
    assert model.hparams.arch == "digits_cnn"
