import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("PYTHONHASHSEED", "0")

#: `pytest -m quick`: a cross-section of the CPU suite that runs in under 3 minutes on 2 cores (README): the command
#: line and its refusals, the quickstart recipe and its README resume, the precision engine, the kernels' CPU
#: references, the fused optimizers, checkpoints and resume.  An entry is a test file or a file::test prefix; tests
#: marked slow or cuda are never quick.
QUICK = (
    "tests/test_cli.py",
    "tests/cli/test_doctor_numerics.py",
    "tests/test_imports.py",
    "tests/test_recipes.py::test_print_config",
    "tests/test_recipes.py::test_the_readme_resume_lines_resume_the_quickstart",
    "tests/test_recipes.py::test_two_synthetic_steps_on_cpu[quickstart]",
    "tests/precision/test_loss_scaler.py",
    "tests/precision/test_list_grammar.py",
    "tests/precision/test_master.py",
    "tests/precision/test_fallback.py",
    "tests/precision/test_plugin.py",
    "tests/ops/test_norm_reference.py",
    "tests/ops/test_softmax_reference.py",
    "tests/ops/test_multi_tensor_reference.py",
    "tests/optim/test_fused_optim.py",
    "tests/test_checkpoint.py",
    "tests/test_last_checkpoint.py",
    "tests/callbacks/test_resume_state.py",
)


def pytest_collection_modifyitems(config, items):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for item in items:
        path = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        node = path + "::" + item.nodeid.split("::", 1)[-1] if "::" in item.nodeid else path
        if any(node == q or node.startswith(q if "::" in q else q + "::") for q in QUICK) and \
                not any(item.get_closest_marker(m) for m in ("slow", "cuda", "multi_gpu")):
            item.add_marker(pytest.mark.quick)


@pytest.fixture(autouse=True)
def _chdir_tmp(tmp_path, monkeypatch):
    """Every test writes its logs and checkpoints under its own temp dir."""
    monkeypatch.chdir(tmp_path)
    yield
