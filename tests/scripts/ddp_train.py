"""Launched by tests/test_distributed.py under torchrun (or alone): train and dump the weights."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _models import Classifier, classification_data, mlp  # noqa: E402
from mptrain import Trainer  # noqa: E402

out, devices, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = Classifier(mlp(), lr=0.05, optimizer="sgd")  # SGD: differences stay proportional to grad noise
loader = torch.utils.data.DataLoader(classification_data(n=128), batch_size=batch, shuffle=False)
trainer = Trainer(precision="bf16-master", max_epochs=2, accumulate_grad_batches=2, accelerator="cpu",
                  devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
                  enable_progress_bar=False, enable_checkpointing=False)
trainer.fit(model, loader)
prec = trainer._precision
weights = {n: prec.master_of.get(id(p), p).detach().clone() for n, p in model.named_parameters()}
ddp = getattr(trainer._wrapped, "_forward_module", None)
ddp_flags = {k: getattr(ddp, k, None) for k in ("gradient_as_bucket_view", "broadcast_buffers")}
torch.save({"weights": weights, "world_size": trainer.world_size, "steps": trainer.global_step, "ddp": ddp_flags},
           f"{out}.rank{trainer.global_rank}.pt")
