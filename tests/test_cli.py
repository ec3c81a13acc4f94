"""The CLI: subcommands, config checking before anything is built, print_config, overrides."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mptrain import PRECISIONS, cli

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if the CLI gets as far as instantiating a model or data module."""
    def boom(*a, **k):
        raise AssertionError("a model or data module was built despite a bad config")

    monkeypatch.setattr(cli, "_instantiate", boom)


def test_help_lists_subcommands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("fit", "validate", "bench", "doctor", "numerics"):
        assert f"  {name}" in out


def test_python_dash_m_is_the_same_program():
    r = subprocess.run([sys.executable, "-m", "mptrain", "--help"], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "fit" in r.stdout and "numerics" in r.stdout


def test_unknown_subcommand_fails(capsys):
    assert cli.main(["train"]) == 2
    assert "valid: fit, validate, bench, doctor, numerics" in capsys.readouterr().err


def test_bench_dispatch_rejects_unknown_benchmark(capsys):
    assert cli.main(["bench", "nosuch"]) == 2
    assert "gemm, kernels, e2e, ddp" in capsys.readouterr().err


def test_bench_dispatch_calls_the_module(monkeypatch):
    seen = {}
    import mptrain.bench.e2e as e2e

    monkeypatch.setattr(e2e, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.main(["bench", "e2e", "--steps", "3"]) == 0
    assert seen["argv"] == ["--steps", "3"]


@pytest.mark.parametrize("override, must_contain", [
    ("--trainer.precision=bf17-mixed", ["'trainer.precision'", "'bf17-mixed'", *PRECISIONS]),
    ("--trainer.max_step=2", ["'trainer.max_step'", "2", "Did you mean 'max_steps'", "max_epochs"]),
    ("--trainer.logger=mlflow", ["'trainer.logger'", "'mlflow'", "csv", "tensorboard", "wandb", "none"]),
    ("--trainer.accelerator=gpux", ["'trainer.accelerator'", "'gpux'", "cpu", "cuda"]),
    ("--model.hiden=3", ["'model.init_args.hiden'", "3", "num_classes"]),
    ("--model.optimizer=adam", ["'model.init_args.optimizer'", "'adam'", "sgd", "adamw"]),
    ("--data.batch_size=x", ["'data.init_args.batch_size'", "'x'", "int"]),
    ("--trainer.max_steps=abc", ["'trainer.max_steps'", "'abc'", "int"]),
    ("--trainerx.foo=1", ["'trainerx'", "trainer", "model", "data"]),
    ("--model=NoSuchModel", ["model.class_path", "NoSuchModel", "ImageClassifier"]),
])
def test_bad_key_or_value_exits_before_building(override, must_contain, capsys, nothing_built):
    rc = cli.main(["fit", "--config", QUICKSTART, override])
    err = capsys.readouterr().err
    assert rc == 2, err
    for text in must_contain:
        assert text in err, f"{text!r} missing from: {err}"


def test_bad_key_in_a_recipe_file(tmp_path, capsys, nothing_built):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(QUICKSTART).read_text().replace("max_epochs: 8", "max_epoch: 8"))
    assert cli.main(["fit", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "'trainer.max_epoch'" in err and "max_epochs" in err


def test_bad_value_fails_the_console_script_with_nonzero_status():
    r = subprocess.run([sys.executable, "-m", "mptrain", "fit", "--config", QUICKSTART, "--trainer.precision=fp8"],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 2
    assert "trainer.precision" in r.stderr and "'fp8'" in r.stderr and "bf16-master" in r.stderr


def test_print_config_applies_overrides(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["fit", "--config", QUICKSTART, "--trainer.precision=32-true", "--data.batch_size=7", "--print_config"])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert "precision: 32-true" in out and "batch_size: 7" in out and "class_path: mptrain.models.ImageClassifier" in out


def test_merge_raw_config_maps_short_overrides_to_init_args(tmp_path):
    raw = cli.merge_raw_config(["--config", QUICKSTART, "--model.lr=0.5", "--trainer.max_steps", "3",
                                "--data=mptrain.data.DigitsDataModule"])
    assert raw["model"]["init_args"]["lr"] == 0.5
    assert raw["trainer"]["max_steps"] == 3
    assert raw["data"]["class_path"] == "mptrain.data.DigitsDataModule"


def test_ckpt_auto_starts_fresh_without_a_checkpoint(tmp_path):
    # --ckpt_path is passed to Trainer.fit as is; "auto" is resolved by the checkpoint module.
    from mptrain.checkpoint import resolve_ckpt_path

    ckpt_dir = tmp_path / "checkpoints"
    assert resolve_ckpt_path("auto", ckpt_dir) is None
    ckpt_dir.mkdir()
    (ckpt_dir / "last.ckpt").write_bytes(b"x")
    assert str(resolve_ckpt_path("auto", ckpt_dir)).endswith("last.ckpt")
    assert resolve_ckpt_path("last", ckpt_dir) == ckpt_dir / "last.ckpt"


def test_jsonargparse_is_not_imported_by_mptrain():
    code = "import sys, mptrain, mptrain.cli, mptrain.bench.e2e; print('jsonargparse' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_runs_a_recipe_without_jsonargparse(tmp_path, monkeypatch, capsys):
    """The GPU machine has no jsonargparse: recipes still run (names and choices still checked)."""
    monkeypatch.setattr(cli, "_has_jsonargparse", lambda: False)
    assert cli.main(["fit", "--config", QUICKSTART, "--trainer.precision=bf17"]) == 2
    rc = cli.main(["fit", "--config", QUICKSTART, "--data.synthetic=true", "--data.batch_size=2",
                   "--trainer.max_steps=2", f"--trainer.default_root_dir={tmp_path}"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert '"global_step": 2' in captured.out and "without type coercion" in captured.err
