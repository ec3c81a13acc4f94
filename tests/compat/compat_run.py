"""Run one compatibility case under a given Trainer class and collect everything a user can
observe (hook order, metrics, weights, files, checkpoint contents), then compare two runs."""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from compat_modules import CompatModule

SEED = 1234


@dataclass
class Observed:
    calls: list[str]
    seen: list[tuple[int, int]]
    losses: list[float]
    callback_metrics: dict[str, torch.Tensor]
    logged_metrics: dict[str, torch.Tensor]
    progress_bar_metrics: dict[str, Any]
    weights: dict[str, torch.Tensor]
    files: list[str]
    csv_rows: list[dict[str, str]]
    checkpoints: dict[str, dict]
    current_epoch: int
    global_step: int
    dtypes: tuple
    extra: dict = field(default_factory=dict)


def base_kwargs(root: Path) -> dict:
    """Trainer arguments every case shares: CPU, CSV logs under ``root``, no progress bar."""
    return dict(accelerator="cpu", devices=1, default_root_dir=str(root), enable_progress_bar=False,
                enable_model_summary=False, log_every_n_steps=1,
                logger=CSVLogger(str(root), name="logs", version=0))


def _metrics(d: dict) -> dict:
    return {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in d.items()}


def run(trainer_cls: Callable, root: Path, module_kwargs: dict, trainer_kwargs: Callable[[Path], dict],
        after_fit: Callable | None = None, module_cls: type = CompatModule, datamodule_cls: type | None = None,
        **trainer_extra) -> Observed:
    """Seed, build the module (and the datamodule) and the trainer (``trainer_kwargs(root)`` gives
    fresh callbacks), fit, then ``after_fit(trainer, model, extra)`` for test/predict/reload checks."""
    root.mkdir(parents=True, exist_ok=True)
    L.seed_everything(SEED, workers=True)
    model = module_cls(**module_kwargs)
    datamodule = None if datamodule_cls is None else datamodule_cls()
    trainer = trainer_cls(**{**base_kwargs(root), **trainer_kwargs(root), **trainer_extra})
    trainer.fit(model, datamodule=datamodule)
    extra: dict = {}
    if after_fit is not None:
        after_fit(trainer, model, extra)
    if datamodule is not None:
        extra["datamodule_calls"] = list(datamodule.calls)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    csv_path = root / "logs" / "version_0" / "metrics.csv"
    rows = list(csv.DictReader(csv_path.open())) if csv_path.exists() else []
    ckpts = {f: torch.load(root / f, map_location="cpu", weights_only=True) for f in files if f.endswith(".ckpt")}
    return Observed(calls=list(model.calls), seen=list(model.seen), losses=[float(x) for x in model.losses],
                    callback_metrics=_metrics(trainer.callback_metrics),
                    logged_metrics=_metrics(trainer.logged_metrics),
                    progress_bar_metrics=_metrics(trainer.progress_bar_metrics),
                    weights={k: v.detach().clone() for k, v in model.state_dict().items()},
                    files=files, csv_rows=rows, checkpoints=ckpts, current_epoch=trainer.current_epoch,
                    global_step=trainer.global_step, dtypes=model.dtypes, extra=extra)


#: what mptrain's checkpoints may hold beyond Lightning's (DESIGN §3: the position in the epoch,
#: stored where Lightning keeps a stateful train loader's state)
ALLOWED_ADDITIONS = frozenset({"combined_loader"})


def assert_same_values(a: Any, b: Any, where: str, allow_extra: frozenset = frozenset()) -> None:
    """Recursive equality; tensors with torch.equal (same dtype, shape and bits); ``b`` may hold
    the keys in ``allow_extra`` beyond ``a``'s."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), f"{where}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a} vs {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b) - (allow_extra - set(a)), \
            f"{where}: keys {sorted(a, key=str)} vs {sorted(b, key=str)}"
        for k in a:
            assert_same_values(a[k], b[k], f"{where}[{k!r}]", allow_extra)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a} vs {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_values(x, y, f"{where}[{i}]", allow_extra)
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


#: checkpoint entries Lightning writes whose content must match; mptrain may add its own keys
#: (scaler, masters, RNG, epoch position, precision phase) beside them
CHECKPOINT_KEYS = ("epoch", "global_step", "state_dict", "optimizer_states", "lr_schedulers", "loops",
                   "hyper_parameters")


def assert_same_checkpoint(ref: dict, ours: dict, name: str) -> None:
    missing = set(ref) - set(ours)
    assert not missing, f"{name}: mptrain's checkpoint lacks Lightning's keys {sorted(missing)}"
    for key in CHECKPOINT_KEYS:
        if key in ref:
            assert_same_values(ref[key], ours[key], f"{name}:{key}", ALLOWED_ADDITIONS if key == "loops" else frozenset())
    for cb_key, cb_state in ref.get("callbacks", {}).items():  # ModelCheckpoint / EarlyStopping state
        assert cb_key in ours["callbacks"], f"{name}: callback state {cb_key} missing"
        state = {k: v for k, v in cb_state.items() if k not in ("dirpath", "best_model_path", "last_model_path",
                                                               "kth_best_model_path", "best_k_models")}
        theirs = {k: ours["callbacks"][cb_key][k] for k in state}
        assert_same_values(state, theirs, f"{name}:callbacks[{cb_key}]")
        if "best_k_models" in cb_state:  # absolute paths differ between the two roots: compare names
            assert_same_values(_by_name(cb_state["best_k_models"]), _by_name(ours["callbacks"][cb_key]["best_k_models"]),
                               f"{name}:callbacks[{cb_key}].best_k_models")


def _by_name(paths_to_scores: dict) -> dict:
    return {Path(p).name: s for p, s in paths_to_scores.items()}


def assert_identical(ref: Observed, ours: Observed) -> None:
    """Everything a user observes must be identical between lightning.Trainer and mptrain's."""
    assert ours.calls == ref.calls, _first_difference(ref.calls, ours.calls)
    assert ours.seen == ref.seen
    assert ours.dtypes == ref.dtypes
    assert (ours.current_epoch, ours.global_step) == (ref.current_epoch, ref.global_step)
    assert_same_values(ref.losses, ours.losses, "losses")
    assert_same_values(ref.callback_metrics, ours.callback_metrics, "callback_metrics")
    assert_same_values(ref.logged_metrics, ours.logged_metrics, "logged_metrics")
    assert_same_values(ref.progress_bar_metrics, ours.progress_bar_metrics, "progress_bar_metrics")
    assert_same_values(ref.weights, ours.weights, "weights")
    assert ours.files == ref.files
    assert ours.csv_rows == ref.csv_rows
    for name in ref.checkpoints:
        assert_same_checkpoint(ref.checkpoints[name], ours.checkpoints[name], name)
    assert_same_values(ref.extra, ours.extra, "after fit")


def _first_difference(ref: list, ours: list) -> str:
    for i, (a, b) in enumerate(zip(ref, ours)):
        if a != b:
            return f"hook #{i}: lightning calls {a!r}, mptrain calls {b!r}; context {ref[max(0, i - 3):i + 3]}"
    return f"lightning made {len(ref)} hook calls, mptrain {len(ours)}"
