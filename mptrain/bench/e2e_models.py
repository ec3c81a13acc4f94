"""The models and data of the end-to-end benchmarks (`mptrain bench e2e` and `mptrain bench ddp`):
ResNet-50 (``mptrain.models.ImageClassifier``) and BERT-base masked LM (``mptrain.models.BertMLM``), trained on
synthetic batches made once on the device, so the input pipeline is not measured.

``quick=True`` shrinks both (ResNet-18 on 16x16 images, a 2-layer BERT) for CPU smoke tests."""
from __future__ import annotations

from typing import Callable, Iterator

import lightning as L
import torch

MODELS = ("resnet50", "bert")
#: per-GPU batch of the published measurements (docs/PERFORMANCE.md, "End to end")
BATCH = {"resnet50": 256, "bert": 128}
SEQ_LEN, MAX_PREDICTIONS, MASK_PROB = 128, 20, 0.15
QUICK = {"batch": 2, "image_size": 16, "seq_len": 16, "vocab": 1000,
         "bert": dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)}


class DeviceBatches:
    """``steps`` batches cycled from ``distinct`` random batches made once on the device (an
    iterable Lightning takes as a train loader; its length bounds the epoch)."""

    def __init__(self, make: Callable[[torch.Generator], object], steps: int, device: str, distinct: int = 4,
                 seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.batches = [make(g) for _ in range(distinct)]
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator:
        return (self.batches[i % len(self.batches)] for i in range(self.steps))


def image_batches(batch: int, steps: int, device: str, image_size: int = 224, num_classes: int = 1000,
                  seed: int = 0) -> DeviceBatches:
    """Normal images in channels_last (the layout every ResNet case trains in) and class labels."""
    def make(g):
        x = torch.randn(batch, 3, image_size, image_size, generator=g, device=device)
        y = torch.randint(0, num_classes, (batch,), generator=g, device=device)
        return x.contiguous(memory_format=torch.channels_last), y
    return DeviceBatches(make, steps, device, seed=seed)


def mlm_batches(batch: int, steps: int, device: str, seq_len: int = SEQ_LEN, vocab: int = 30522,
                seed: int = 0) -> DeviceBatches:
    """Random token ids; ~15% of the positions carry a label (the rest -100), as BERT's masking."""
    def make(g):
        ids = torch.randint(5, vocab, (batch, seq_len), generator=g, device=device)
        picked = torch.rand(batch, seq_len, generator=g, device=device) < MASK_PROB
        return {"input_ids": ids, "labels": torch.where(picked, ids, torch.full_like(ids, -100))}
    return DeviceBatches(make, steps, device, seed=seed)


def build(model: str, steps: int, device: str, quick: bool = False, batch: int | None = None, seed: int = 0,
          stock: bool = False):
    """(LightningModule, train batches, batch size) of one benchmark model (its optimizer is set by
    :func:`use_optimizer`); ``stock`` keeps torch's own modules (no mptrain fused LayerNorm, max-pool
    or stem padding): the model a plain Lightning user trains."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; valid: {', '.join(MODELS)}")
    from mptrain.models import BertMLM, ImageClassifier

    batch = batch or (QUICK["batch"] if quick else BATCH[model])
    if model == "resnet50":
        size = QUICK["image_size"] if quick else 224
        module = ImageClassifier("resnet18" if quick else "resnet50", num_classes=1000, fused=not stock)
        return module, image_batches(batch, steps, device, size, seed=seed), batch
    vocab = QUICK["vocab"] if quick else 30522
    module = BertMLM(vocab_size=vocab, max_predictions=MAX_PREDICTIONS, fused_layernorm=not stock,
                     **(QUICK["bert"] if quick else {}))
    seq_len = QUICK["seq_len"] if quick else SEQ_LEN
    return module, mlm_batches(batch, steps, device, seq_len, vocab, seed=seed), batch


def use_optimizer(module: L.LightningModule, make: Callable) -> L.LightningModule:
    """Make ``configure_optimizers`` return ``make(params)`` (no scheduler): every case of a
    model steps the same algorithm, only the implementation differs."""
    module.configure_optimizers = lambda: make([p for p in module.parameters() if p.requires_grad])
    return module


def compile_lightning_module(module: L.LightningModule, **compile_kwargs) -> L.LightningModule:
    """Lightning's own idiom, ``trainer.fit(torch.compile(module))``: Lightning unwraps it and
    runs the module with its ``forward`` compiled (both benchmark models compute in forward)."""
    return torch.compile(module, **compile_kwargs)


def make_trainer(kind: str, precision: str, callback: "L.Callback | list[L.Callback]", max_steps: int,
                 mptrain_kwargs: dict, **kwargs):
    """A ``lightning.Trainer`` (``kind="lightning"``) or ``mptrain.Trainer`` that trains ``max_steps``
    steps under ``callback`` (one or a list) and nothing else (no logger, checkpoints, validation or progress
    bar); ``mptrain_kwargs`` go to mptrain's alone, ``kwargs`` to both."""
    callbacks = list(callback) if isinstance(callback, (list, tuple)) else [callback]
    common = dict(max_steps=max_steps, max_epochs=1, logger=False, enable_progress_bar=False,
                  enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                  limit_val_batches=0, callbacks=callbacks, precision=precision, **kwargs)
    if kind == "lightning":
        return L.Trainer(**common)
    from mptrain import Trainer

    return Trainer(**common, **mptrain_kwargs)
