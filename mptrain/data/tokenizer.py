"""A local WordPiece tokenizer for masked-LM: loaded from a ``tokenizer.json`` or trained with
``tokenizers`` on the corpus when the run starts (nothing is downloaded)."""
from __future__ import annotations

import os
import time
from typing import Sequence

from mptrain.data.sampling import world_and_rank

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def load_or_train(path: str, files: Sequence[str], vocab_size: int, timeout_s: float = 600.0):
    """The tokenizer at ``path``; if missing, rank 0 trains a BERT-style WordPiece tokenizer on ``files`` and writes
    it atomically while the other ranks wait for the file (one tokenizer for all ranks)."""
    try:
        import tokenizers as tk
    except ImportError as e:
        raise ImportError("text data needs the tokenizers package: pip install 'mptrain[nlp]'") from e
    _, rank = world_and_rank()
    if rank == 0 and not os.path.exists(path):
        tok = tk.Tokenizer(tk.models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = tk.normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
        tok.decoder = tk.decoders.WordPiece()
        trainer = tk.trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                               show_progress=False)
        tok.train([str(f) for f in files], trainer)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        tok.save(tmp)
        os.replace(tmp, path)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):  # the other ranks wait for rank 0's file
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 did not write the tokenizer {path} in {timeout_s:.0f}s")
        time.sleep(0.5)
    tok = tk.Tokenizer.from_file(path)
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer {path} lacks the special tokens {missing} masked-LM needs")
    return tok
