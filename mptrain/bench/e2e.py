"""`mptrain bench e2e`: whole training steps of ResNet-50 and BERT-base (seq 128) per precision,
mptrain's Trainer against a plain ``lightning.Trainer`` with the same model and batch, in one
process.

Data are synthetic batches made on the GPU (``data.synthetic``), so the loader is not measured.
Each case builds a fresh model and trainer, runs ``warmup`` optimizer steps (cuDNN autotuning,
kernel JIT, allocator warm-up), then times ``steps`` more between two ``cuda.synchronize()``
calls taken in ``on_train_batch_end``: the number is what a user's run sees per step, loop and
optimizer included.  Peak memory is ``max_memory_allocated`` over the case.  Everything fits a
few minutes of GPU time with the defaults (14 cases x ~20 steps).

    python -m mptrain.bench.e2e --json e2e.json
    mptrain bench e2e --models resnet50 --precisions bf16-master,bf16-mixed --steps 30
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

MODELS = ("resnet50", "bert_base")
MPTRAIN_PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master")
LIGHTNING_PRECISIONS = ("bf16-mixed", "16-mixed")
#: batch sizes of the reference measurements quoted in the issue (H200, torch 2.11)
DEFAULT_BATCH = {"resnet50": 256, "bert_base": 128}


@dataclass
class Case:
    model: str
    trainer: str  # "mptrain" | "lightning"
    precision: str
    batch: int
    seq_len: Optional[int] = None
    samples_per_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    step_ms: Optional[float] = None
    peak_mem_gb: Optional[float] = None
    skipped_steps: Optional[int] = None
    wall_s: Optional[float] = None
    error: Optional[str] = None
    extra: dict = field(default_factory=dict)


def _timer_callback(warmup: int, steps: int):
    import lightning as L

    class StepTimer(L.Callback):
        """Synchronizes twice: after the last warm-up step and after the last timed step.
        (Subclasses Lightning's Callback; mptrain's Trainer calls the same hook names.)"""

        def __init__(self):
            self.t0 = self.t1 = None
            self.steps = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.steps += 1
            if self.steps == warmup:
                _sync()
                self.t0 = time.perf_counter()
            elif self.steps == warmup + steps:
                _sync()
                self.t1 = time.perf_counter()

    return StepTimer()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(model_name: str, batch: int, seq_len: int, smoke: bool = False):
    """(LightningModule, train DataLoader of device-made batches) for one case; ``smoke``
    shrinks the models so the code path can be checked on a CPU."""
    if model_name == "resnet50":
        from mptrain.data import ImageFolderDataModule
        from mptrain.models import ImageClassifier

        model = ImageClassifier(arch="resnet18" if smoke else "resnet50", num_classes=1000, optimizer="sgd", lr=0.1,
                                momentum=0.9, weight_decay=5e-5, label_smoothing=0.1, warmup_steps=10)
        data = ImageFolderDataModule(synthetic=True, batch_size=batch, synthetic_batches=10_000, channels_last=True,
                                     image_size=32 if smoke else 224)
    elif model_name == "bert_base":
        from mptrain.data import MLMDataModule
        from mptrain.models import BertMLM

        vocab = 1000 if smoke else 30522
        data = MLMDataModule(synthetic=True, batch_size=batch, seq_len=seq_len, vocab_size=vocab,
                             synthetic_batches=10_000)
        size = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128) if smoke else {}
        model = BertMLM(vocab_size=vocab, warmup_steps=10, max_predictions=32, **size)
    else:
        raise ValueError(f"unknown model {model_name!r}; valid: {', '.join(MODELS)}")
    data.setup("fit")
    return model, data.train_dataloader()


def run_case(case: Case, warmup: int, steps: int, accelerator: str = "cuda", smoke: bool = False) -> Case:
    cuda = accelerator == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = loader = trainer = None
    try:
        model, loader = build(case.model, case.batch, case.seq_len or 128, smoke)
        timer = _timer_callback(warmup, steps)
        total = warmup + steps
        if case.trainer == "mptrain":
            from mptrain import Trainer

            trainer = Trainer(precision=case.precision, accelerator=accelerator, devices=1, max_steps=total,
                              max_epochs=-1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                              callbacks=[timer], log_every_n_steps=total + 1,
                              channels_last=case.model == "resnet50")
            trainer.fit(model, train_dataloaders=loader)
            case.skipped_steps = trainer.skipped_steps
        else:
            import lightning as L

            if case.model == "resnet50":
                model = model.to(memory_format=torch.channels_last)  # as in the reference measurement
            trainer = L.Trainer(precision=case.precision, accelerator=accelerator, devices=1, max_steps=total,
                                logger=False, enable_progress_bar=False, enable_checkpointing=False,
                                enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                                callbacks=[timer], benchmark=True, log_every_n_steps=total + 1)
            trainer.fit(model, train_dataloaders=loader)
        if timer.t1 is None:
            raise RuntimeError(f"only {timer.steps} steps ran; expected {total}")
        elapsed = timer.t1 - timer.t0
        case.step_ms = 1e3 * elapsed / steps
        case.samples_per_s = steps * case.batch / elapsed
        if case.seq_len:
            case.tokens_per_s = case.samples_per_s * case.seq_len
        case.peak_mem_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
        case.error = f"{type(e).__name__}: {e}"
        case.extra["traceback"] = traceback.format_exc(limit=8)
    finally:
        case.wall_s = time.perf_counter() - start
        model = loader = trainer = None  # noqa: F841 - free the GPU before the next case
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return case


def summarize(cases: list[Case]) -> dict:
    """Per model: mptrain's best mode against Lightning's best (the acceptance comparison)."""
    out = {}
    for m in {c.model for c in cases}:
        ok = [c for c in cases if c.model == m and c.samples_per_s]
        ours = max((c for c in ok if c.trainer == "mptrain"), key=lambda c: c.samples_per_s, default=None)
        theirs = max((c for c in ok if c.trainer == "lightning"), key=lambda c: c.samples_per_s, default=None)
        out[m] = {
            "mptrain_best": None if ours is None else {"precision": ours.precision, "samples_per_s": ours.samples_per_s},
            "lightning_best": None if theirs is None else {"precision": theirs.precision, "samples_per_s": theirs.samples_per_s},
            "ratio": None if not (ours and theirs) else ours.samples_per_s / theirs.samples_per_s,
        }
    return out


def format_table(cases: list[Case]) -> str:
    head = f"{'model':<10} {'trainer':<10} {'precision':<12} {'batch':>5} {'samples/s':>10} {'tokens/s':>10} {'ms/step':>8} {'peak GB':>8} {'skips':>5}"
    lines = [head, "-" * len(head)]
    for c in cases:
        if c.error:
            lines.append(f"{c.model:<10} {c.trainer:<10} {c.precision:<12} {c.batch:>5} ERROR {c.error[:80]}")
            continue
        tok = "—" if c.tokens_per_s is None else f"{c.tokens_per_s:10.0f}"
        skips = "—" if c.skipped_steps is None else str(c.skipped_steps)
        mem = "—" if c.peak_mem_gb is None else f"{c.peak_mem_gb:8.2f}"
        lines.append(f"{c.model:<10} {c.trainer:<10} {c.precision:<12} {c.batch:>5} {c.samples_per_s:10.1f} {tok:>10} "
                     f"{c.step_ms:8.2f} {mem:>8} {skips:>5}")
    return "\n".join(lines)


def _csv(text: str, valid: tuple, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in valid]
    if bad:
        raise argparse.ArgumentTypeError(f"--{what}: {bad} not valid; choose from {', '.join(valid)}")
    return items


def parse_args(argv):
    p = argparse.ArgumentParser(prog="mptrain bench e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--precisions", default=",".join(MPTRAIN_PRECISIONS), help="mptrain precisions (comma list)")
    p.add_argument("--lightning", default=",".join(LIGHTNING_PRECISIONS),
                   help="precisions of the plain lightning.Trainer baseline (comma list; '' for none)")
    p.add_argument("--batch-resnet50", type=int, default=DEFAULT_BATCH["resnet50"])
    p.add_argument("--batch-bert", type=int, default=DEFAULT_BATCH["bert_base"])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=6, help="untimed steps per case")
    p.add_argument("--steps", type=int, default=15, help="timed steps per case")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the code path only")
    args = p.parse_args(argv)
    try:
        args.models = _csv(args.models, MODELS, "models")
        args.precisions = _csv(args.precisions, MPTRAIN_PRECISIONS + ("16-true", "bf16-true"), "precisions")
        args.lightning = _csv(args.lightning, LIGHTNING_PRECISIONS + ("32-true", "16-true", "bf16-true"), "lightning")
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    accelerator = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("mptrain bench e2e: needs a CUDA GPU (none visible); --smoke runs tiny models on the CPU", file=sys.stderr)
        return 2
    from mptrain.bench.common import device_meta

    torch.backends.cudnn.benchmark = True  # both trainers get the same cuDNN setting
    cases = []
    for m in args.models:
        batch = args.batch_resnet50 if m == "resnet50" else args.batch_bert
        seq = args.seq_len if m == "bert_base" else None
        plan = [("mptrain", p) for p in args.precisions] + [("lightning", p) for p in args.lightning]
        for trainer, prec in plan:
            case = run_case(Case(m, trainer, prec, batch, seq), args.warmup, args.steps, accelerator, args.smoke)
            cases.append(case)
            status = case.error or f"{case.samples_per_s:.1f} samples/s, {case.peak_mem_gb or 0:.2f} GB"
            print(f"[e2e] {m} {trainer} {prec}: {status} ({case.wall_s:.1f}s)", flush=True)
    print(format_table(cases))
    summary = summarize(cases)
    for m, s in summary.items():
        if s["ratio"] is not None:
            print(f"{m}: mptrain best {s['mptrain_best']['precision']} {s['mptrain_best']['samples_per_s']:.1f}/s vs "
                  f"lightning best {s['lightning_best']['precision']} {s['lightning_best']['samples_per_s']:.1f}/s "
                  f"-> {s['ratio']:.3f}x")
    payload = {"meta": {**device_meta(), "warmup": args.warmup, "steps": args.steps}, "summary": summary,
               "cases": [asdict(c) for c in cases]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 1 if any(c.error for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
