"""``mptrain`` on LightningCLI: every config mistake is one line, exit 2, no traceback and no
file created; a class_path of the wrong kind never runs; LightningCLI's own features work."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mptrain.cli import ConfigError, main

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "recipes" / "quickstart.yaml")
TINY = ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty current directory: recipes write under ./runs, so any created file shows."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    return tmp_path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def assert_config_error(capsys, workdir, argv, *expected: str) -> str:
    before = files_under(workdir)
    rc, out, err = run(capsys, *argv)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("Seed set")]
    assert rc == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("mptrain"), err
    assert "Traceback" not in out + err
    for text in expected:
        assert text in lines[0], lines[0]
    assert files_under(workdir) == before, files_under(workdir) - before
    return lines[0]


MISTAKES = {
    "max_steps": (["--trainer.max_steps=-5"], "trainer.max_steps", "-5", ">= 0"),
    "max_epochs_forever": (["--trainer.max_epochs=-1", "--trainer.max_steps=-1"], "trainer.max_epochs=-1", "max_steps"),
    "accumulate": (["--trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches", ">= 1"),
    "clip": (["--trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val", ">= 0"),
    "batch_size": (["--data.batch_size=0"], "data.batch_size", ">= 1"),
    "lr": (["--model.lr=-1"], "model.lr", "> 0"),
    "arch": (["--model.arch=digits_cnnn"], "digits_cnnn", "digits_cnn", "resnet50"),
    "scaler_key": (["--trainer.loss_scaler={init_scal: 2}"], "init_scal", "init_scale"),
    "scaler_value": (["--trainer.loss_scaler={init_scale: -2}"], "init_scale=-2", "> 0"),
    "fallback_op": (["--trainer.fp32_fallback=[softmaxx]"], "softmaxx", "softmax"),
    "precision": (["--trainer.precision=bf16-mastr"], "bf16-mastr", "bf16-master"),
    "unknown_trainer_key": (["--trainer.max_stepz=3"], "trainer.max_stepz", "Did you mean 'max_steps'"),
    "unknown_model_key": (["--model.lrr=3"], "model.lrr", "Did you mean 'lr'"),
    "unknown_top_key": (["--max_steps=3"], "max_steps"),
    "ckpt_missing": (["--ckpt_path=missing.ckpt"], "missing.ckpt", "does not exist"),
    "reference": (["--trainer.logger.init_args.save_dir=${data.data_dir}/logs"], "trainer.logger.init_args.save_dir",
                  "${data.data_dir}", "${trainer.default_root_dir}"),
    "data_dir_missing": (["--data=mptrain.data.LMTextDataModule", "--data.data_dir=no/corpus",
                          "--model=mptrain.models.LSTMLanguageModel"], "data.data_dir='no/corpus'", "synthetic=true"),
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_config_mistake_is_one_line_exit_2_and_creates_nothing(case, workdir, capsys):
    argv, *expected = MISTAKES[case]
    assert_config_error(capsys, workdir, ["fit", "--config", QUICK, *TINY, *argv], *expected)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU machine")
def test_gpu_accelerator_without_a_gpu(workdir, capsys):
    assert_config_error(capsys, workdir, ["fit", "--config", QUICK, "--trainer.accelerator=gpu"],
                        "trainer.accelerator", "'gpu'", "cpu")


def test_missing_ckpt_path_for_validate(workdir, capsys):
    assert_config_error(capsys, workdir, ["validate", "--config", QUICK, "--ckpt_path=nope/last.ckpt"],
                        "validate --ckpt_path='nope/last.ckpt'", "does not exist")


RECIPE_FILES = {
    "tabs": (b"trainer:\n\tmax_steps: 2\n", "line 2", "tab"),
    "syntax": (b"trainer: {max_steps: 2\nmodel: [\n", "YAML syntax error", "line"),
    "binary": (bytes(range(256)) * 4, "binary content"),
    "python_tag": (b"trainer:\n  callbacks: !!python/object/apply:os.system ['touch FLAG']\n", "line 2", "Python tag"),
    "not_a_mapping": (b"- 1\n- 2\n", "YAML mapping"),
}


@pytest.mark.parametrize("case", list(RECIPE_FILES))
def test_bad_recipe_file_is_one_line(case, workdir, capsys):
    content, *expected = RECIPE_FILES[case]
    path = workdir / f"{case}.yaml"
    path.write_bytes(content)
    assert_config_error(capsys, workdir, ["fit", "--config", str(path)], f"{case}.yaml", *expected)
    assert not (workdir / "FLAG").exists()


def test_error_in_setup_before_any_loop_is_one_line(workdir, capsys, monkeypatch):
    from mptrain.models import ImageClassifier

    def broken(self):
        raise ValueError("model.optimizer settings cannot work here")

    monkeypatch.setattr(ImageClassifier, "configure_optimizers", broken)
    rc, out, err = run(capsys, "fit", "--config", QUICK, *TINY)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err
    assert lines[-1] == "mptrain fit: error: during fit setup: model.optimizer settings cannot work here"


@pytest.mark.parametrize("text, expected", [("trainer:\n  max_stepz: 3\n", "Did you mean 'max_steps'"),
                                            ("trainerr:\n  max_steps: 3\n", "Did you mean 'trainer'"),
                                            ("model:\n  init_args:\n    lrr: 3\n", "Did you mean 'lr'")])
def test_unknown_key_in_a_recipe_file(text, expected, workdir, capsys):
    extra = workdir / "extra.yaml"
    extra.write_text(text)
    assert_config_error(capsys, workdir, ["fit", "--config", QUICK, "--config", str(extra)], "unknown key", expected)


def test_missing_recipe_file(workdir, capsys):
    assert_config_error(capsys, workdir, ["fit", "--config", "nowhere.yaml"], "nowhere.yaml", "cannot read")


CODE_FROM_YAML = {
    "function": "{class_path: os.system, init_args: {command: 'touch FLAG'}}",
    "non_callback_class": "{class_path: subprocess.Popen, init_args: {args: [touch, FLAG]}}",
}


@pytest.mark.parametrize("case", list(CODE_FROM_YAML))
def test_class_path_of_the_wrong_kind_never_runs(case, workdir, capsys):
    recipe = workdir / "evil.yaml"
    recipe.write_text(Path(QUICK).read_text() + "\n# appended\n")
    evil = workdir / "evil_override.yaml"
    evil.write_text(f"trainer:\n  callbacks:\n  - {CODE_FROM_YAML[case]}\n")
    line = assert_config_error(capsys, workdir, ["fit", "--config", str(recipe), "--config", str(evil), *TINY],
                               "trainer.callbacks[0].class_path", "refused", "Callback")
    assert not (workdir / "FLAG").exists(), line


def test_class_path_of_the_wrong_kind_for_the_logger_and_model(workdir, capsys):
    assert_config_error(capsys, workdir, ["fit", "--config", QUICK, "--trainer.logger={class_path: subprocess.Popen, "
                                          "init_args: {args: [touch, FLAG]}}"], "trainer.logger", "subprocess.Popen")
    assert not (workdir / "FLAG").exists()


def test_tiny_fit_writes_into_its_own_version_dir(workdir, capsys):
    dirs = []
    for _ in range(2):
        rc, out, err = run(capsys, "fit", "--config", QUICK, *TINY, "--trainer.log_every_n_steps=1")
        assert rc == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["subcommand"] == "fit" and result["global_step"] == 2
        log_dir = Path(result["log_dir"])
        assert (log_dir / "config.yaml").is_file() and (log_dir / "metrics.csv").is_file()
        dirs.append(log_dir)
    assert dirs[0] != dirs[1] and dirs[0].parent == dirs[1].parent  # version_0, version_1: nothing overwritten


def test_default_root_dir_decides_where_a_recipe_run_writes(workdir, capsys):
    """logs (metrics.csv), config.yaml and checkpoints under --trainer.default_root_dir, nothing elsewhere; the
    saved config keeps the reference, so it follows the flag when run again."""
    root = workdir / "elsewhere" / "exp1"
    rc, out, err = run(capsys, "fit", "--config", QUICK, *TINY, "--trainer.log_every_n_steps=1",
                       "--trainer.checkpoint_every_n_steps=1", f"--trainer.default_root_dir={root}")
    assert rc == 0, err[-3000:]
    log_dir = Path(json.loads(out.strip().splitlines()[-1])["log_dir"])
    assert log_dir.parent.parent == root  # root/lightning_logs/version_0
    assert (log_dir / "metrics.csv").is_file() and list((log_dir / "checkpoints").glob("*.ckpt"))
    assert all(p.startswith("elsewhere") for p in files_under(workdir)), sorted(files_under(workdir))
    import yaml

    saved = yaml.safe_load((log_dir / "config.yaml").read_text())["trainer"]
    assert saved["default_root_dir"] == str(root)
    assert saved["logger"]["init_args"]["save_dir"] == "${trainer.default_root_dir}"


def test_recipe_root_by_default_and_an_explicit_logger_dir_is_kept(workdir, capsys):
    rc, out, err = run(capsys, "fit", "--config", QUICK, *TINY)
    assert rc == 0, err[-3000:]
    assert Path(json.loads(out.strip().splitlines()[-1])["log_dir"]) == Path("runs/quickstart/lightning_logs/version_0")
    rc, out, err = run(capsys, "fit", "--config", QUICK, *TINY, "--trainer.default_root_dir=root",
                       "--trainer.logger.init_args.save_dir=mine")
    assert rc == 0, err[-3000:]
    assert Path(json.loads(out.strip().splitlines()[-1])["log_dir"]) == Path("mine/lightning_logs/version_0")


def test_tensorboard_files_land_in_the_printed_log_dir(workdir, capsys):
    rc, out, err = run(capsys, "fit", "--config", QUICK, *TINY, "--trainer.log_every_n_steps=1",
                       "--trainer.logger={class_path: lightning.pytorch.loggers.TensorBoardLogger, "
                       "init_args: {save_dir: tb}}")
    assert rc == 0, err[-3000:]
    log_dir = Path(json.loads(out.strip().splitlines()[-1])["log_dir"])
    assert log_dir.resolve().is_relative_to((workdir / "tb").resolve())
    assert list(log_dir.glob("events.out.tfevents.*")), sorted(files_under(workdir))


def test_help_print_config_model_help_and_class_switch(workdir, capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and all(c in out for c in ("fit", "validate", "test", "predict", "doctor", "numerics", "bench"))
    rc, out, _ = run(capsys, "fit", "--help")
    assert rc == 0 and "--trainer.precision" in out and "--trainer.fp32_finetune_epochs" in out
    rc, out, _ = run(capsys, "fit", "--config", QUICK, "--model.help", "mptrain.models.ImageClassifier")
    assert rc == 0 and "--model.lr" in out and "--model.arch" in out
    rc, out, _ = run(capsys, "fit", "--config", QUICK, "--trainer.max_steps=7", "--print_config")
    assert rc == 0 and "max_steps: 7" in out and "class_path: mptrain.models.ImageClassifier" in out
    rc, out, err = run(capsys, "fit", "--config", QUICK, "--model=mptrain.models.LSTMLanguageModel",
                       "--model.vocab_size=50", "--print_config")
    assert rc == 0, err
    assert "class_path: mptrain.models.LSTMLanguageModel" in out and "arch:" not in out
    assert files_under(workdir) == set()


def test_tools_share_the_flag_style(workdir, capsys):
    rc, out, _ = run(capsys, "numerics", "--help")
    assert rc == 0 and "--max_samples" in out and "--config" in out
    rc, out, _ = run(capsys, "doctor", "--help")
    assert rc == 0 and "--json" in out
    line = assert_config_error(capsys, workdir, ["numerics", "--config", QUICK, "--max_sampels=3"], "max_sampels")
    assert "max_samples" in line
    assert_config_error(capsys, workdir, ["bench", "nope"], "nope", "gemm")
    rc, out, _ = run(capsys, "bench", "gemm", "--help")  # the benchmark's own parser
    assert rc == 0 and "--json" in out


@pytest.mark.slow  # a subprocess: a whole start-up
def test_python_dash_m_is_the_same_program(workdir):
    r = subprocess.run([sys.executable, "-m", "mptrain", "fit", "--config", QUICK, "--trainer.max_steps=-5"],
                       capture_output=True, text=True, cwd=workdir, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("mptrain fit: error: invalid value for 'trainer.max_steps'")


def test_class_paths_are_checked_in_lists_init_args_and_by_annotation():
    from mptrain import Trainer
    from mptrain.cli.class_paths import check_class_paths

    early_stop = {"class_path": "lightning.pytorch.callbacks.EarlyStopping", "init_args": {"monitor": "val/loss"}}
    check_class_paths({"trainer": {"callbacks": [early_stop], "max_time": {"class_path": "datetime.timedelta"}}}, Trainer)
    with pytest.raises(ConfigError, match=r"trainer.max_time.class_path='os.system' is refused.*datetime.timedelta"):
        check_class_paths({"trainer": {"max_time": {"class_path": "os.system"}}}, Trainer)
    lambda_cb = {"class_path": "lightning.pytorch.callbacks.LambdaCallback",
                 "init_args": {"on_fit_start": {"class_path": "os.system"}}}  # typed Callable: no class expected
    with pytest.raises(ConfigError, match=r"callbacks\[0\].init_args.on_fit_start' does not declare"):
        check_class_paths({"trainer": {"callbacks": [lambda_cb]}}, Trainer)


def test_root_reference_anywhere_and_default_logger_dirs_follow_the_root_and_are_restored():
    """mptrain.cli.run_dir on a parsed config: ${trainer.default_root_dir} in any string (a callback's dirpath, a
    logger in a list), a WandbLogger left at save_dir='.' without dir; an explicit path and `dir` are kept; the
    config as given comes back after the classes are built."""
    from jsonargparse import Namespace

    from mptrain.cli.run_dir import place_run_under_root

    def wandb(**init_args):
        return Namespace(class_path="lightning.pytorch.loggers.WandbLogger",
                         init_args=Namespace(**{"save_dir": ".", "dir": None, **init_args}))

    config = Namespace(trainer=Namespace(
        default_root_dir="exp", logger=[wandb(), wandb(dir="mine"), wandb(save_dir="kept"), Namespace(
            class_path="lightning.pytorch.loggers.CSVLogger", init_args=Namespace(save_dir="${trainer.default_root_dir}"))],
        callbacks=[Namespace(class_path="lightning.pytorch.callbacks.ModelCheckpoint",
                             init_args=Namespace(dirpath="${trainer.default_root_dir}/best"))]))
    given = config.clone()
    restore = place_run_under_root(config)
    assert [lg.init_args.save_dir for lg in config.trainer.logger] == ["exp", ".", "kept", "exp"]
    assert config.trainer.callbacks[0].init_args.dirpath == "exp/best"
    restore()
    assert config == given
    config.trainer.default_root_dir = None  # Lightning's default: the current directory
    place_run_under_root(config)
    assert config.trainer.logger[3].init_args.save_dir == "."
    with pytest.raises(ConfigError, match=r"trainer.default_root_dir='\$\{trainer.default_root_dir\}/x'"):
        place_run_under_root(Namespace(trainer=Namespace(default_root_dir="${trainer.default_root_dir}/x")))


def test_nothing_imports_the_cli_and_the_doctor_imports_no_benchmark():
    """cli/ is the top: no module outside it imports it; numerics/ holds the numerics tools only; `mptrain doctor`
    runs on a broken machine, so it imports none of the benchmarks."""
    from test_imports import import_graph

    graph = import_graph()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items()
                    if not m.startswith("mptrain.cli") and m != "mptrain.__main__"  # `python -m mptrain` is the CLI
                    for t in targets if t.startswith("mptrain.cli"))
    assert not upward, upward
    assert "mptrain.cli.doctor" in graph and "mptrain.cli.numerics" in graph
    assert not [t for t in graph["mptrain.cli.doctor"] if t.startswith("mptrain.bench")]


# -- refusals at run time: the config-mistake rule (one line, exit 2, no traceback, nothing written) ----------------

def _damaged_checkpoint(path: Path, how: str) -> Path:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "garbage":
        path.write_bytes(b"not a checkpoint\n" * 8)
    else:  # a real checkpoint cut short, as a killed copy leaves it
        torch.save({"state_dict": {"w": torch.ones(4096)}, "epoch": 0}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU machine")
def test_fp8_master_on_a_cpu_is_refused_and_writes_nothing(workdir, capsys):
    """The refusal comes from the precision plugin's setup, after Lightning created the logger's folder and
    LightningCLI saved config.yaml: the run takes them back."""
    assert_config_error(capsys, workdir, ["fit", "--config", QUICK, *TINY, "--trainer.precision=fp8-master"],
                        "precision='fp8-master'", "cpu", "Use 'bf16-master'")


@pytest.mark.parametrize("how", ["garbage", "truncated"])
def test_a_damaged_ckpt_path_is_refused_before_anything_is_written(how, workdir, capsys):
    _damaged_checkpoint(workdir / "bad.ckpt", how)
    line = assert_config_error(capsys, workdir, ["fit", "--config", QUICK, *TINY, "--ckpt_path=bad.ckpt"],
                               "--ckpt_path='bad.ckpt'", "bad.ckpt", "another checkpoint")
    assert "weights_only=False" not in line


def test_a_damaged_last_checkpoint_is_refused_at_restore_and_the_run_is_taken_back(workdir, capsys):
    """--ckpt_path=last finds the newest last.ckpt only once the run is set up (config.yaml saved, a new version
    folder made): a damaged one is refused and that run's files are removed; the earlier run's stay."""
    _damaged_checkpoint(workdir / "runs/quickstart/lightning_logs/version_0/checkpoints/last.ckpt", "truncated")
    assert_config_error(capsys, workdir, ["fit", "--config", QUICK, *TINY, "--ckpt_path=last"],
                        "--ckpt_path='last'", "last.ckpt", "another checkpoint")
    assert not (workdir / "runs/quickstart/lightning_logs/version_1").exists()


def test_a_missing_optional_extra_names_the_extra(workdir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision raises ImportError
    assert_config_error(capsys, workdir, ["fit", "--config", QUICK, *TINY, "--model.arch=resnet18"],
                        "torchvision", "pip install 'mptrain[vision]'")


def test_numerics_fp8_without_torchao_is_one_line(workdir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    assert_config_error(capsys, workdir, ["numerics", "--config", QUICK, "--fp8=true", "--steps=1"],
                        "torchao", "pip install 'mptrain[fp8]'")


def test_mptrain_traceback_shows_the_refusals_traceback(workdir, capsys, monkeypatch):
    _damaged_checkpoint(workdir / "bad.ckpt", "garbage")
    monkeypatch.setenv("MPTRAIN_TRACEBACK", "1")
    with pytest.raises(ConfigError, match="bad.ckpt") as raised:
        main(["fit", "--config", QUICK, *TINY, "--ckpt_path=bad.ckpt"])
    assert type(raised.value.__cause__).__name__ == "CheckpointError"


def test_an_error_once_a_loop_runs_is_a_failure_with_its_traceback(workdir, capsys, monkeypatch):
    """Only setup refusals become one line: a ValueError from training_step is the run failing, and propagates."""
    from mptrain.models import ImageClassifier

    def broken(self, batch, batch_idx):
        raise ValueError("training_step broke")

    monkeypatch.setattr(ImageClassifier, "training_step", broken)
    with pytest.raises(ValueError, match="training_step broke"):
        main(["fit", "--config", QUICK, *TINY, "--trainer.num_sanity_val_steps=0"])


@pytest.mark.parametrize("flag, key, near", [("--trainer.max_epoch=3", "trainer.max_epoch", "max_epochs"),
                                             ("--trainer.max_step", "trainer.max_step", "max_steps"),
                                             ("--model.l=0.1", "model.l", None)])
def test_abbreviated_flags_are_unknown_keys(flag, key, near, workdir, capsys):
    """argparse would take a prefix of one flag as that flag (--trainer.max_epoch=3 ran as max_epochs=3)."""
    argv = ["fit", "--config", QUICK, *TINY, *flag.split()] + ([] if "=" in flag else ["3"])
    line = assert_config_error(capsys, workdir, argv, f"unknown key {key!r}")
    if near:
        assert f"Did you mean {near!r}" in line


def test_tool_flags_are_not_abbreviated_either(workdir, capsys):
    assert_config_error(capsys, workdir, ["numerics", "--config", QUICK, "--max_sample=3"], "max_sample")
    assert_config_error(capsys, workdir, ["doctor", "--jso=x.json"], "jso")


SHIPPED_BENCHMARKS = ("ddp", "e2e", "fp8", "gemm", "host_cost", "kernels")


def test_bench_help_lists_every_benchmark_the_package_ships(workdir, capsys):
    from mptrain.bench import benchmarks

    assert set(SHIPPED_BENCHMARKS) <= set(benchmarks())
    rc, out, _ = run(capsys, "bench", "--help")
    assert rc == 0 and all(name in out for name in benchmarks())
    assert_config_error(capsys, workdir, ["bench", "fp9"], "unknown benchmark 'fp9'",
                        ", ".join(benchmarks()))


@pytest.mark.parametrize("name", sorted(__import__("mptrain.bench", fromlist=["benchmarks"]).benchmarks()))
def test_each_benchmark_is_reached_and_prints_its_help(name, workdir, capsys):
    rc, out, err = run(capsys, "bench", name, "--help")
    assert rc == 0, err
    assert "usage:" in out and "--" in out
    assert files_under(workdir) == set()
