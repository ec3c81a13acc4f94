"""2-rank gloo DDP on the CPU: the skip decision is agreed across ranks (all_reduce MAX of found_inf)."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback

from _models import Classifier, classification_data, mlp
from mptrain.callbacks.fp32_finetune import Fp32Finetune
from mptrain.precision import precision_plugin


class NanOnOneRank(Classifier):
    """At step 2, rank 1 only: a NaN that reaches the loss but not the gradients (a detached term).

    DDP's gradient all-reduce cannot spread it: only the found_inf all-reduce makes rank 0 skip too.
    """

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 2 and self.global_rank == 1:
            loss = loss + torch.tensor(float("nan")).detach()
        return loss


class SaveWeights(Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.before = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            self.after_2 = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_end(self, trainer, pl_module):
        torch.save({"weights": [p.detach().clone() for p in pl_module.parameters()],
                    "precision": trainer.precision_plugin.precision,
                    "skipped": trainer.precision_plugin.skipped_steps,
                    "step2_unchanged": all(torch.equal(a, b) for a, b in zip(self.before[2], self.after_2))},
                   f"{self.out_dir}/rank{trainer.global_rank}.pt")


@pytest.mark.slow  # ~50 s on 2 busy cores: two spawned ranks
def test_two_ranks_skip_the_same_step_and_stay_identical(tmp_path, name="bf16-master"):
    """Also: the late switch to fp32 re-wraps DDP for the new dtypes; the ranks stay identical after it."""
    torch.manual_seed(0)
    model = NanOnOneRank(mlp(), lr=0.05, optimizer="sgd")
    t = L.Trainer(plugins=[precision_plugin(name)], strategy="ddp_spawn", devices=2, accelerator="cpu",
                  max_steps=6, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                  enable_model_summary=False, callbacks=[SaveWeights(str(tmp_path)), Fp32Finetune(steps=2)])
    t.fit(model, torch.utils.data.DataLoader(classification_data(n=320), batch_size=16))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["precision"] == r1["precision"] == "32-true"
    assert all(w.dtype == torch.float32 for w in r0["weights"])
    assert r0["step2_unchanged"] and r1["step2_unchanged"]
    for a, b in zip(r0["weights"], r1["weights"]):
        assert torch.equal(a, b)
