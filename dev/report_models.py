"""`python3 dev/report_models.py --out DIR`: layerwise reports of BERT-base and
ResNet-50 in 16-master and bf16-master (forward and backward), for the GPU machine.

Both models are built from their configurations with random weights (no download):
``transformers.BertModel(BertConfig())`` with dropout off, on 4 sequences of 128 random
token ids; ``torchvision.models.resnet50()`` in training mode (BatchNorm on batch
statistics, as when training -- a random-init network in eval mode would see unnormalized
activations grow block after block) on 8 random 224x224 images.  For each pair it writes
DIR/<model>_<precision>.json and .txt and prints a summary; under a minute on an H200.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from mptrain.numerics.layerwise import compare_layerwise

PRECISIONS = ("16-master", "bf16-master")


def bert_base(device, small: bool = False):
    try:
        from transformers import BertConfig, BertModel
    except ImportError as e:
        raise ImportError("report_models needs transformers: pip install 'mptrain[nlp]'") from e
    torch.manual_seed(0)
    size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if small else {}
    cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **size)
    model = BertModel(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (4, 16 if small else 128), device=device)
    mask = torch.ones_like(ids)
    return model, {"input_ids": ids, "attention_mask": mask}, False


def resnet50(device, small: bool = False):
    try:
        from torchvision.models import resnet50 as build
    except ImportError as e:
        raise ImportError("report_models needs torchvision: pip install 'mptrain[vision]'") from e
    torch.manual_seed(0)
    model = build(weights=None).to(device)
    shape = (2, 3, 32, 32) if small else (8, 3, 224, 224)
    return model, torch.randn(*shape, device=device), True


MODELS = {"bert_base": bert_base, "resnet50": resnet50}


def summarize(name: str, precision: str, report, seconds: float) -> str:
    rows = report.rows
    worst = report.ranked()[:3]
    ovf = [r["module"] for r in rows if r["overflow_frac"] > 0]
    last = rows[-1] if rows else None
    lines = [f"== {name} {precision}: {len(rows)} modules, {seconds:.1f}s; first_bad={report.first_bad}; "
             f"modules out of tolerance: {sum(not r['ok'] for r in rows)}; overflowing: {len(ovf)} {ovf[:3]}"]
    if last:
        lines.append(f"   final output ({last['module']}): cosine={last['cosine']:.6f} max_abs={last['max_abs']:.3e} "
                     f"rel_err={report.details[-1]['rel_err']:.3e}")
    for row, det in worst:
        local = det.get("local_rel_err")
        local = "—" if local is None else f"{local:.3e}"
        lines.append(f"   worst: {row['module']:<45} local_err={local} rel_err={det['rel_err']:.3e} "
                     f"underflow={row['underflow_frac']:.2e}")
    if report.grad_rows:
        g = report.grad_rows[-1]
        lines.append(f"   grad at the input end ({g['module']}): cosine={g['cosine']:.6f}; first_bad_grad={report.first_bad_grad}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dev/report_models.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the JSON and text reports")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {list(MODELS)}")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--device", default=None, help="default: cuda if available (the reports are meant for a GPU)")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--small", action="store_true", help="tiny BERT config / 32x32 images: a CPU smoke test")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.small:
        print("report_models: no GPU; running on the CPU will be slow", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad:
        parser.error(f"--models: unknown {bad}; choose from {list(MODELS)}")
    status = 0
    for name in models:
        model, example, train_mode = MODELS[name](device, small=args.small)
        for precision in [p.strip() for p in args.precisions.split(",") if p.strip()]:
            t0 = time.perf_counter()
            try:
                report = compare_layerwise(model, example, precision=precision, backward=not args.no_backward,
                                           train_mode=train_mode)
            except Exception as e:  # noqa: BLE001 - report the failure, carry on with the others
                print(f"== {name} {precision}: FAILED: {type(e).__name__}: {e}")
                status = 1
                continue
            dt = time.perf_counter() - t0
            base = os.path.join(args.out, f"{name}_{precision}")
            with open(base + ".json", "w") as f:
                f.write(report.to_json())
            with open(base + ".txt", "w") as f:
                f.write(report.table() + "\n")
            print(summarize(name, precision, report, dt), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"reports in {args.out}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
