"""``mptrain doctor|numerics|bench``: mptrain's own tools next to LightningCLI's subcommands."""
from __future__ import annotations

import importlib

from jsonargparse import ArgumentError

from mptrain import bench
from mptrain.cli.errors import ConfigError, explain_parse_error, parser_keys

#: name -> its line in ``mptrain --help`` (main() runs them; LightningCLI lists them)
TOOLS = {
    "doctor": "check the GPU, the compiler toolchain and the fused kernels",
    "numerics": "layerwise fp32-vs-low-precision comparison of a recipe's model on one batch",
    "bench": f"benchmarks: mptrain bench {'|'.join(bench.benchmarks())} [options]",
}


def tool_parser(name: str):
    """The jsonargparse parser of a tool (for ``mptrain --help`` and for parsing)."""
    if name in ("doctor", "numerics"):
        module = importlib.import_module(f"mptrain.cli.{name}")
        return getattr(module, f"{name}_parser")()
    from jsonargparse import ArgumentParser

    names = bench.benchmarks()
    parser = ArgumentParser(prog="mptrain bench", exit_on_error=False, allow_abbrev=False,
                            description="Benchmarks; each prints its own options with `mptrain bench NAME --help`.")
    parser.add_argument("benchmark", choices=list(names),
                        help="; ".join(f"{name}: {what}" for name, what in names.items()))
    return parser


def run_tool(name: str, argv: list[str]) -> int:
    try:
        if name == "bench":
            return _bench(argv)
        module = importlib.import_module(f"mptrain.cli.{name}")
        return getattr(module, f"{name}_main")(argv)
    except ArgumentError as e:  # jsonargparse's, with exit_on_error=False
        raise ConfigError(explain_parse_error(str(e), parser_keys(tool_parser(name)))) from None


def _bench(argv: list[str]) -> int:
    """``mptrain bench NAME [options]``: the benchmark's own ``main(argv)`` parses the rest."""
    names = bench.benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, names))
        print("usage: mptrain bench NAME [options]    (mptrain bench NAME --help: that benchmark's options)\n\n"
              "benchmarks:\n" + "\n".join(f"  {name:<{width}}  {what}" for name, what in names.items()))
        return 0 if argv else 2
    if argv[0] not in names:
        raise ConfigError(f"unknown benchmark {argv[0]!r}. Valid: {', '.join(names)} "
                          "(`mptrain bench --help` says what each measures)")
    return bench.run(argv[0], argv[1:])
