"""What every mptrain data module shares: loaders with workers, pinned memory, seeded workers,
per-rank sharding (``ShardedSampler``) and synthetic batches made on the training device."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from mptrain.data.sampling import ShardedSampler, seed_worker


def training_device(datamodule: L.LightningDataModule) -> torch.device:
    """The device the attached trainer trains on; without one, this process's GPU or the CPU."""
    if datamodule.trainer is not None:
        return datamodule.trainer.strategy.root_device
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def require_data_dir(data_dir: Optional[str], synthetic: bool) -> None:
    """A missing data folder fails when the data module is built (the CLI reports it as one
    line, before any log dir exists), not at setup inside ``fit``."""
    if synthetic:
        return
    if data_dir is None:
        raise ValueError("data.data_dir is required unless data.synthetic=true")
    if not os.path.exists(data_dir):
        raise ValueError(f"data.data_dir={data_dir!r} does not exist; give the data folder (--data.data_dir=PATH) "
                         "or train on device-made batches (--data.synthetic=true)")


class SyntheticBatches(Dataset):
    """``length`` batches cycled from ``distinct`` ones built once on the training device from a seeded generator:
    a benchmark measures the model, not the loader (no all-zero data, no host-to-device copy per step)."""

    def __init__(self, make: Callable[[torch.Generator, torch.device], Any], length: int,
                 device: Callable[[], torch.device], distinct: int = 4, seed: int = 0):
        self.make, self.length, self.device, self.distinct, self.seed = make, int(length), device, distinct, seed
        self._cache: Optional[list] = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if self._cache is None:
            device = self.device()
            g = torch.Generator(device=device).manual_seed(self.seed)
            with torch.no_grad():
                self._cache = [self.make(g, device) for _ in range(self.distinct)]
        return self._cache[index % self.distinct]


class MPTDataModule(L.LightningDataModule):
    """Base class: subclasses fill ``self.train_set`` / ``self.val_set`` in ``load``, make one synthetic batch in
    ``make_synthetic_batch``, and may set ``self.collate_fn``.

    Args:
        batch_size: per-rank batch size.
        num_workers: loader worker processes (0 loads in the main process).
        pin_memory: pin host batches when training on a GPU (ignored without CUDA).
        seed: seed of the shuffling order and of per-sample randomness.
        synthetic: use device-generated random batches of the real shapes instead of files.
        synthetic_batches: training batches per epoch in synthetic mode (validation gets 2: a
            synthetic run measures training, and a short run should not wait on validation).
    """

    def __init__(self, batch_size: int, num_workers: int = 0, pin_memory: bool = True, seed: int = 0,
                 synthetic: bool = False, synthetic_batches: int = 1000):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.seed, self.synthetic, self.synthetic_batches = seed, synthetic, synthetic_batches
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None
        self.collate_fn: Optional[Callable] = None

    def setup(self, stage: str = "fit") -> None:
        """Build the sets once: the subclass's ``load`` from files, or synthetic ones (made on the training device at
        the first batch: the trainer is attached by then)."""
        if self.train_set is not None:
            return
        if not self.synthetic:
            self.load(stage)
            return
        device = lambda: training_device(self)  # noqa: E731
        self.train_set = SyntheticBatches(self.make_synthetic_batch, self.synthetic_batches, device, seed=self.seed)
        self.val_set = SyntheticBatches(self.make_synthetic_batch, 2, device, seed=self.seed + 1)

    def load(self, stage: str) -> None:
        """Fill ``self.train_set`` / ``self.val_set`` from the real data (subclasses)."""
        raise NotImplementedError(f"{type(self).__name__} reads no files; use synthetic=True")

    def make_synthetic_batch(self, g: torch.Generator, device: torch.device) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no synthetic mode")

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for a dataloader")
        if isinstance(dataset, SyntheticBatches):
            sampler = ShardedSampler(len(dataset), shuffle=False, seed=self.seed)
            return DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=0)
        sampler = ShardedSampler(len(dataset), shuffle=train, seed=self.seed, dataset=dataset)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=train,
                          collate_fn=self.collate_fn, pin_memory=self.pin_memory and torch.cuda.is_available(),
                          num_workers=self.num_workers, worker_init_fn=seed_worker if self.num_workers > 0 else None,
                          persistent_workers=False)  # workers fork per epoch, after the sampler set the dataset's epoch

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)
