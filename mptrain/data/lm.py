"""Language-model data from text files, at character, word or WordPiece level: the corpus becomes one
token stream cut into ``seq_len`` windows; the target is the window shifted by one token."""
from __future__ import annotations

import os
from collections import Counter
from typing import Literal, Optional

import torch
from torch.utils.data import Dataset

from mptrain.data.module import MPTDataModule, require_data_dir
from mptrain.data.text import read_text, split_files
from mptrain.data.tokenizer import load_or_train

UNK, EOS = "<unk>", "<eos>"


class Vocabulary:
    """Token <-> id for ``level`` "char" (every character seen) or "word" (whitespace words,
    newline as ``<eos>``, words rarer than ``min_freq`` mapped to ``<unk>``)."""

    def __init__(self, text: str, level: str, min_freq: int = 1, max_size: Optional[int] = None):
        self.level = level
        counts = Counter(self.split(text))
        kept = [t for t, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= min_freq]
        if max_size is not None:
            kept = kept[: max(0, max_size - 1)]
        self.itos = [UNK] + [t for t in kept if t != UNK]
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    def split(self, text: str) -> list[str]:
        if self.level == "char":
            return list(text)
        return [w for line in text.splitlines() for w in (*line.split(), EOS)]

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.stoi.get(t, 0) for t in self.split(text)], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.itos)


class WordPieceStream:
    """Token <-> id for ``level`` "wordpiece": the local WordPiece tokenizer of :mod:`mptrain.data.tokenizer`
    (loaded from ``path``, or trained there on ``files`` with ``vocab_size`` entries), each line of text
    followed by ``[SEP]`` (the end of a line, as ``<eos>`` is at word level)."""

    def __init__(self, path: str, files: list[str], vocab_size: int):
        self.tokenizer = load_or_train(path, files, vocab_size)
        self.eos_id = self.tokenizer.token_to_id("[SEP]")

    def encode(self, text: str) -> torch.Tensor:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        ids = [i for enc in self.tokenizer.encode_batch(lines, add_special_tokens=False)
               for i in (*enc.ids, self.eos_id)]
        return torch.tensor(ids, dtype=torch.int64)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size()


class LMWindows(Dataset):
    """Non-overlapping windows: item ``i`` is (stream[iL:(i+1)L], stream[iL+1:(i+1)L+1])."""

    def __init__(self, stream: torch.Tensor, seq_len: int):
        if len(stream) < seq_len + 1:
            raise ValueError(f"the text has {len(stream)} tokens, fewer than one window of data.seq_len={seq_len} + 1")
        self.stream, self.seq_len = stream, seq_len

    def __len__(self) -> int:
        return (len(self.stream) - 1) // self.seq_len

    def __getitem__(self, index: int):
        s = index * self.seq_len
        return self.stream[s : s + self.seq_len], self.stream[s + 1 : s + self.seq_len + 1]


class LMTextDataModule(MPTDataModule):
    """Next-token prediction on ``data_dir`` (``train/`` + ``val/``, or one folder split by
    ``val_fraction``).

    Args:
        data_dir: folder (or file) of text (ignored when ``synthetic``).
        level: "char", "word" or "wordpiece" (a local WordPiece tokenizer, trained on the training files
            at start when missing: the subword vocabulary a Transformer LM wants).
        seq_len: tokens per training window.
        min_freq / max_vocab: word-level vocabulary pruning.
        vocab_size: vocabulary of synthetic data; with "wordpiece" also the size of the trained tokenizer.
        tokenizer_path: with "wordpiece": a ``tokenizers`` ``tokenizer.json``; ``None``:
            ``.mptrain/wordpiece<vocab_size>.json`` in ``data_dir`` (or its folder; written when missing).
        (others: see ``MPTDataModule``)
    """

    def __init__(self, data_dir: Optional[str] = None, level: Literal["char", "word", "wordpiece"] = "word",
                 seq_len: int = 128, min_freq: int = 1, max_vocab: Optional[int] = None, vocab_size: int = 10000,
                 batch_size: int = 32, num_workers: int = 0, pin_memory: bool = True, seed: int = 0,
                 synthetic: bool = False, synthetic_batches: int = 1000, val_fraction: float = 0.1,
                 tokenizer_path: Optional[str] = None):
        super().__init__(batch_size, num_workers, pin_memory, seed, synthetic, synthetic_batches)
        if level not in ("char", "word", "wordpiece"):
            raise ValueError(f"data.level must be 'char', 'word' or 'wordpiece', got {level!r}")
        if tokenizer_path is not None and level != "wordpiece":
            raise ValueError(f"data.tokenizer_path={tokenizer_path!r} is read only with data.level=wordpiece "
                             f"(level={level!r} builds its vocabulary from the corpus)")
        if seq_len < 1:
            raise ValueError(f"data.seq_len must be >= 1, got {seq_len}")
        require_data_dir(data_dir, synthetic)
        self.data_dir, self.level, self.seq_len, self.val_fraction = data_dir, level, seq_len, val_fraction
        self.min_freq, self.max_vocab, self._vocab_size = min_freq, max_vocab, vocab_size
        self.tokenizer_path = tokenizer_path
        self.vocab: Optional[Vocabulary | WordPieceStream] = None

    @property
    def vocab_size(self) -> int:
        if self.synthetic:
            return self._vocab_size
        self.setup("fit")
        return len(self.vocab)

    def make_synthetic_batch(self, g, device):
        s = torch.randint(0, self._vocab_size, (self.batch_size, self.seq_len + 1), generator=g, device=device)
        return s[:, :-1].contiguous(), s[:, 1:].contiguous()

    def load(self, stage: str) -> None:
        train_files, val_files = split_files(self.data_dir)
        train_text = read_text(train_files)
        if val_files is None:
            cut = int(len(train_text) * (1 - self.val_fraction))
            train_text, val_text = train_text[:cut], train_text[cut:]
        else:
            val_text = read_text(val_files)
        if self.level == "wordpiece":
            folder = self.data_dir if os.path.isdir(self.data_dir) else os.path.dirname(os.path.abspath(self.data_dir))
            path = self.tokenizer_path or os.path.join(folder, ".mptrain", f"wordpiece{self._vocab_size}.json")
            self.vocab = WordPieceStream(path, train_files, self._vocab_size)
        else:
            self.vocab = Vocabulary(train_text, self.level, self.min_freq, self.max_vocab)
        self.train_set = LMWindows(self.vocab.encode(train_text), self.seq_len)
        self.val_set = LMWindows(self.vocab.encode(val_text), self.seq_len)
