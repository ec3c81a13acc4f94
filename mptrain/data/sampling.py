"""Per-rank, per-epoch deterministic sampling and worker seeding.

Why our own sampler instead of Lightning's: with ``use_distributed_sampler`` Lightning swaps a
Random/SequentialSampler for a ``DistributedSampler``, which pads the last shard with repeated
samples, so a sample can land on two ranks in one epoch.  ``ShardedSampler`` subclasses
``DistributedSampler`` so Lightning leaves it alone; its order is a pure function of (seed,
epoch), the same on every rank, so a resumed run replays exactly what the uninterrupted run
drew (it has no state of its own: the Trainer's resumable loader fast-forwards it by the
samples already drawn this epoch); it drops the ragged tail instead of padding.
"""
from __future__ import annotations

import os
import random
from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DistributedSampler


def world_and_rank() -> tuple[int, int]:
    """(world size, global rank): the process group when it exists, else torchrun's environment."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


class ShardedSampler(DistributedSampler):
    """Indices of one rank's shard of ``range(num_samples)`` for the current epoch.

    The rank and world size are read when the sampler is iterated or measured, not when it is
    built, so a loader made before the process group exists still shards correctly.

    Args:
        num_samples: dataset length.
        shuffle: permute with a generator seeded by ``seed + epoch`` (same on every rank).
        seed: base seed; ``None`` takes ``PL_GLOBAL_SEED`` (set by ``seed_everything``) or 0.
        drop_last: drop the tail that does not divide by the world size (never pads with repeats).
        dataset: if it has an ``epoch`` attribute, it is set to the epoch being iterated (datasets
            seed per-sample randomness with it; loader workers fork after this, so they see it).
    """

    def __init__(
        self,
        num_samples: int,
        shuffle: bool = True,
        seed: Optional[int] = None,
        drop_last: bool = True,
        dataset: Optional[object] = None,
    ):
        # DistributedSampler.__init__ wants a live process group; we resolve ranks lazily instead.
        self.total = int(num_samples)
        self.shuffle = shuffle
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.dataset = dataset

    @property
    def num_replicas(self) -> int:
        return world_and_rank()[0]

    @property
    def rank(self) -> int:
        return world_and_rank()[1]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _shard_size(self, world: int) -> int:
        if self.drop_last or self.total < world:
            return self.total // world if self.total >= world else (1 if self.total else 0)
        return -(-self.total // world)

    def __len__(self) -> int:
        return max(0, self._shard_size(self.num_replicas))

    def indices(self, epoch: int) -> list[int]:
        world, rank = world_and_rank()
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.total, generator=g).tolist()
        else:
            order = list(range(self.total))
        per_rank = self._shard_size(world)
        if self.total < world:  # fewer samples than ranks: every rank needs something to step on
            return [order[rank % self.total]] if self.total else []
        if self.drop_last:
            order = order[: per_rank * world]
        return order[rank::world]

    def __iter__(self) -> Iterator[int]:
        shard = self.indices(self.epoch)
        if self.dataset is not None and hasattr(self.dataset, "epoch"):
            self.dataset.epoch = self.epoch
        return iter(shard)  # iterating is pure: a resume may iterate to fast-forward (the epoch is set_epoch's)


def seed_worker(worker_id: int) -> None:
    """Seed Python's and NumPy's RNGs in a loader worker from torch's per-worker seed.

    torch already gives worker ``i`` the seed ``base_seed + i``; NumPy and ``random`` would
    otherwise start from the same forked state in every worker.
    """
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A seed for one sample's randomness (augmentation, masking) that does not depend on which
    worker or rank loads it, so a resumed run draws exactly what the uninterrupted run drew."""
    return (seed * 1_000_003 + epoch * 7_919 + index) % (2**63 - 1)
