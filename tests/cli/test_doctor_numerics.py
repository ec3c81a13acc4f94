"""doctor without a GPU, the recommendation logic, and `mptrain numerics --config` on a recipe."""
import json
import textwrap

import pytest
import torch

from mptrain.cli import main
from mptrain.cli.doctor import TENSOR_CORE_MIN_CC, doctor_main, doctor_report, format_doctor, recommend
from mptrain.cli.numerics import batch_to_input, numerics_main

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


@no_gpu
def test_doctor_runs_without_a_gpu(tmp_path, capsys):
    report = doctor_report()
    assert report["gpus"] == [] and report["cuda_available"] is False
    assert "32-true" in report["recommendation"] and "No CUDA GPU" in report["recommendation"]
    assert report["versions"]["torch"] == torch.__version__
    assert report["extension"]["available"] in (False, None)
    text = format_doctor(report)
    assert "GPU: none visible" in text and "recommendation:" in text
    out = tmp_path / "doctor.json"
    assert doctor_main(["--json", str(out), "--build=false"]) == 0
    assert json.loads(out.read_text())["gpus"] == []
    assert "mptrain doctor" in capsys.readouterr().out


def _gpu(name, cc):
    major, minor = cc
    return {"name": name, "capability": f"{major}.{minor}", "index": 0, "memory_gb": 80, "sms": 100, "probes": {},
            "tensor_cores": {k: cc >= v for k, v in TENSOR_CORE_MIN_CC.items()}}


def test_recommendation_follows_the_capability():
    assert "bf16-master" in recommend([_gpu("NVIDIA H200", (9, 0))])
    assert "FP8" in recommend([_gpu("NVIDIA H200", (9, 0))])
    assert "bf16-master" in recommend([_gpu("NVIDIA A100", (8, 0))])
    assert "FP8" not in recommend([_gpu("NVIDIA A100", (8, 0))])
    assert "16-master" in recommend([_gpu("Tesla V100", (7, 0))]) and "bf16" in recommend([_gpu("Tesla V100", (7, 0))])
    assert "32-true" in recommend([_gpu("Tesla P100", (6, 0))])
    failed = _gpu("NVIDIA A100", (8, 0))
    failed["probes"] = {"bf16": {"ok": False, "detail": "RuntimeError"}}
    assert "16-master" in recommend([failed])


def test_tensor_core_table_per_architecture():
    h200 = _gpu("H200", (9, 0))["tensor_cores"]
    assert all(h200.values())
    turing = _gpu("T4", (7, 5))["tensor_cores"]
    assert turing == {"fp16": True, "int8": True, "tf32": False, "bf16": False, "fp8": False}


RECIPE = """
trainer:
  precision: 16-true
model:
  class_path: numerics_recipe_fixtures.TinyClassifier
  init_args:
    hidden: 16
data:
  class_path: numerics_recipe_fixtures.TinyData
  init_args:
    batch_size: 12
"""


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    (tmp_path / "numerics_recipe_fixtures.py").write_text(textwrap.dedent('''
        import lightning as L
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        class TinyClassifier(L.LightningModule):
            def __init__(self, hidden=8):
                super().__init__()
                self.body = nn.Linear(6, hidden)
                self.boom = Boom()
                self.head = nn.Linear(hidden, 3)
            def forward(self, x):
                return self.head(self.boom(self.body(x)))

        class Boom(nn.Module):
            def forward(self, x):
                return x * 1e5

        class TinyData(L.LightningDataModule):
            def __init__(self, batch_size=4):
                super().__init__()
                self.batch_size = batch_size
                self.ready = False
            def setup(self, stage):
                self.ready = True
            def train_dataloader(self):
                assert self.ready, "setup() not called"
                g = torch.Generator().manual_seed(0)
                ds = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
                return DataLoader(ds, batch_size=self.batch_size)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    return path


def test_numerics_cli_runs_the_recipe(recipe, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert numerics_main(["--config", str(recipe), "--json", str(out), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "layerwise fp32 vs 16-true" in text  # the recipe's precision
    last = text.strip().splitlines()[-1]
    assert last.startswith("summary: ") and "worst: boom: creates inf/NaN" in last, last
    data = json.loads(out.read_text())
    assert data["first_bad"] == "boom" and data["worst"][0] == "boom"
    assert numerics_main(["--config", str(recipe), "--precision", "bf16-mixed", "--device", "cpu", "--backward=true"]) == 0
    assert "layerwise fp32 vs bf16-mixed" in capsys.readouterr().out


def test_numerics_cli_reports_bad_recipes(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  class_path: no.such.Module\ndata:\n  class_path: no.such.Data\n")
    assert main(["numerics", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model" in err[0] and "Traceback" not in err[0]
    assert main(["numerics", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_numerics_refuses_a_class_path_of_the_wrong_kind(tmp_path, capsys):
    evil = tmp_path / "evil.yaml"
    evil.write_text(f"model:\n  class_path: subprocess.Popen\n  init_args: {{args: [touch, {tmp_path / 'FLAG'}]}}\n"
                    "data:\n  class_path: mptrain.data.DigitsDataModule\n")
    assert main(["numerics", "--config", str(evil)]) == 2
    assert not (tmp_path / "FLAG").exists()
    assert "subprocess.Popen" in capsys.readouterr().err


def test_batch_to_input():
    lin = torch.nn.Linear(2, 2)
    assert batch_to_input(lin, (torch.ones(2), torch.zeros(2))).sum() == 2
    assert set(batch_to_input(lin, {"input_ids": 1, "labels": 2})) == {"input_ids"}
