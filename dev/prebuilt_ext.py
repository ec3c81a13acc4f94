"""Carry a built extension from one GPU call to the next (lab tool, not shipped).

Each call to the GPU machine starts bare, so every call pays the 55-75 s cold build.  The
build directory's name already pins the sources, flags and versions
(:func:`mptrain.ops.build.build_dir_for`), so the ``.so`` of one call is valid in the next as
long as ``csrc/`` did not change:

    python3 dev/prebuilt_ext.py save $OUT/ext.tgz     # after a build, on the GPU machine
    python3 dev/prebuilt_ext.py load .gpu/ext.tgz     # next call (carry the folder), before any test

``load`` unpacks into this tree's build directory and writes the warm-load stamp for the
unpacked file (tar keeps whole-second mtimes only, so the saved stamp would not match);
when the sources changed since ``save`` it says so and does nothing: the next import builds.
"""
from __future__ import annotations

import argparse
import io
import sys
import tarfile
from pathlib import Path

from mptrain.ops.build import EXT_NAME, _write_stamp, build_dir_for, csrc_dir, find_cuda_home

_SO = f"{EXT_NAME}.so"


def current_build_dir() -> Path:
    return build_dir_for(csrc_dir(), cuda_home=find_cuda_home())


def save(path: Path) -> int:
    d = current_build_dir()
    so = d / _SO
    if not so.is_file():
        print(f"no built extension in {d}: run `python3 -m mptrain.ops.build` first", file=sys.stderr)
        return 2
    with tarfile.open(path, "w:gz") as tar:
        tar.add(so, arcname=_SO)
        info = tarfile.TarInfo("build_dir_name")
        name = d.name.encode()
        info.size = len(name)
        tar.addfile(info, io.BytesIO(name))
    print(f"saved {so} ({so.stat().st_size / 2**20:.1f} MiB) to {path}")
    return 0


def load(path: Path) -> int:
    d = current_build_dir()
    with tarfile.open(path, "r:gz") as tar:
        saved = tar.extractfile("build_dir_name").read().decode()
        if saved != d.name:
            print(f"{path} holds the build {saved}, this tree builds {d.name} (csrc/, flags or versions "
                  "changed): not loaded, the first use builds")
            return 0
        d.mkdir(parents=True, exist_ok=True)
        tar.extract(_SO, d, filter="data")
    _write_stamp(d)
    print(f"loaded {d / _SO}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("save", "load"))
    p.add_argument("path", type=Path)
    a = p.parse_args(argv)
    return save(a.path) if a.action == "save" else load(a.path)


if __name__ == "__main__":
    sys.exit(main())
