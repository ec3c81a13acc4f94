"""Reading a corpus: the text files under a folder, and its train/validation split."""
from __future__ import annotations

import glob
import os
from typing import Optional


def text_files(path: str, suffixes: tuple[str, ...] = (".txt", ".text", ".raw", ".tokens")) -> list[str]:
    """Sorted text files under ``path`` (recursively), or ``[path]`` if it is a file."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"text data {path!r} is neither a file nor a folder")
    files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                   if os.path.isfile(f) and f.endswith(suffixes))
    if not files:
        raise FileNotFoundError(f"no text files ({', '.join(suffixes)}) under {path!r}")
    return files


def split_files(data_dir: str) -> tuple[list[str], Optional[list[str]]]:
    """``data_dir/train`` and ``data_dir/val`` (or ``valid``) when they exist; otherwise all files
    and ``None`` (the caller splits the token stream)."""
    train = os.path.join(data_dir, "train")
    for name in ("val", "valid", "validation"):
        val = os.path.join(data_dir, name)
        if os.path.isdir(train) and os.path.isdir(val):
            return text_files(train), text_files(val)
    return text_files(data_dir), None


def read_text(files: list[str]) -> str:
    return "\n".join(open(f, encoding="utf-8", errors="replace").read() for f in files)
