"""evaluate_precisions: what a trained model's metric and latency become in each precision.

Each precision runs on its own deep copy, converted as training would convert it (or quantized
to int8, ``int8-dynamic``).  The metric covers the whole dataloader; the latency is the median
forward time of one batch after warm-up.  A precision the device cannot run becomes an
``unsupported: reason`` row instead of an exception.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn

from mptrain.numerics.layerwise import _call, _model_device
from mptrain.numerics.quant import QuantConfig, quantize_dynamic

DEFAULT_PRECISIONS = ("32-true", "bf16-true", "16-true", "int8-dynamic")
EXTRA_PRECISIONS = ("int8-dynamic",)
#: keys of a dict batch that hold the target, not the model's input
LABEL_KEYS = ("labels", "label", "target", "targets", "y")


@dataclass
class PrecisionTable:
    """Rows: dicts with precision, metric, diff (metric - fp32 metric), latency_ms,
    speedup (fp32 latency / this latency) and status ("ok" or "unsupported: reason")."""

    metric_name: str
    rows: list = field(default_factory=list)

    def row(self, precision: str) -> dict:
        for r in self.rows:
            if r["precision"] == precision:
                return r
        raise KeyError(f"no row for precision {precision!r}; have {[r['precision'] for r in self.rows]}")

    def __str__(self) -> str:
        head = f"{'precision':<14} {self.metric_name:>12} {'diff vs fp32':>13} {'latency ms':>11} {'speed-up':>9}  status"
        lines = [head, "-" * len(head)]
        formats = {"metric": "{:12.4f}", "diff": "{:+13.4f}", "latency_ms": "{:11.3f}", "speedup": "{:8.2f}x"}
        for r in self.rows:
            m, d, lat, sp = ("—" if r[k] is None else f.format(r[k]) for k, f in formats.items())
            lines.append(f"{r['precision']:<14} {m:>12} {d:>13} {lat:>11} {sp:>9}  {r['status']}")
        return "\n".join(lines)


def accuracy_percent(logits: torch.Tensor, target: torch.Tensor) -> float:
    """Top-1 accuracy in percent (what ``metric="accuracy"`` means)."""
    return 100.0 * (logits.argmax(dim=-1) == target).float().mean().item()


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    if isinstance(batch, dict):
        for key in LABEL_KEYS:
            if key in batch:
                return {k: v for k, v in batch.items() if k != key}, batch[key]
    raise ValueError("evaluate_precisions: cannot split the batch into (input, target); "
                     "pass batch_fn=lambda batch: (input, target)")


def _prediction(out: Any) -> torch.Tensor:
    """The tensor the metric reads: the output itself, its ``logits``, or its first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        if "logits" in out:
            return out["logits"]
        out = list(out.values())
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"evaluate_precisions: cannot find the prediction tensor in a {type(out).__name__} output")


def _prepare(model: nn.Module, precision: str, device: torch.device, quant_config: QuantConfig):
    """(model copy, input converter, forward context factory) for one precision."""
    if precision == "int8-dynamic":
        return quantize_dynamic(model, quant_config).to(device), (lambda x: x), contextlib.nullcontext
    from mptrain.precision import build_precision

    prec = build_precision(precision, device=device)
    m = copy.deepcopy(model).float().to(device)
    m = prec.convert_module(m) or m
    return m, prec.convert_input, prec.forward_context


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_one(model, precision, loader, metric, device, quant_config, batch_fn, max_batches, warmup_batches):
    m, convert, ctx = _prepare(model, precision, device, quant_config)
    m.eval()
    stateful = hasattr(metric, "update") and hasattr(metric, "compute")
    met = copy.deepcopy(metric) if stateful else metric
    if stateful and hasattr(met, "reset"):
        met.reset()
    preds, targets, times = [], [], []
    nonfinite = False
    with torch.no_grad():
        for batch in itertools.islice(loader, max_batches):
            x, y = batch_fn(batch)
            x, y = convert(move_data_to_device(x, device)), move_data_to_device(y, device)
            _sync(device)
            t0 = time.perf_counter()
            with ctx():
                out = _call(m, x)
            _sync(device)
            times.append(1e3 * (time.perf_counter() - t0))
            pred = _prediction(out).float()
            nonfinite = nonfinite or not bool(torch.isfinite(pred).all())
            if stateful:
                metric_device = getattr(met, "device", pred.device)
                met.update(pred.to(metric_device), y.to(metric_device))
            else:
                preds.append(pred.cpu())
                targets.append(y.cpu() if isinstance(y, torch.Tensor) else torch.as_tensor(y))
    if not times:
        raise ValueError("evaluate_precisions: the dataloader yielded no batch")
    value = met.compute() if stateful else metric(torch.cat(preds), torch.cat(targets))
    return float(value), statistics.median(times[warmup_batches:] or times), nonfinite


def evaluate_precisions(model: nn.Module, dataloader: Iterable, metric: Any = "accuracy",
                        precisions: Sequence[str] = DEFAULT_PRECISIONS, device: Optional[Any] = None,
                        quant_config: QuantConfig = QuantConfig(), batch_fn: Optional[Callable] = None,
                        max_batches: Optional[int] = None, warmup_batches: int = 1,
                        metric_name: Optional[str] = None) -> PrecisionTable:
    """Metric and latency of ``model`` in each precision, with the difference to fp32.

    Args:
        model: a trained module (left untouched: each precision works on a deep copy).
        dataloader: yields ``(input, target)`` pairs (or dicts with a label key; or use ``batch_fn``).
        metric: ``"accuracy"`` (top-1, percent), a callable ``(predictions, targets) -> number``
            applied to the whole concatenated outputs, or a torchmetrics-style object with
            ``update``/``compute`` (deep-copied per precision).
        precisions: strings of ``mptrain.PRECISIONS`` and/or ``"int8-dynamic"``.
        device: where to evaluate; default the model's device.
        quant_config: how ``int8-dynamic`` quantizes (default: symmetric per-channel weights,
            symmetric per-token activations).
    """
    from mptrain.precision import PRECISIONS

    unknown = [p for p in precisions if p not in PRECISIONS and p not in EXTRA_PRECISIONS]
    if unknown:
        raise ValueError(f"evaluate_precisions: unknown precision(s) {unknown}; valid: {list(PRECISIONS) + list(EXTRA_PRECISIONS)}")
    device = torch.device(device) if device is not None else _model_device(model)
    if metric == "accuracy":
        metric, metric_name = accuracy_percent, metric_name or "accuracy %"
    metric_name = metric_name or getattr(metric, "__name__", type(metric).__name__)
    batch_fn = batch_fn or _split_batch
    table = PrecisionTable(metric_name)
    for p in precisions:
        row = {"precision": p, "metric": None, "diff": None, "latency_ms": None, "speedup": None, "status": "ok"}
        try:
            value, latency, nonfinite = _run_one(model, p, dataloader, metric, device, quant_config, batch_fn,
                                                 max_batches, warmup_batches)
            row.update(metric=value, latency_ms=latency, status="ok (outputs contain inf/NaN)" if nonfinite else "ok")
        except (RuntimeError, NotImplementedError, TypeError) as e:  # this device/dtype cannot run the model
            row["status"] = f"unsupported: {_first_line(e)}"
        table.rows.append(row)
    measured = [r for r in table.rows if r["metric"] is not None]
    base = next((r for r in measured if r["precision"] == "32-true"), measured[0] if measured else None)
    for r in measured:  # against fp32, or the first precision measured without it
        r["diff"] = r["metric"] - base["metric"]
        r["speedup"] = base["latency_ms"] / r["latency_ms"] if r["latency_ms"] else None
    return table


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {next(iter(str(e).strip().splitlines()), '')}"[:200]
