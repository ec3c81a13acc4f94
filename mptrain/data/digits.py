"""scikit-learn's handwritten digits (1,797 real 8x8 images, no download): the quickstart's data set."""
from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from mptrain.data.module import MPTDataModule


class DigitsDataModule(MPTDataModule):
    """Digits split into train / validation with a fixed permutation (``split_seed``).

    Args:
        val_fraction: share of the 1,797 images held out for validation.
        split_seed: seed of the train/val split (independent of the shuffling seed).
        (others: see ``MPTDataModule``)
    """

    num_classes = 10

    def __init__(self, batch_size: int = 32, num_workers: int = 0, pin_memory: bool = True, seed: int = 0,
                 synthetic: bool = False, synthetic_batches: int = 100, val_fraction: float = 0.2,
                 split_seed: int = 0):
        super().__init__(batch_size, num_workers, pin_memory, seed, synthetic, synthetic_batches)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        self.val_fraction, self.split_seed = val_fraction, split_seed

    def make_synthetic_batch(self, g, device):
        x = torch.rand(self.batch_size, 1, 8, 8, generator=g, device=device)
        y = torch.randint(0, self.num_classes, (self.batch_size,), generator=g, device=device)
        return x, y

    def load(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
        y = torch.tensor(bunch.target, dtype=torch.int64)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = int(round(len(x) * self.val_fraction))
        val, train = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])
