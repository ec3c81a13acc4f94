"""LMTextDataModule for a Transformer LM: level="wordpiece" (the local WordPiece tokenizer, one [SEP] per line)
and synthetic token batches deterministic by seed."""
from __future__ import annotations

import pytest
import torch

from mptrain.data import LMTextDataModule

LINES = ["the quick brown fox jumps over the lazy dog",
         "mixed precision training keeps master weights in fp32 while the model runs in half",
         "loss scaling protects small gradients from underflow in float16"] * 60


def test_wordpiece_level_trains_a_tokenizer_and_windows_shift_by_one(tmp_path):
    pytest.importorskip("tokenizers")
    for split, lines in (("train", LINES), ("val", LINES[:30])):
        (tmp_path / split).mkdir()
        (tmp_path / split / "a.txt").write_text("\n\n".join(lines))  # blank lines add no tokens
    dm = LMTextDataModule(data_dir=str(tmp_path), level="wordpiece", vocab_size=120, seq_len=16, batch_size=4)
    dm.setup()
    assert (tmp_path / ".mptrain" / "wordpiece120.json").is_file()
    tok = dm.vocab.tokenizer
    assert 30 < dm.vocab_size <= 120 and dm.vocab_size == tok.get_vocab_size()
    x, y = dm.train_set[1]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    stream = dm.train_set.stream
    sep = tok.token_to_id("[SEP]")
    assert (stream == sep).sum() == len(LINES)  # one per line
    first = stream[: int((stream == sep).nonzero()[0]) + 1].tolist()
    assert first == tok.encode(LINES[0], add_special_tokens=False).ids + [sep]
    xb, _ = next(iter(dm.train_dataloader()))
    assert xb.shape == (4, 16) and xb.dtype == torch.int64
    # a second module reuses the saved tokenizer
    again = LMTextDataModule(data_dir=str(tmp_path), level="wordpiece", vocab_size=120, seq_len=16)
    assert again.vocab_size == dm.vocab_size


def test_tokenizer_path_is_only_read_at_wordpiece_level(tmp_path):
    with pytest.raises(ValueError, match="tokenizer_path.*only with data.level=wordpiece"):
        LMTextDataModule(data_dir=str(tmp_path), level="word", tokenizer_path="tok.json")
    with pytest.raises(ValueError, match="'char', 'word' or 'wordpiece'"):
        LMTextDataModule(data_dir=str(tmp_path), level="bpe")


def test_synthetic_token_batches_are_deterministic_by_seed():
    def first(seed):
        dm = LMTextDataModule(synthetic=True, vocab_size=512, seq_len=32, batch_size=3, seed=seed)
        dm.setup()
        return next(iter(dm.train_dataloader()))

    (x, y), (x2, y2), (x3, _) = first(0), first(0), first(1)
    assert x.shape == y.shape == (3, 32) and x.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2) and not torch.equal(x, x3)
    assert torch.equal(x[:, 1:], y[:, :-1])  # the target is the next token
    assert 0 <= int(x.min()) and int(x.max()) < 512
