"""Data modules: digits (real), synthetic device batches, image folders, masked-LM and LM text."""
from __future__ import annotations

import pytest
import torch

from mptrain.data import DigitsDataModule, ImageFolderDataModule, LMTextDataModule, MLMDataModule
from mptrain.data.mlm import mask_tokens
from mptrain.data.module import SyntheticBatches

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine and the early bird catches the worm",
    "mixed precision training keeps master weights in fp32 while the model runs in half",
    "loss scaling protects small gradients from underflow in float16",
] * 40


def write_corpus(root, split=False):
    if split:
        (root / "train").mkdir()
        (root / "val").mkdir()
        (root / "train" / "a.txt").write_text("\n".join(CORPUS))
        (root / "val" / "b.txt").write_text("\n".join(CORPUS[:40]))
    else:
        (root / "a.txt").write_text("\n".join(CORPUS[:80]))
        (root / "b.txt").write_text("\n".join(CORPUS[80:]))
    return root


def test_digits_is_real_split_and_disjoint():
    dm = DigitsDataModule(batch_size=64)
    dm.setup()
    xt, yt = dm.train_set.tensors
    xv, yv = dm.val_set.tensors
    assert len(xt) + len(xv) == 1797 and len(xv) == 359
    assert xt.shape[1:] == (1, 8, 8) and 0 <= xt.min() and xt.max() <= 1
    assert set(yt.tolist()) == set(range(10))
    rows_t = {tuple(r.flatten().tolist()) for r in xt}
    assert sum(tuple(r.flatten().tolist()) in rows_t for r in xv) < 10  # (digits has a few duplicate images)
    loader = dm.train_dataloader()
    assert len(loader) == len(xt) // 64
    x, y = next(iter(loader))
    assert x.shape == (64, 1, 8, 8)


def test_loader_workers_are_seeded_and_deterministic():
    def first_batches():
        dm = DigitsDataModule(batch_size=16, num_workers=2, seed=5)
        dm.setup()
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(1)
        return [y for _, y in list(loader)[:3]]

    a, b = first_batches(), first_batches()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_synthetic_batches_are_made_once_on_the_device_and_not_zero():
    calls = []

    def make(g, device):
        calls.append(device)
        return torch.randn(4, 3, generator=g, device=device)

    ds = SyntheticBatches(make, length=10, device=lambda: torch.device("cpu"), distinct=3)
    batches = [ds[i] for i in range(10)]
    assert len(calls) == 3
    assert batches[0] is batches[3] and not torch.equal(batches[0], batches[1])
    assert batches[0].abs().sum() > 0


@pytest.mark.parametrize("dm", [
    DigitsDataModule(synthetic=True, batch_size=3),
    ImageFolderDataModule(synthetic=True, batch_size=2, image_size=32),
    MLMDataModule(synthetic=True, batch_size=2, seq_len=16, vocab_size=100),
    LMTextDataModule(synthetic=True, batch_size=2, seq_len=16, vocab_size=50),
])
def test_synthetic_mode_of_every_module(dm):
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    first = batch["input_ids"] if isinstance(batch, dict) else batch[0]
    assert first.shape[0] == dm.batch_size
    assert len(dm.val_dataloader()) >= 1


def test_image_folder_with_standard_augmentations(tmp_path):
    pytest.importorskip("torchvision")
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            d = tmp_path / split / cls
            d.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (40 + i, 36), color=(i * 40, 80, 120)).save(d / f"{i}.png")
    dm = ImageFolderDataModule(data_dir=str(tmp_path), batch_size=2, num_workers=0, image_size=32)
    assert dm.num_classes == 2
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32
    # the augmentation of (epoch, index) is reproducible and does not touch the global RNG
    state = torch.get_rng_state()
    a, b = dm.train_set[1][0], dm.train_set[1][0]
    assert torch.equal(a, b) and torch.equal(state, torch.get_rng_state())
    dm.train_set.epoch = 1
    assert dm.val_set[0][0].shape == (3, 32, 32)
    # a loader worker draws the same augmentation as the main process
    in_worker = next(iter(torch.utils.data.DataLoader(dm.train_set, batch_size=None, sampler=[1], num_workers=1)))
    assert torch.equal(in_worker[0], dm.train_set[1][0])


@pytest.mark.parametrize("cls", [ImageFolderDataModule, LMTextDataModule, MLMDataModule])
def test_a_missing_data_dir_fails_at_construction_unless_synthetic(cls, tmp_path):
    with pytest.raises(ValueError, match="data_dir is required"):
        cls()
    with pytest.raises(ValueError, match="does not exist.*synthetic=true"):
        cls(data_dir=str(tmp_path / "nowhere"))
    assert cls(data_dir=str(tmp_path / "nowhere"), synthetic=True).synthetic


def test_mask_tokens_rates_and_specials():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (200, 128))
    maskable = torch.ones_like(ids, dtype=torch.bool)
    maskable[:, 0] = False
    out, labels = mask_tokens(ids, maskable, 1000, 4, 0.15, g)
    chosen = labels != -100
    assert 0.13 < chosen.float().mean() < 0.17
    assert not chosen[:, 0].any()
    assert torch.equal(labels[chosen], ids[chosen])
    assert 0.75 < (out[chosen] == 4).float().mean() < 0.85
    assert torch.equal(out[~chosen], ids[~chosen])


def test_mlm_trains_a_tokenizer_and_masks_reproducibly(tmp_path):
    pytest.importorskip("tokenizers")
    write_corpus(tmp_path)
    dm = MLMDataModule(data_dir=str(tmp_path), vocab_size=200, seq_len=16, batch_size=4, val_fraction=0.2)
    dm.setup()
    assert (tmp_path / ".mptrain" / "wordpiece200.json").is_file()
    assert 30 < dm.vocab_size <= 200
    item = dm.train_set[3]
    assert item["input_ids"].shape == (16,) and item["input_ids"][0] == dm.tokenizer.token_to_id("[CLS]")
    again = dm.train_set[3]
    assert torch.equal(item["input_ids"], again["input_ids"]) and torch.equal(item["labels"], again["labels"])
    masks0 = torch.stack([dm.train_set[i]["labels"] for i in range(len(dm.train_set))])
    dm.train_set.epoch = 1
    masks1 = torch.stack([dm.train_set[i]["labels"] for i in range(len(dm.train_set))])
    assert not torch.equal(masks0, masks1), "every epoch should draw new masks"
    assert 0.08 < (masks0 != -100).float().mean() < 0.22
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 16)
    # a second module reuses the saved tokenizer
    dm2 = MLMDataModule(data_dir=str(tmp_path), vocab_size=200, seq_len=16, batch_size=4, val_fraction=0.2)
    assert dm2.vocab_size == dm.vocab_size


def test_other_ranks_wait_for_the_tokenizer_rank_0_writes(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    from mptrain.data import tokenizer

    files = [str(write_corpus(tmp_path) / "a.txt")]
    path = str(tmp_path / "tok" / "wordpiece.json")
    monkeypatch.setattr(tokenizer, "world_and_rank", lambda: (2, 1))
    with pytest.raises(TimeoutError, match="rank 1: rank 0 did not write the tokenizer"):
        tokenizer.load_or_train(path, files, 100, timeout_s=0.0)
    monkeypatch.setattr(tokenizer, "world_and_rank", lambda: (2, 0))
    written = tokenizer.load_or_train(path, files, 100)
    monkeypatch.setattr(tokenizer, "world_and_rank", lambda: (2, 1))
    assert tokenizer.load_or_train(path, files, 100).get_vocab() == written.get_vocab()


@pytest.mark.parametrize("level", ["char", "word"])
def test_lm_text_windows_shift_by_one(tmp_path, level):
    write_corpus(tmp_path, split=True)
    dm = LMTextDataModule(data_dir=str(tmp_path), level=level, seq_len=12, batch_size=4)
    dm.setup()
    x, y = dm.train_set[2]
    assert x.shape == y.shape == (12,)
    assert torch.equal(x[1:], y[:-1])
    if level == "word":
        assert dm.vocab.itos[0] == "<unk>" and "fox" in dm.vocab.stoi and "<eos>" in dm.vocab.stoi
    else:
        assert "q" in dm.vocab.stoi
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (4, 12) and xb.dtype == torch.int64
    assert dm.vocab_size == len(dm.vocab)


def test_recipe_data_and_model_resume_mid_epoch_bitwise(tmp_path):
    """The quickstart's data module (ShardedSampler, shuffled) and model (dropout) under
    mptrain.Trainer: 4 steps, checkpoint, resume to 8 equals 8 uninterrupted steps."""
    from mptrain import Trainer
    from mptrain.models import ImageClassifier

    def run(root, max_steps, ckpt_path=None):
        torch.manual_seed(0)
        model = ImageClassifier(arch="digits_cnn", optimizer="adamw", lr=3e-3, warmup_steps=2, total_steps=8)
        trainer = Trainer(precision="32-true", accelerator="cpu", max_steps=max_steps, checkpoint_every_n_steps=4,
                          seed=0, limit_val_batches=0, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=root)
        trainer.fit(model, datamodule=DigitsDataModule(batch_size=16), ckpt_path=ckpt_path)
        return model, trainer

    full, _ = run(tmp_path / "a", 8)
    run(tmp_path / "b", 4)
    mid = next((tmp_path / "b").rglob("last.ckpt"))
    resumed, trainer = run(tmp_path / "c", 8, ckpt_path=str(mid))
    assert trainer.global_step == 8
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
