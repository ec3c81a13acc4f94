"""Launched by tests/test_distributed.py: 2-rank gloo DDP on the CPU, Lightning's own launcher.

Rank 1 alone gets an inf loss at global step 1; every rank must skip that step.  Each rank
dumps what a checkpoint of it would hold (fp32 weights) and its skip count, one fit per precision
given (comma-separated: one launch, one pair of imports, for all of them).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _models import Classifier, classification_data, mlp  # noqa: E402

from mptrain import Trainer  # noqa: E402

out, precisions = sys.argv[1], sys.argv[2].split(",")


class InfOnRankOne(Classifier):
    def training_step(self, batch, batch_idx):
        self.inf_at_steps = {1} if self.global_rank == 1 else set()
        return super().training_step(batch, batch_idx)


for precision in precisions:
    torch.manual_seed(0)
    model = InfOnRankOne(mlp(dropout=0.1), lr=0.05, optimizer="sgd")
    loader = torch.utils.data.DataLoader(classification_data(n=128), batch_size=8, shuffle=True)
    trainer = Trainer(precision=precision, max_epochs=2, accumulate_grad_batches=2, accelerator="cpu", devices=2,
                      strategy="ddp", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, seed=0)
    trainer.fit(model, loader)
    state = trainer._checkpoint_connector.dump_checkpoint()
    torch.save({"weights": state["state_dict"], "world_size": trainer.world_size, "steps": trainer.global_step,
                "skipped": trainer.skipped_steps, "losses": torch.stack(model.losses)},
               f"{out}-{precision}.rank{trainer.global_rank}.pt")
# gloo threads left to the interpreter's teardown can abort the process at exit
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
