"""Experiment loggers from a spec: ``"csv"``, ``"tensorboard"``, ``"wandb"``, ``"none"``, a
``{"class_path": ..., "init_args": ...}`` dict, a Logger instance, or a list of those.

Every run (unless ``"none"``) gets Lightning's CSV logger, so ``metrics.csv`` always exists under
the log dir.  W&B goes through Lightning's ``WandbLogger``; without credentials it runs offline
(``wandb sync`` later) rather than prompting, and the API key never reaches a config,
hyperparameter, log file or stdout from here.
"""
from __future__ import annotations

import importlib
import netrc
import os
from typing import Any, Iterable, Mapping, Optional

LOGGER_NAMES = ("csv", "tensorboard", "wandb", "none")
_SECRET_WORDS = ("api_key", "apikey", "token", "password", "secret")
REDACTED = "<redacted>"


def build_loggers(spec: Any, root_dir: str = ".", hparams: Optional[Mapping[str, Any]] = None) -> list:
    """Resolve ``spec`` into a list of ``lightning.fabric`` loggers under ``root_dir``; when
    ``hparams`` is given, it is logged (secrets redacted) to each."""
    if spec is False or spec == "none" or spec == [] or spec == ["none"]:
        return []
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    loggers = [_build_one(item, root_dir) for item in items if item not in (None, True, "none")]
    if not any(_is_csv(lg) for lg in loggers):
        loggers.insert(0, _csv(root_dir))
    if hparams:
        clean = redact(dict(hparams))
        for lg in loggers:
            lg.log_hyperparams(clean)
    return loggers


def _build_one(item: Any, root_dir: str):
    from lightning.fabric.loggers import Logger

    if isinstance(item, Logger):
        return item
    if isinstance(item, str):
        if item == "csv":
            return _csv(root_dir)
        if item == "tensorboard":
            return _tensorboard(root_dir)
        if item == "wandb":
            return wandb_logger(root_dir)
        if "." in item:  # a bare class path
            return _instantiate(item, {}, root_dir)
        raise ValueError(f"trainer.logger={item!r} is not a logger; valid: {', '.join(LOGGER_NAMES)}, "
                         "or a class_path (e.g. lightning.pytorch.loggers.MLFlowLogger)")
    if isinstance(item, Mapping) and "class_path" in item:
        return _instantiate(item["class_path"], dict(item.get("init_args") or {}), root_dir)
    raise TypeError(f"trainer.logger entry {item!r} ({type(item).__name__}) is not a logger name, "
                    f"class_path dict or Logger; valid names: {', '.join(LOGGER_NAMES)}")


def _instantiate(class_path: str, init_args: dict, root_dir: str):
    module, _, name = class_path.rpartition(".")
    if name == "WandbLogger":
        return wandb_logger(root_dir, **init_args)
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"trainer.logger class_path {class_path!r} cannot be imported: {e}") from e
    if "save_dir" not in init_args and "save_dir" in _params(cls):
        init_args["save_dir"] = root_dir
    return cls(**init_args)


def _params(cls) -> set[str]:
    import inspect

    return set(inspect.signature(cls).parameters)


def _is_csv(lg) -> bool:
    return type(lg).__name__ == "CSVLogger"


def _csv(root_dir: str):
    from lightning.pytorch.loggers import CSVLogger  # writes hparams.yaml too, unlike fabric's

    return CSVLogger(save_dir=root_dir, name="lightning_logs")


def _tensorboard(root_dir: str):
    try:
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir=root_dir, name="tensorboard")
    except ModuleNotFoundError as e:
        raise ImportError("trainer.logger=tensorboard needs tensorboard: pip install tensorboard") from e


def has_wandb_credentials() -> bool:
    """An API key in the environment or a ``wandb login`` entry in ~/.netrc (never read out)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("//")[-1].split("/")[0]
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_logger(root_dir: str, **kwargs):
    """Lightning's ``WandbLogger`` under ``root_dir``: offline when there are no credentials or
    ``WANDB_MODE`` is offline/dryrun/disabled, so a run never stops at a login prompt."""
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ImportError("trainer.logger=wandb needs wandb: pip install 'mptrain[wandb]'") from e
    from lightning.pytorch.loggers import WandbLogger

    mode = os.environ.get("WANDB_MODE", "").lower()
    offline = kwargs.pop("offline", None)
    if offline is None:
        offline = mode in ("offline", "dryrun", "disabled") or not has_wandb_credentials()
    for key in list(kwargs):
        if any(w in key.lower() for w in _SECRET_WORDS):
            raise ValueError(f"trainer.logger: pass W&B credentials through WANDB_API_KEY or `wandb login`, "
                             f"never as the init argument {key!r} (it would be saved with the config)")
    kwargs.setdefault("project", os.environ.get("WANDB_PROJECT", "mptrain"))
    kwargs.setdefault("save_dir", root_dir)
    return WandbLogger(offline=offline, **kwargs)


def finish_loggers(loggers: Iterable, status: str = "success") -> None:
    """Flush and close every logger; W&B runs are finished here rather than in an exit hook
    (which can race interpreter shutdown and leave an offline run without its summary)."""
    for lg in loggers:
        lg.finalize(status)
        run = getattr(lg, "_experiment", None)
        if type(lg).__name__ == "WandbLogger" and run is not None and hasattr(run, "finish"):
            run.finish(exit_code=0 if status == "success" else 1)


def redact(obj: Any, secrets: Optional[Iterable[str]] = None) -> Any:
    """A copy of ``obj`` (nested dicts/lists) with secret-looking keys and known secret values
    replaced, so a config can be logged or saved."""
    if secrets is None:
        secrets = [v for k, v in os.environ.items() if v and len(v) >= 8 and any(w in k.lower() for w in _SECRET_WORDS)]
    secrets = list(secrets)
    if isinstance(obj, Mapping):
        return {k: REDACTED if any(w in str(k).lower() for w in _SECRET_WORDS) else redact(v, secrets)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, secrets) for v in obj)
    if isinstance(obj, str):
        for s in secrets:
            obj = obj.replace(s, REDACTED)
    return obj
