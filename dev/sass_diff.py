"""Compare the SASS of every kernel between two builds of the extension (not a test).

Pruning launch variants must leave the shipped kernels unchanged.  This dumps the SASS of each
kernel in two object files (``cuobjdump -sass``), matches kernels by demangled name (the
anonymous namespace's mangled id differs between source paths), and reports which kept kernels
have identical instruction text (constant-bank offsets included, so the parameter layout too),
which differ, and, for kernels whose template arguments changed, the before kernel with the
identical body.

    python3 dev/sass_diff.py BEFORE_BUILD/layer_norm.cuda.o AFTER_BUILD/layer_norm.cuda.o

cuobjdump is taken from $CUDA_HOME/bin, PATH, or triton's bundled copy.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys


def cuobjdump() -> str:
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"),
                  shutil.which("cuobjdump") or ""]
    try:
        import triton  # noqa: PLC0415 - optional: only its bundled binary is used
        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    sys.exit("sass_diff: cuobjdump not found; set CUDA_HOME to a full CUDA toolkit or put cuobjdump on PATH")


def kernels(obj: str) -> dict[str, str]:
    """Mangled kernel name -> its SASS instruction text (addresses and encodings dropped)."""
    out = subprocess.run([cuobjdump(), "-sass", obj], capture_output=True, text=True, check=True).stdout
    found, name, body = {}, None, []
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                found[name] = "\n".join(body)
            name, body = m.group(1), []
        elif name is not None:
            ins = re.sub(r"/\*[0-9a-f]{4,}\*/|/\* 0x[0-9a-f]+ \*/", "", line).strip()
            if ins:
                body.append(ins)
    if name:
        found[name] = "\n".join(body)
    return found


def demangled(ks: dict[str, str]) -> dict[str, str]:
    names = list(ks)
    plain = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return {p: ks[n] for n, p in zip(names, plain)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args(argv)
    a, b = demangled(kernels(args.before)), demangled(kernels(args.after))
    same = [n for n in b if n in a and a[n] == b[n]]
    differ = [n for n in b if n in a and a[n] != b[n]]
    renamed = [n for n in b if n not in a]
    body_of = {s: n for n, s in a.items()}
    print(f"{os.path.basename(args.after)}: {len(a)} kernels before, {len(b)} after; {len(same)} kept with identical "
          f"SASS, {len(differ)} kept with different SASS, {len(renamed)} renamed, "
          f"{len(a) - len(same) - len(differ)} before-kernels gone under their name (removed, or renamed below)")
    for n in differ:
        print("  DIFFERENT:", n)
    for n in renamed:
        print("  renamed:", n, "\n    identical to:", body_of.get(b[n], "NONE (new code)"))
    return 1 if differ or any(b[n] not in body_of for n in renamed) else 0


if __name__ == "__main__":
    sys.exit(main())
