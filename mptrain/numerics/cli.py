"""Entry points of `mptrain doctor` and `mptrain numerics` (called by mptrain/cli.py).

`mptrain numerics --config RECIPE.yaml [--precision P]` builds the recipe's model and data
itself (``class_path`` + ``init_args``, LightningCLI style, read with ``yaml.safe_load``),
takes one batch, and prints the layerwise fp32-vs-P comparison.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Optional

import torch

_LABEL_KEYS = ("labels", "label", "target", "targets", "y")


# ---------------------------------------------------------------------------------------
# doctor
# ---------------------------------------------------------------------------------------
def doctor_main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mptrain doctor",
                                     description="GPU, tensor-core paths, toolchain versions, extension status, advice.")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--no-build", action="store_true", help="do not try to build/load the CUDA extension")
    parser.add_argument("--build", action="store_true", help="try to build the CUDA extension even without a GPU")
    parser.add_argument("--no-probe", action="store_true", help="do not run the tiny tensor-core probes")
    args = parser.parse_args(argv)
    from mptrain.numerics.hardware import doctor_report, format_doctor

    build = False if args.no_build else (True if args.build else None)
    report = doctor_report(build_extension=build, probe=not args.no_probe)
    print(format_doctor(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


# ---------------------------------------------------------------------------------------
# numerics
# ---------------------------------------------------------------------------------------
def instantiate(spec: Any) -> Any:
    """Build ``{"class_path": "pkg.mod.Class", "init_args": {...}}`` recursively; other values as they are."""
    if isinstance(spec, dict) and "class_path" in spec:
        path = spec["class_path"]
        module_name, _, cls_name = path.rpartition(".")
        if not module_name:
            raise ValueError(f"class_path {path!r} must be 'package.module.Class'")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"class_path {path!r} cannot be imported: {e}") from e
        kwargs = {k: instantiate(v) for k, v in (spec.get("init_args") or {}).items()}
        return cls(**kwargs)
    if isinstance(spec, dict):
        return {k: instantiate(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [instantiate(v) for v in spec]
    return spec


def load_recipe(path: str) -> dict:
    import yaml

    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a recipe is a YAML mapping with 'model' and 'data' sections")
    if "model" not in cfg and isinstance(cfg.get("fit"), dict):  # `mptrain fit` sub-config layout
        cfg = cfg["fit"]
    if "model" not in cfg:
        raise ValueError(f"{path}: no 'model' section (expected model: {{class_path: ..., init_args: ...}})")
    return cfg


def first_batch(data: Any) -> Any:
    """One training batch from a LightningDataModule, a dataloader or an iterable."""
    if hasattr(data, "train_dataloader"):
        if hasattr(data, "prepare_data"):
            data.prepare_data()
        if hasattr(data, "setup"):
            data.setup("fit")
        data = data.train_dataloader()
    return next(iter(data))


def batch_to_input(model: Any, batch: Any) -> Any:
    """What ``model.forward`` takes: the model's own ``numerics_input(batch)`` if it has one,
    else the first element of a tuple batch, or a dict batch without its label keys."""
    if hasattr(model, "numerics_input"):
        return model.numerics_input(batch)
    if isinstance(batch, (tuple, list)):
        return batch[0]
    if isinstance(batch, dict):
        return {k: v for k, v in batch.items() if k not in _LABEL_KEYS}
    return batch


def _trim(obj: Any, n: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[:n] if obj.dim() > 0 else obj
    if isinstance(obj, dict):
        return {k: _trim(v, n) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_trim(v, n) for v in obj)
    return obj


def numerics_main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mptrain numerics",
                                     description="Layerwise fp32-vs-low-precision comparison on a recipe's model and one batch.")
    parser.add_argument("--config", required=True, metavar="RECIPE.yaml")
    parser.add_argument("--precision", default=None, help="default: the recipe's trainer.precision, else bf16-mixed")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--max-samples", type=int, default=8, help="use at most this many samples of the batch")
    parser.add_argument("--rtol", type=float, default=1e-2)
    parser.add_argument("--atol", type=float, default=1e-3)
    parser.add_argument("--backward", action="store_true", help="compare gradients too")
    parser.add_argument("--train-mode", action="store_true", help="keep modules in training mode (BatchNorm batch stats)")
    parser.add_argument("--top", type=int, default=None, help="print only the N worst modules")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    args = parser.parse_args(argv)
    from mptrain.numerics.layerwise import compare_layerwise

    try:
        cfg = load_recipe(args.config)
        precision = args.precision or (cfg.get("trainer") or {}).get("precision") or "bf16-mixed"
        model = instantiate(cfg["model"])
        if "data" not in cfg:
            raise ValueError(f"{args.config}: no 'data' section to take a batch from")
        batch = first_batch(instantiate(cfg["data"]))
    except (OSError, ValueError, TypeError, ImportError) as e:
        print(f"mptrain numerics: {e}", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(device)
    example = _trim(batch_to_input(model, batch), args.max_samples)
    report = compare_layerwise(model, example, precision=str(precision), rtol=args.rtol, atol=args.atol,
                               backward=args.backward, train_mode=args.train_mode)
    print(report.table(top=args.top))
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json())
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":  # `python -m mptrain.numerics.cli doctor|numerics ...` without the top-level CLI
    if len(sys.argv) < 2 or sys.argv[1] not in ("doctor", "numerics"):
        print("usage: python -m mptrain.numerics.cli doctor|numerics [args]", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit((doctor_main if sys.argv[1] == "doctor" else numerics_main)(sys.argv[2:]))
