"""Host time of the training-step machinery alone, on the CPU (lab tool, not shipped).

    python3 dev/host_step_cpu.py [--steps 200]

A model with BERT-base's parameter layout (202 tensors: 12 layers of 6 Linear + 2 LayerNorm,
embeddings, head) but 8-wide, batch 2: its compute is negligible, and the multi-tensor
kernels are replaced by no-ops, so what is timed is Lightning's loop, the precision plugin and
the optimizer's Python.  Cases: mptrain bf16-master, Lightning bf16-true + FusedAdamW(master),
mptrain bf16-mixed, Lightning bf16-mixed (torch AdamW, foreach=False); ``mptrain:<mode>:nofallback``
runs with ``fp32_fallback=[]``.  ``--repeat N`` runs the cases N times in alternating order and
prints each case's best against the last case's.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import lightning as L
import torch
from torch import nn

torch.set_num_threads(1)
Norm = nn.LayerNorm  # --fused-norm: mptrain.nn.FusedLayerNorm (what the BERT recipe trains)


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = Norm(d), Norm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1) @ self.v(x)
        x = self.ln1(x + self.o(a))
        return self.ln2(x + self.down(torch.nn.functional.gelu(self.up(x))))


class Net(L.LightningModule):
    def __init__(self, d=8, layers=12, vocab=64):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(16, d)
        self.ln = Norm(d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)
        self.opt = None

    def training_step(self, batch, batch_idx):
        ids = batch
        x = self.ln(self.emb(ids) + self.pos.weight[: ids.shape[1]])
        for layer in self.layers:
            x = layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1).float(), ids.flatten())

    def configure_optimizers(self):
        return self.opt(self.parameters())


def stub_kernels():
    """The fused optimizer's CPU references become no-ops: only the Python around them is timed."""
    from mptrain.ops import reference

    for name in ("multi_tensor_adam", "multi_tensor_scale", "multi_tensor_l2norm", "multi_tensor_check_finite"):
        if hasattr(reference, name):
            real = getattr(reference, name)
            if name == "multi_tensor_l2norm":
                setattr(reference, name, lambda tensors, *a, **k: (torch.zeros(()), None))
            else:
                setattr(reference, name, lambda *a, **k: None)


def run(case, steps, prof):
    from mptrain.optim import FusedAdamW

    kind, precision, *flags = case.split(":")
    model = Net()
    if kind == "lightning" and precision == "bf16-mixed":
        model.opt = lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False)
    else:
        model.opt = lambda p: FusedAdamW(p, lr=1e-3, master_weights=kind == "lightning")
    data = torch.randint(0, 64, (steps + 20, 2, 8))
    common = dict(accelerator="cpu", devices=1, max_steps=steps + 20, logger=False, enable_progress_bar=False,
                  enable_checkpointing=False, enable_model_summary=False)

    class T(L.Callback):
        def on_train_batch_end(self, trainer, *a):
            if trainer.global_step == 20:
                self.t0 = time.perf_counter()
                prof and prof.enable()
            elif trainer.global_step == steps + 20:
                prof and prof.disable()
                self.ms = (time.perf_counter() - self.t0) * 1e3 / steps

    cb = T()
    if kind == "lightning":
        trainer = L.Trainer(precision=precision, callbacks=[cb], **common)
    else:
        from mptrain import Trainer

        extra = {"fp32_fallback": []} if "nofallback" in flags else {}
        trainer = Trainer(precision=precision, callbacks=[cb], **extra, **common)
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(list(data), batch_size=None))
    return cb.ms


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--cases", default="mptrain:bf16-master,lightning:bf16-true,mptrain:bf16-mixed,lightning:bf16-mixed")
    p.add_argument("--profile", default=None, help="case to cProfile")
    p.add_argument("--fused-norm", action="store_true", help="mptrain.nn.FusedLayerNorm in every case")
    p.add_argument("--repeat", type=int, default=1, help="runs of every case, alternating; then the best of each")
    a = p.parse_args(argv)
    if a.fused_norm:
        global Norm
        from mptrain.nn import FusedLayerNorm as Norm
    stub_kernels()
    cases, best = a.cases.split(","), {}
    for r in range(a.repeat):
        for case in cases if r % 2 == 0 else cases[::-1]:  # alternating order: drift moves every case alike
            prof = cProfile.Profile() if a.profile == case and r == 0 else None
            ms = run(case, a.steps, prof)
            best[case] = min(ms, best.get(case, ms))
            print(f"{case:24} {ms:7.3f} ms/step (host)", flush=True)
            if prof:
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if a.repeat > 1:
        base = best[cases[-1]]
        for case in cases:
            print(f"best of {a.repeat}: {case:24} {best[case]:7.3f} ms/step, {best[case] / base:.3f}x {cases[-1]}")


if __name__ == "__main__":
    sys.exit(main())
