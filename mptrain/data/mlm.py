"""Masked-LM data (BERT pre-training): blocks of ``seq_len`` tokens from a folder of text files,
15% of the tokens masked (80% [MASK], 10% random, 10% kept), labels -100 elsewhere."""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch.utils.data import Dataset

from mptrain.data.module import MPTDataModule, require_data_dir
from mptrain.data.sampling import sample_seed
from mptrain.data.text import read_text, split_files
from mptrain.data.tokenizer import SPECIAL_TOKENS, load_or_train

N_SPECIAL = 5  # [PAD] [UNK] [CLS] [SEP] [MASK] take ids 0..4 in our tokenizers and in synthetic data


def mask_tokens(ids: torch.Tensor, maskable: torch.Tensor, vocab_size: int, mask_id: int, prob: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked input ids, labels) for ids of any shape; ``maskable`` is False on special tokens."""
    dev = ids.device
    chosen = (torch.rand(ids.shape, generator=generator, device=dev) < prob) & maskable
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    action = torch.rand(ids.shape, generator=generator, device=dev)
    randoms = torch.randint(N_SPECIAL, vocab_size, ids.shape, generator=generator, device=dev)
    out = torch.where(chosen & (action < 0.8), torch.full_like(ids, mask_id), ids)
    out = torch.where(chosen & (action >= 0.8) & (action < 0.9), randoms, out)
    return out, labels


class MLMBlocks(Dataset):
    """Fixed blocks ``[CLS] tokens [SEP]``; masking of block ``i`` in epoch ``e`` is seeded by
    (seed, e, i), so it is reproducible on any worker and after a resume."""

    def __init__(self, blocks: torch.Tensor, vocab_size: int, mask_id: int, prob: float, seed: int,
                 special_ids: torch.Tensor):
        self.blocks, self.vocab_size, self.mask_id, self.prob, self.seed = blocks, vocab_size, mask_id, prob, seed
        self.special_ids = special_ids
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict:
        ids = self.blocks[index]
        g = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, index))
        maskable = ~torch.isin(ids, self.special_ids)
        input_ids, labels = mask_tokens(ids, maskable, self.vocab_size, self.mask_id, self.prob, g)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def to_blocks(ids: list[int], seq_len: int, cls_id: int, sep_id: int) -> torch.Tensor:
    body = seq_len - 2
    n = len(ids) // body
    if n == 0:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than one block of data.seq_len={seq_len}")
    t = torch.tensor(ids[: n * body], dtype=torch.int64).view(n, body)
    return torch.cat([torch.full((n, 1), cls_id), t, torch.full((n, 1), sep_id)], dim=1)


class MLMDataModule(MPTDataModule):
    """Masked-LM on ``data_dir`` (``train/`` + ``val/`` subfolders, or one folder split by
    ``val_fraction``) with a local tokenizer.

    Args:
        data_dir: folder of text files (ignored when ``synthetic``).
        tokenizer_path: a ``tokenizers`` ``tokenizer.json``; ``None``: ``.mptrain/wordpiece<vocab_size>.json`` under
            ``data_dir``, trained on the training files at start when missing.
        vocab_size: size of a trained tokenizer's vocabulary, and of synthetic data's.
        seq_len: tokens per sequence, [CLS] and [SEP] included.
        mlm_probability: share of tokens masked.
        (others: see ``MPTDataModule``)
    """

    def __init__(self, data_dir: Optional[str] = None, tokenizer_path: Optional[str] = None,
                 vocab_size: int = 30522, seq_len: int = 128, mlm_probability: float = 0.15,
                 batch_size: int = 32, num_workers: int = 2, pin_memory: bool = True, seed: int = 0,
                 synthetic: bool = False, synthetic_batches: int = 1000, val_fraction: float = 0.05):
        super().__init__(batch_size, num_workers, pin_memory, seed, synthetic, synthetic_batches)
        require_data_dir(data_dir, synthetic)
        if seq_len < 3:
            raise ValueError(f"data.seq_len must be >= 3 ([CLS] x [SEP]), got {seq_len}")
        self.data_dir, self.tokenizer_path, self._vocab_size = data_dir, tokenizer_path, vocab_size
        self.seq_len, self.mlm_probability, self.val_fraction = seq_len, mlm_probability, val_fraction
        self.tokenizer = None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size: the tokenizer's (built on first use) or the synthetic one."""
        if self.synthetic:
            return self._vocab_size
        self.setup("fit")
        return self.tokenizer.get_vocab_size()

    def make_synthetic_batch(self, g, device):
        shape = (self.batch_size, self.seq_len)
        ids = torch.randint(N_SPECIAL, self._vocab_size, shape, generator=g, device=device)
        ids[:, 0], ids[:, -1] = 2, 3  # [CLS], [SEP]
        input_ids, labels = mask_tokens(ids, ids >= N_SPECIAL, self._vocab_size, 4, self.mlm_probability, g)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    def load(self, stage: str) -> None:
        train_files, val_files = split_files(self.data_dir)
        path = self.tokenizer_path or os.path.join(self.data_dir, ".mptrain", f"wordpiece{self._vocab_size}.json")
        self.tokenizer = tok = load_or_train(path, train_files, self._vocab_size)
        cls_id, sep_id, mask_id = (tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]"))

        def encode(files: list[str]) -> list[int]:
            lines = [ln for ln in read_text(files).splitlines() if ln.strip()]
            return [i for enc in tok.encode_batch(lines, add_special_tokens=False) for i in enc.ids]

        train_ids = encode(train_files)
        if val_files is not None:
            val_ids = encode(val_files)
        else:
            cut = int(len(train_ids) * (1 - self.val_fraction))
            train_ids, val_ids = train_ids[:cut], train_ids[cut:]
        special = torch.tensor([tok.token_to_id(t) for t in SPECIAL_TOKENS])
        make = lambda ids: MLMBlocks(to_blocks(ids, self.seq_len, cls_id, sep_id),  # noqa: E731
                                     tok.get_vocab_size(), mask_id, self.mlm_probability, self.seed, special)
        self.train_set, self.val_set = make(train_ids), make(val_ids)
