"""--compile-cache: torch.compile's portable cache written by one process and loaded by the next."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from mptrain.bench.compile_cache import AVAILABLE, CompileCache


needs_api = pytest.mark.skipif(not AVAILABLE, reason="torch < 2.7 has no portable compile cache")


def test_without_the_api_the_option_says_so(monkeypatch, tmp_path):
    import mptrain.bench.compile_cache as cc

    monkeypatch.setattr(cc, "AVAILABLE", False)
    cache = cc.CompileCache(str(tmp_path / "c.bin"))
    assert "has no portable compile cache" in cache.load() and cache.save() is None


@needs_api
def test_a_missing_file_is_said_and_off_is_off(tmp_path):
    assert CompileCache(None).load() == "off" and CompileCache(None).save() is None
    assert "none yet" in CompileCache(str(tmp_path / "c.bin")).load()


@needs_api
def test_the_next_process_loads_what_this_one_compiled(tmp_path):
    path = tmp_path / "cache.bin"
    code = textwrap.dedent(f"""
        import torch
        from mptrain.bench.compile_cache import CompileCache
        cache = CompileCache({str(path)!r})
        print(cache.load())
        torch.compile(lambda a: (a.sin() * 2).sum())(torch.randn(8, 8))
        from torch._dynamo.utils import counters
        print("hits", counters["inductor"]["fxgraph_cache_hit"])
        print(cache.save())
    """)
    env_cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor_a")}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**_env(), **env_cache})
    assert first.returncode == 0, first.stderr[-2000:]
    assert "none yet" in first.stdout and "inductor 1" in first.stdout and path.exists()
    # a fresh inductor cache directory: only the file carries the artifacts over
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor_b")})
    assert second.returncode == 0, second.stderr[-2000:]
    lines = second.stdout.splitlines()
    assert "loaded" in lines[0] and "inductor 1" in lines[0]
    assert "hits 0" in first.stdout and "hits 1" in lines  # the second compile came from the carried artifacts


def _env() -> dict:
    import os

    return dict(os.environ)
