"""Lightning's own test suite under ``mptrain.Trainer``: which tests pass with the stock Trainer and fail with ours.

Extracts Lightning's ``tests/tests_pytorch`` and ``tests/legacy`` at a tag from a local git mirror of
pytorch-lightning into a work folder, writes the ``local`` legacy checkpoint with the stock Trainer, runs the selected
test files with pytest twice (stock; then with ``Trainer`` rebound to ``mptrain.Trainer`` in ``lightning``,
``lightning.pytorch``, ``lightning.pytorch.trainer`` and ``lightning.pytorch.trainer.trainer`` by a pytest plugin
loaded before any test module) and prints the per-test diff: passing stock, not passing under mptrain.

    python dev/lightning_conformance.py --repo /path/to/pytorch-lightning.git              # the full selection
    python dev/lightning_conformance.py --repo ... trainer/test_trainer.py -k pickle       # a subset while iterating
    python dev/lightning_conformance.py --repo ... --only mptrain loops/                   # one side only

Never imported by mptrain.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

# the selection: paths under tests/tests_pytorch (the legacy file runs its 'local' cases only, see _PLUGIN)
SELECTION = [
    "checkpointing/test_checkpoint_callback_frequency.py",
    "checkpointing/test_model_checkpoint.py",
    "checkpointing/test_torch_saving.py",
    "checkpointing/test_trainer_checkpoint.py",
    "checkpointing/test_legacy_checkpoints.py",
    "trainer/connectors/test_checkpoint_connector.py",
    "loops",
    "trainer/test_trainer.py",
    "callbacks/test_early_stopping.py",
    "callbacks/test_lr_monitor.py",
    "callbacks/test_finetuning_callback.py",
    "callbacks/test_timer.py",
    "plugins/precision",
    "trainer/optimization",
]

# loaded with -p before conftest.py and the test modules import lightning's Trainer
_PLUGIN = '''
import os

import pytest


def pytest_configure(config):
    if os.environ.get("CONFORMANCE_TRAINER") == "mptrain":
        import lightning
        import lightning.pytorch
        import lightning.pytorch.trainer
        import lightning.pytorch.trainer.trainer
        import mptrain

        for module in (lightning, lightning.pytorch, lightning.pytorch.trainer, lightning.pytorch.trainer.trainer):
            module.Trainer = mptrain.Trainer


def pytest_collection_modifyitems(config, items):
    # legacy checkpoints: only the one this Lightning writes (the released ones are not in the repository)
    keep = [item for item in items if "test_legacy_checkpoints" not in item.nodeid or "[local" in item.nodeid]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
'''


def extract(repo: str, tag: str, work: Path) -> Path:
    """``tests/`` of Lightning at ``tag`` under ``work``, extracted once; returns the tests root."""
    root = work / f"lightning-{tag}"
    tests = root / "tests"
    if not (tests / "tests_pytorch").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", f"--git-dir={repo}", "archive", tag, "tests/tests_pytorch", "tests/legacy"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (tests / "conformance_plugin.py").write_text(_PLUGIN)
    return tests


def write_local_legacy_checkpoint(tests: Path) -> None:
    """The 'local' case of test_legacy_checkpoints reads tests/legacy/checkpoints/local/*.ckpt, written by stock
    Lightning with the script Lightning's CI runs (tests/legacy/generate_checkpoints.sh: train, then move the
    checkpoints up out of lightning_logs and drop the logs)."""
    folder = tests / "legacy" / "checkpoints" / "local"
    if not list(folder.glob("*.ckpt")):
        print(f"writing the 'local' legacy checkpoint into {folder}", flush=True)
        if not list(folder.glob("lightning_logs/version_0/checkpoints/*.ckpt")):
            subprocess.run([sys.executable, str(tests / "legacy" / "simple_classif_training.py"), "local"], cwd=tests,
                           env=dict(os.environ, PYTHONPATH=str(tests)), check=True, capture_output=True)
        for ckpt in folder.glob("lightning_logs/version_0/checkpoints/*.ckpt"):
            ckpt.rename(folder / ckpt.name)
    shutil.rmtree(folder / "lightning_logs", ignore_errors=True)
    shutil.copy(tests / "legacy" / "simple_classif_training.py", folder)


def run(tests: Path, trainer: str, paths: list[str], extra: list[str], timeout: int) -> dict[str, str]:
    """pytest over ``paths``; returns ``{test id: passed|failed|skipped}``."""
    report = tests / f"report-{trainer}.xml"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conformance_plugin",
               f"--timeout={timeout}", f"--junitxml={report}", "-o", "junit_family=xunit1",
               *[f"tests_pytorch/{p}" for p in paths], *extra]
    env = dict(os.environ, PYTHONPATH=str(tests), CONFORMANCE_TRAINER=trainer)
    print(f"== {trainer}: {' '.join(command[3:])}", flush=True)
    log = tests / f"log-{trainer}.txt"
    with open(log, "w") as out:
        subprocess.run(command, cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT)
    print(f"   log: {log}", flush=True)
    results = parse(report) if report.exists() else {}
    # every run's results are kept, by test: --only mptrain compares with the stock results of the same tests
    merged = tests / f"results-{trainer}.json"
    known = json.loads(merged.read_text()) if merged.exists() else {}
    merged.write_text(json.dumps({**known, **results}, indent=0, sort_keys=True))
    return results


def parse(report: Path) -> dict[str, str]:
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            results[name] = "failed"
        elif "skipped" in kinds:
            results[name] = "skipped"
        else:
            results[name] = "passed"
    return results


def counts(results: dict[str, str]) -> str:
    c = {k: sum(v == k for v in results.values()) for k in ("passed", "failed", "skipped")}
    return f"{len(results)} tests: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", help="paths under tests/tests_pytorch (default: the selection)")
    parser.add_argument("--repo", default="/work/.mirror/Lightning-AI+pytorch-lightning/repo",
                        help="a git dir of pytorch-lightning holding the tag")
    parser.add_argument("--tag", default="2.6.5")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "mptrain-lightning-conformance"))
    parser.add_argument("--only", choices=("stock", "mptrain"), help="run one side only")
    parser.add_argument("--timeout", type=int, default=300, help="pytest-timeout per test, seconds")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    args = parser.parse_args()
    tests = extract(args.repo, args.tag, Path(args.work))
    paths = args.paths or SELECTION
    extra = ["-k", args.keyword] if args.keyword else []
    if any("legacy" in p for p in paths):
        write_local_legacy_checkpoint(tests)
    sides = [args.only] if args.only else ["stock", "mptrain"]
    results = {side: run(tests, side, paths, extra, args.timeout) for side in sides}
    if args.only == "mptrain" and (tests / "results-stock.json").exists():  # compare with earlier stock runs
        stock = json.loads((tests / "results-stock.json").read_text())
        results = {"stock": {t: r for t, r in stock.items() if t in results["mptrain"]}, **results}
    for side, result in results.items():
        print(f"{side}: {counts(result)}")
    if len(results) == 2:
        stock, ours = results["stock"], results["mptrain"]
        regressions = sorted(t for t, r in stock.items() if r == "passed" and ours.get(t) != "passed")
        fixed = sorted(t for t, r in ours.items() if r == "passed" and stock.get(t) != "passed")
        print(f"passing stock, not under mptrain: {len(regressions)}")
        for test in regressions:
            print(f"  {ours.get(test, 'missing')}: {test}")
        if fixed:
            print(f"passing under mptrain only: {len(fixed)}")
            for test in fixed:
                print(f"  {test}")
    else:
        side, result = next(iter(results.items()))
        for test in sorted(t for t, r in result.items() if r == "failed"):
            print(f"  failed: {test}")


if __name__ == "__main__":
    main()
