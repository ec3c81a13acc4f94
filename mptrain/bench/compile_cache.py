"""``--compile-cache FILE`` of the model benchmarks: torch.compile's portable cache carried between processes.

A compiled case spends most of its wall time compiling (a 1.2B Llama: 40-100 s of a case's 60-120 s on an H100),
and a fresh GPU machine starts with empty caches.  torch's portable compile cache
(``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``: the AOT autograd, inductor and triton
artifacts this process made or loaded) is written to FILE after every case and loaded from it before the first,
so a later run with the same torch, triton and GPU kind skips the inductor and triton compiles (dynamo still
traces).  The timed steps do not change, since the compiled code is the same; only the "first step at" seconds
drop, and the output says that the cache was loaded.  Written with gzip, atomically (a run cut short keeps the
last whole file).
"""
from __future__ import annotations

import argparse
import gzip
import os
from pathlib import Path
from typing import Optional

import torch


#: torch 2.6 has no portable compile cache (``save_cache_artifacts`` came with 2.7): the option then says so
AVAILABLE = hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")


def add_compile_cache_option(parser: argparse.ArgumentParser) -> None:
    """The model benchmarks' ``--compile-cache FILE``."""
    parser.add_argument("--compile-cache", default=None, metavar="FILE",
                        help="torch.compile's portable cache: loaded before the first case, written after each "
                             "(mptrain.bench.compile_cache)")


class CompileCache:
    """The portable compile cache behind ``--compile-cache``: :meth:`load` once, :meth:`save` after each case."""

    def __init__(self, path: Optional[str]):
        self.path = Path(path) if path and AVAILABLE else None
        self.asked = bool(path)

    def load(self) -> str:
        """Load FILE's artifacts into this process's caches; what was loaded, in words."""
        if self.path is None:
            return f"off (torch {torch.__version__} has no portable compile cache)" if self.asked else "off"
        if not self.path.exists():
            return f"{self.path}: none yet (written after each case)"
        blob = gzip.decompress(self.path.read_bytes())
        info = torch.compiler.load_cache_artifacts(blob)
        return f"{self.path}: loaded {len(blob) / 2**20:.1f} MiB ({_describe(info)})"

    def save(self) -> Optional[str]:
        """Write every artifact this process made or loaded to FILE; what was written, in words (None: off)."""
        if self.path is None:
            return None
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return f"{self.path}: nothing to save"
        blob, info = saved
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(gzip.compress(blob, compresslevel=6))
        os.replace(tmp, self.path)
        return f"{self.path}: {self.path.stat().st_size / 2**20:.1f} MiB ({_describe(info)})"


def _describe(info) -> str:
    """The artifact counts of a ``CacheInfo`` (its fields differ between torch versions)."""
    if info is None:
        return "no artifacts"
    parts = []
    for name in dir(info):
        value = getattr(info, name, None)
        if name.endswith("_artifacts") and isinstance(value, list) and value:
            parts.append(f"{name.removesuffix('_artifacts')} {len(value)}")
    return ", ".join(parts) or "no artifacts"
