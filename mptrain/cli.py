"""``mptrain fit|validate|bench|doctor|numerics``: the one module that builds everything.

``fit`` / ``validate`` follow LightningCLI's conventions on jsonargparse: a YAML recipe with
top-level ``seed_everything``, ``trainer`` (the Trainer's arguments), ``model`` and ``data``
(``class_path`` + ``init_args``), dotted overrides (``--trainer.precision=bf16-master``,
``--data.batch_size=64``) and ``--print_config``.  The merged config is checked before
anything is built: an unknown key or a bad value exits with status 2 and a message naming the
key path, the value and what is valid.

jsonargparse is imported only here, inside functions: ``mptrain bench`` and ``import mptrain``
work on machines without it.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import json
import random
import re
import sys
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

SUBCOMMANDS = {
    "fit": "train a model from a recipe: mptrain fit --config RECIPE.yaml [--key.path=value ...]",
    "validate": "evaluate a model: mptrain validate --config RECIPE.yaml [--ckpt_path=PATH] [--key.path=value ...]",
    "bench": "benchmarks: mptrain bench gemm|kernels|e2e|ddp [options]",
    "doctor": "check the GPU, the compiler toolchain and the fused kernels",
    "numerics": "precision diagnostics (layerwise fp32-vs-low-precision comparison, overflow report)",
}
BENCHES = {"gemm": "mptrain.bench.gemm", "kernels": "mptrain.bench.kernels", "e2e": "mptrain.bench.e2e",
           "ddp": "mptrain.bench.ddp"}
TOP_KEYS = ("config", "print_config", "seed_everything", "trainer", "model", "data", "ckpt_path")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
FUSED = ("auto", True, False)
MATMUL = (None, "highest", "high", "medium")


class ConfigError(ValueError):
    """A recipe or override that cannot work; raised before any model or data is built."""


# ----------------------------------------------------------------------------- entry point
def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_top_help())
        return 0 if argv else 2
    if argv[0] == "--version":
        from mptrain import __version__

        print(f"mptrain {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in ("fit", "validate"):
        try:
            return run(cmd, rest)
        except ConfigError as e:
            print(f"mptrain {cmd}: error: {e}", file=sys.stderr)
            return 2
    if cmd == "bench":
        return _bench(rest)
    if cmd == "doctor":
        return _dispatch("mptrain.numerics.cli", "doctor_main", rest, "mptrain doctor")
    if cmd == "numerics":
        return _dispatch("mptrain.numerics.cli", "numerics_main", rest, "mptrain numerics")
    print(f"mptrain: error: unknown subcommand {cmd!r}; valid: {', '.join(SUBCOMMANDS)}\n\n{_top_help()}", file=sys.stderr)
    return 2


def _top_help() -> str:
    lines = ["usage: mptrain {" + ",".join(SUBCOMMANDS) + "} ...", "",
             "Mixed-precision training for PyTorch.", "", "subcommands:"]
    lines += [f"  {name:<10}{text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", "`mptrain SUBCOMMAND --help` for the options of one; `python -m mptrain` is the same program."]
    return "\n".join(lines)


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mptrain bench {" + ",".join(BENCHES) + "} [options]\n\n"
              "  gemm     GEMM throughput per dtype against the hardware peak\n"
              "  kernels  fused kernels against their PyTorch baselines\n"
              "  e2e      ResNet-50 / BERT-base training steps per precision against Lightning\n"
              "  ddp      data-parallel scaling efficiency and weight agreement across ranks (torchrun)")
        return 0 if argv else 2
    if argv[0] not in BENCHES:
        print(f"mptrain bench: error: unknown benchmark {argv[0]!r}; valid: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    return _dispatch(BENCHES[argv[0]], "main", argv[1:], f"mptrain bench {argv[0]}")


def _dispatch(module: str, func: str, argv: list[str], what: str) -> int:
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        print(f"{what}: unavailable in this installation ({module}:{func}: {e})", file=sys.stderr)
        return 2
    rc = fn(argv)
    return int(rc or 0)


# ----------------------------------------------------------------------------- fit / validate
def run(subcommand: str, argv: list[str]) -> int:
    """Parse and check the config, build data, model, loggers and Trainer, then fit or validate."""
    wants_help = "-h" in argv or "--help" in argv
    raw = None
    if not wants_help:
        raw = merge_raw_config([a for a in argv if a.split("=")[0] != "--print_config"])
        check_raw_config(raw)
    if not _has_jsonargparse():
        if wants_help or any(a.split("=")[0] == "--print_config" for a in argv):
            raise ImportError("--help and --print_config need jsonargparse: pip install 'jsonargparse[signatures]>=4.32'")
        # A machine without jsonargparse (e.g. a bare GPU box) still runs recipes: the checks
        # above covered names and choices; values keep their YAML types.
        print("mptrain: jsonargparse is not installed; running the recipe without type coercion "
              "(pip install 'jsonargparse[signatures]>=4.32' for full checking)", file=sys.stderr)
        config = {"seed_everything": True, "ckpt_path": None, "trainer": {}, **raw}
        return _execute(subcommand, config, _instantiate_plain)
    parser = build_parser(subcommand)
    try:
        cfg = parser.parse_args(argv)
    except ConfigError:
        raise
    except Exception as e:  # jsonargparse's ArgumentError: reword it with the key path
        if type(e).__name__ != "ArgumentError":
            raise
        raise ConfigError(explain_parse_error(str(e))) from None
    check_values(cfg)
    return _execute(subcommand, _to_dict(parser, cfg), _instantiate)


def _has_jsonargparse() -> bool:
    try:
        import jsonargparse  # noqa: F401
    except ImportError:
        return False
    return True


def build_parser(subcommand: str):
    try:
        from jsonargparse import ActionConfigFile, ArgumentParser
    except ImportError as e:
        raise ImportError("mptrain fit/validate need jsonargparse: pip install 'jsonargparse[signatures]>=4.32'") from e
    import lightning as L

    from mptrain import Trainer

    parser = ArgumentParser(prog=f"mptrain {subcommand}", exit_on_error=False,
                            description=SUBCOMMANDS[subcommand], default_meta=False)
    parser.add_argument("--config", action=ActionConfigFile, help="a recipe YAML (may repeat; later ones win)")
    parser.add_argument("--seed_everything", type=typing.Union[bool, int], default=True,
                        help="seed of every RNG: an int, true (draw one and record it) or false")
    parser.add_argument("--ckpt_path", type=Optional[str], default=None,
                        help="checkpoint to resume (fit) or evaluate (validate): a path, 'last', or 'auto' "
                             "(last.ckpt when it exists, else start fresh: for restarted torchrun workers)")
    parser.add_class_arguments(Trainer, "trainer", skip={"logger", "callbacks"}, fail_untyped=False)
    parser.add_argument("--trainer.logger", type=Any, default=None,
                        help="csv, tensorboard, wandb, none, a class_path dict, or a list of those")
    parser.add_argument("--trainer.callbacks", type=Optional[list[Any]], default=None,
                        help="list of {class_path, init_args}")
    parser.add_subclass_arguments(L.LightningModule, "model", required=True)
    parser.add_subclass_arguments(L.LightningDataModule, "data", required=False)
    return parser


# ----------------------------------------------------------------------------- config checks
def merge_raw_config(argv: list[str]) -> dict:
    """The config as the user wrote it: YAML files merged in order, then dotted overrides
    (``--model.x`` meaning ``model.init_args.x``), before defaults and type conversion."""
    import yaml

    raw: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --key.path=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            else:
                value = "true"
        i += 1
        if key == "config":
            try:
                text = Path(value).read_text()
            except OSError as e:
                raise ConfigError(f"--config {value!r}: cannot read the recipe ({e.strerror})") from None
            loaded = yaml.safe_load(text) or {}
            if not isinstance(loaded, dict):
                raise ConfigError(f"--config {value!r}: a recipe must be a YAML mapping, got {type(loaded).__name__}")
            _deep_merge(raw, loaded)
            continue
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            parsed = value
        _set_path(raw, key.split("."), parsed)
    return raw


def _deep_merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict) and "class_path" not in v:
            _deep_merge(dst[k], v)
        elif isinstance(v, dict) and isinstance(dst.get(k), dict) and v.get("class_path") == dst[k].get("class_path"):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v


def _set_path(raw: dict, parts: list[str], value: Any) -> None:
    if parts[0] in ("model", "data") and len(parts) > 1 and parts[1] not in ("class_path", "init_args"):
        parts = [parts[0], "init_args", *parts[1:]]
    if parts[0] in ("model", "data") and len(parts) == 1 and isinstance(value, str):
        parts, value = [parts[0], "class_path"], value  # --model=ClassName
    node = raw
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value


def _unknown(path: str, value: Any, valid: Sequence[str]) -> ConfigError:
    key = path.rsplit(".", 1)[-1]
    near = difflib.get_close_matches(key, list(valid), n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    where = path.rsplit(".", 1)[0] if "." in path else "the top level"
    return ConfigError(f"unknown key {path!r} (value: {value!r}).{hint} Valid keys under {where}: {', '.join(valid)}")


def _bad_value(path: str, value: Any, valid: Sequence[Any], note: str = "") -> ConfigError:
    shown = ", ".join("null" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for v in valid)
    return ConfigError(f"invalid value for {path!r}: {value!r}. Valid choices: {shown}{note}")


def check_raw_config(raw: dict) -> None:
    """Names and choices we can check before jsonargparse: keys, class paths, init args,
    precision / logger / accelerator / fused strings."""
    for key, value in raw.items():
        if key not in TOP_KEYS:
            raise _unknown(key, value, TOP_KEYS)
    trainer = raw.get("trainer") or {}
    if not isinstance(trainer, dict):
        raise ConfigError(f"'trainer' must be a mapping of Trainer arguments, got {trainer!r}")
    from mptrain import Trainer

    valid = list(inspect.signature(Trainer).parameters)
    for key, value in trainer.items():
        if key not in valid:
            raise _unknown(f"trainer.{key}", value, valid)
    check_trainer_values(trainer)
    for group in ("model", "data"):
        spec = raw.get(group)
        if spec is None:
            if group == "model":
                raise ConfigError("no model: the recipe needs 'model: {class_path: ..., init_args: {...}}'")
            continue
        _check_class_spec(group, spec)


def check_trainer_values(trainer: dict) -> None:
    from mptrain.precision import PRECISIONS, normalize_precision

    if "precision" in trainer:
        try:
            normalize_precision(trainer["precision"])
        except ValueError:
            raise _bad_value("trainer.precision", trainer["precision"], PRECISIONS) from None
    if "logger" in trainer:
        _check_logger(trainer["logger"])
    if "accelerator" in trainer and trainer["accelerator"] not in ACCELERATORS:
        raise _bad_value("trainer.accelerator", trainer["accelerator"], ACCELERATORS)
    if "fused" in trainer and trainer["fused"] not in FUSED:
        raise _bad_value("trainer.fused", trainer["fused"], FUSED)
    if "float32_matmul_precision" in trainer and trainer["float32_matmul_precision"] not in MATMUL:
        raise _bad_value("trainer.float32_matmul_precision", trainer["float32_matmul_precision"], MATMUL)


def _check_logger(spec: Any) -> None:
    from mptrain.loggers import LOGGER_NAMES

    items = spec if isinstance(spec, list) else [spec]
    for item in items:
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str) and (item in LOGGER_NAMES or "." in item):
            continue
        if isinstance(item, dict) and isinstance(item.get("class_path"), str):
            continue
        raise _bad_value("trainer.logger", item, LOGGER_NAMES, " (or a class_path, or a list of those)")


def resolve_class(name: str, group: str):
    """A class from a dotted path, or a bare name found in mptrain.models / mptrain.data."""
    if "." in name:
        module, _, attr = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{group}.class_path {name!r} cannot be imported: {e}") from None
    if group not in ("model", "data"):
        raise ConfigError(f"{group}: class_path {name!r} must be a dotted path (package.module.Class)")
    home = importlib.import_module("mptrain.models" if group == "model" else "mptrain.data")
    if hasattr(home, name):
        return getattr(home, name)
    choices = ", ".join(getattr(home, "__all__", []))
    raise ConfigError(f"{group}.class_path {name!r} is not a dotted path nor a class of {home.__name__} "
                      f"({choices})")


def _check_class_spec(group: str, spec: Any) -> None:
    if not isinstance(spec, dict) or "class_path" not in spec:
        raise ConfigError(f"'{group}' must be a mapping with class_path (and init_args), got {spec!r}")
    for key, value in spec.items():
        if key not in ("class_path", "init_args", "dict_kwargs"):
            raise _unknown(f"{group}.{key}", value, ["class_path", "init_args"])
    cls = resolve_class(spec["class_path"], group)
    params = inspect.signature(cls).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: leave the types to jsonargparse
        hints = {}
    for key, value in (spec.get("init_args") or {}).items():
        if key not in valid:
            raise _unknown(f"{group}.init_args.{key}", value, valid)
        choices = _literal_choices(hints.get(key))
        if choices is not None and value not in choices:
            raise _bad_value(f"{group}.init_args.{key}", value, choices)


def _literal_choices(hint: Any) -> Optional[tuple]:
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return None


def check_values(cfg) -> None:
    """After parsing (defaults filled, types converted): the trainer strings once more."""
    trainer = {k: v for k, v in vars(cfg.trainer).items()} if cfg.get("trainer") else {}
    check_trainer_values(trainer)


def explain_parse_error(message: str) -> str:
    """jsonargparse's message, led by the full key path, the offending value and what was expected."""
    unrec = re.search(r"unrecognized arguments: (.*)", message)
    if unrec:
        return f"unrecognized arguments {unrec.group(1)}; options look like --trainer.max_steps=2 (see --help)"
    keys = re.findall(r'Parser key "([^"]+)"', message)
    option = re.search(r"Option '([^']+)' is not accepted", message) or re.search(r"does not accept option '([^']+)'", message)
    if option:
        keys.append(option.group(1))
    keys = [k for i, k in enumerate(keys) if k not in keys[:i]]
    if len(keys) > 1 and keys[0] in ("model", "data"):
        keys.insert(1, "init_args")
    path = ".".join(keys) or "the config"
    expected = re.search(r"Expected a (.*?)\. Got value: (.*)", message)
    if expected:
        wanted = re.sub(r"<class '([^']+)'>", r"\1", expected.group(1))
        return f"invalid value for {path!r}: {expected.group(2).strip()!r}. Expected {wanted}"
    union = re.search(r"Subtypes: \[(.*?)\].*Given value: (.*)", message, re.S)
    if union and not option:
        types = re.sub(r"<class '([^']+)'>", r"\1", union.group(1)).replace("NoneType", "null")
        return f"invalid value for {path!r}: {union.group(2).strip()!r}. Expected one of: {types}"
    if option:
        return f"unknown key {path!r}. {message.strip()}"
    details = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return f"{path}: {details}"


# ----------------------------------------------------------------------------- building and running
def _execute(subcommand: str, config: dict, instantiate) -> int:
    """Build and run from the resolved ``config`` dict; ``instantiate(spec, group)`` makes the
    ``class_path`` + ``init_args`` objects (jsonargparse's or the plain importlib fallback)."""
    import lightning as L

    from mptrain import Trainer
    from mptrain.loggers import build_loggers, finish_loggers, redact

    seed = config.get("seed_everything", True)
    if seed is True:
        seed = random.SystemRandom().randrange(2**31)
        config["seed_everything"] = seed  # recorded in the saved config: the run can be repeated
    if seed is not False:
        L.seed_everything(int(seed), workers=True, verbose=False)
    data = instantiate(config["data"], "data") if config.get("data") else None
    _link_vocab(config, data)
    model = instantiate(config["model"], "model")

    tconf = dict(config.get("trainer") or {})
    logger_spec, cb_specs = tconf.pop("logger", None), tconf.pop("callbacks", None) or []
    if seed is not False and tconf.get("seed") is None:
        tconf["seed"] = int(seed)
    root = tconf.get("default_root_dir") or "."
    config_dict = redact(config)
    if logger_spec in ("none", False) or logger_spec == ["none"]:
        loggers: Any = False
    else:
        loggers = build_loggers(logger_spec, str(root), hparams=config_dict)
    callbacks = [_instantiate_plain(c, "trainer.callbacks") for c in cb_specs]
    _match_launcher(tconf)
    trainer = Trainer(**tconf, logger=loggers, callbacks=callbacks)
    _save_config(trainer, config_dict)

    ckpt = config.get("ckpt_path")  # "auto" / "last" / a path: resolved by the Trainer
    status = "failed"
    try:
        if subcommand == "fit":
            trainer.fit(model, datamodule=data, ckpt_path=ckpt)
            results = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val")}
        else:
            if ckpt is not None:
                from mptrain.checkpoint import load_checkpoint, resolve_ckpt_path

                path = resolve_ckpt_path(ckpt, trainer.checkpoint_dir)
                model.load_state_dict(load_checkpoint(path)["state_dict"])
            results = dict(trainer.validate(model, datamodule=data)[0])
            results.update({k: v for k, v in trainer.callback_metrics.items() if k.startswith("val")})
        status = "success"
    finally:
        if trainer.is_global_zero:
            finish_loggers(trainer.loggers, status)
    if trainer.is_global_zero:  # one machine-readable line (metrics empty when no validation ran)
        print(json.dumps({"subcommand": subcommand, "global_step": trainer.global_step, "log_dir": trainer.log_dir,
                          "metrics": {k: round(float(v), 6) for k, v in sorted(results.items())}}), flush=True)
    return 0


def _match_launcher(tconf: dict) -> None:
    """Under torchrun, make the Trainer's device count agree with the processes torchrun started.

    Fabric with ``devices="auto"`` counts the machine's devices (1 CPU, or every GPU), not the
    processes: ``torchrun --nproc-per-node=2`` on a CPU would run two independent trainings.
    ``auto`` becomes torchrun's local world size; an explicit count that disagrees is an error.
    """
    import os

    world, local = int(os.environ.get("WORLD_SIZE", 1)), os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:  # not under torchrun
        return
    local = int(local)
    devices, nodes = tconf.get("devices", "auto"), tconf.get("num_nodes", 1) or 1
    if devices in ("auto", None, -1, "-1"):
        # also for one process: "auto" on a 2-GPU host would ask for 2 devices in a world of 1
        tconf["devices"], tconf["num_nodes"] = local, max(1, world // local)
        if tconf.get("strategy", "auto") == "auto" and world > 1:
            tconf["strategy"] = "ddp"
        return
    count = len(devices) if isinstance(devices, (list, tuple)) else int(str(devices).rstrip(","))
    if count * nodes != world:
        raise ConfigError(f"trainer.devices={devices!r} x trainer.num_nodes={nodes} = {count * nodes} processes, but the "
                          f"launcher started WORLD_SIZE={world} ({local} per node): set --trainer.devices={local} "
                          f"--trainer.num_nodes={world // local}, or leave devices at 'auto'")


def _instantiate(spec: dict, group: str):
    """jsonargparse instantiation of one ``class_path`` + ``init_args`` group (types coerced,
    nested class specs instantiated)."""
    import lightning as L
    from jsonargparse import ArgumentParser

    base = L.LightningModule if group == "model" else L.LightningDataModule
    p = ArgumentParser(exit_on_error=False)
    p.add_subclass_arguments(base, group, required=True)
    ns = p.parse_object({group: spec})
    make = getattr(p, "instantiate", None) or p.instantiate_classes
    return make(ns)[group]


def _instantiate_plain(spec: Any, what: str):
    """``class_path`` + ``init_args`` by importlib (callbacks; recipes without jsonargparse)."""
    if hasattr(spec, "as_dict"):  # a jsonargparse Namespace
        spec = spec.as_dict()
    if not isinstance(spec, dict) or "class_path" not in spec:
        return spec
    cls = resolve_class(spec["class_path"], what)
    try:
        return cls(**(spec.get("init_args") or {}))
    except TypeError as e:
        raise ConfigError(f"{what}: {spec['class_path']}({spec.get('init_args') or {}}) failed: {e}") from None


def _link_vocab(config: dict, data) -> None:
    """A model with ``vocab_size: null`` takes the data module's (e.g. a tokenizer trained at start)."""
    init = config["model"].setdefault("init_args", {}) if isinstance(config.get("model"), dict) else None
    if init is None or "vocab_size" not in init or init["vocab_size"] is not None:
        return
    vocab = getattr(data, "vocab_size", None)
    if vocab is None:
        raise ConfigError("model.init_args.vocab_size is null and data has no vocab_size: set model.vocab_size")
    init["vocab_size"] = int(vocab)


def _to_dict(parser, cfg) -> dict:
    import yaml

    return yaml.safe_load(parser.dump(cfg, skip_none=False, skip_check=True))


def _save_config(trainer, config: dict) -> None:
    """The resolved (secret-free) config next to the metrics, as LightningCLI does."""
    if not trainer.is_global_zero:
        return
    import yaml

    path = Path(trainer.log_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
