"""Per-rank, per-epoch deterministic sampling and worker seeding.

Not Lightning's ``DistributedSampler`` swap: it pads the last shard with repeats (a sample can land on two ranks in
one epoch).  ``ShardedSampler`` subclasses ``DistributedSampler`` so Lightning leaves it alone, drops the ragged tail
instead, and keeps no state: its order is a pure function of (seed, epoch), so the resumable loader fast-forwards it.
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

    def __init__(self, num_samples: int, shuffle: bool = True, seed: Optional[int] = None, drop_last: bool = True,
                 dataset: Optional[object] = None):
        # no DistributedSampler.__init__: it wants a live process group, and the ranks are read lazily
        self.total, self.shuffle, self.drop_last, self.dataset = int(num_samples), shuffle, drop_last, dataset
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else int(seed)
        self.epoch = 0

    @property
    def num_replicas(self) -> int:
        return world_and_rank()[0]

    @property
    def rank(self) -> int:
        return world_and_rank()[1]

    def __len__(self) -> int:
        world = self.num_replicas
        if self.total < world:  # fewer samples than ranks: every rank needs something to step on
            return min(self.total, 1)
        return self.total // world if self.drop_last else -(-self.total // world)

    def indices(self, epoch: int) -> list[int]:
        world, rank = world_and_rank()
        g = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.total, generator=g).tolist() if self.shuffle else list(range(self.total))
        if self.total < world:
            return [order[rank % self.total]] if self.total else []
        if self.drop_last:
            order = order[: self.total // world * world]
        return order[rank::world]

    def __iter__(self) -> Iterator[int]:
        shard = self.indices(self.epoch)
        if hasattr(self.dataset, "epoch"):
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
