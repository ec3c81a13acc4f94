"""ShardedSampler: disjoint per-rank shards, order a function of (seed, epoch), mid-epoch start."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mptrain.data import sampling
from mptrain.data.sampling import ShardedSampler, sample_seed


def shard(monkeypatch, n, world, rank, epoch=0, **kw):
    monkeypatch.setattr(sampling, "world_and_rank", lambda: (world, rank))
    s = ShardedSampler(n, **kw)
    s.set_epoch(epoch)
    return list(s), len(s)


@pytest.mark.parametrize("n, world", [(10, 2), (11, 2), (103, 4), (7, 3)])
def test_shards_are_disjoint_equal_and_cover_all_but_the_tail(monkeypatch, n, world):
    shards = [shard(monkeypatch, n, world, r, seed=3) for r in range(world)]
    flat = [i for s, _ in shards for i in s]
    assert len(flat) == len(set(flat)), "a sample landed on two ranks"
    assert {len(s) for s, _ in shards} == {n // world}
    assert all(length == n // world for _, length in shards)


def test_order_depends_on_seed_and_epoch_only(monkeypatch):
    a, _ = shard(monkeypatch, 50, 1, 0, epoch=2, seed=1)
    b, _ = shard(monkeypatch, 50, 1, 0, epoch=2, seed=1)
    c, _ = shard(monkeypatch, 50, 1, 0, epoch=3, seed=1)
    d, _ = shard(monkeypatch, 50, 1, 0, epoch=2, seed=2)
    assert a == b and a != c and a != d and sorted(a) == list(range(50))


def test_unshuffled_keeps_order(monkeypatch):
    s, _ = shard(monkeypatch, 6, 2, 1, shuffle=False)
    assert s == [1, 3, 5]


def test_order_is_a_function_of_seed_and_epoch_only(monkeypatch):
    """No state of its own: torchdata's StatefulDataLoader then fast-forwards it on resume
    (a state_dict without the position would restart the epoch)."""
    from torchdata.stateful_dataloader import Stateful

    monkeypatch.setattr(sampling, "world_and_rank", lambda: (1, 0))
    a, b = ShardedSampler(20, seed=3), ShardedSampler(20, seed=3)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b) and not isinstance(a, Stateful)


def test_iterating_is_pure_and_set_epoch_reshuffles(monkeypatch):
    """A resume iterates the sampler to fast-forward it: that must not change the order."""
    monkeypatch.setattr(sampling, "world_and_rank", lambda: (1, 0))
    s = ShardedSampler(30, seed=0)
    first = list(s)
    assert list(s) == first
    s.set_epoch(1)
    assert list(s) != first


def test_lightning_leaves_it_alone():
    # Lightning's use_distributed_sampler swaps only samplers that are not DistributedSampler instances.
    assert isinstance(ShardedSampler(4), DistributedSampler)


def test_dataset_sees_the_epoch(monkeypatch):
    monkeypatch.setattr(sampling, "world_and_rank", lambda: (1, 0))

    class DS(TensorDataset):
        epoch = 0

    ds = DS(torch.arange(4))
    s = ShardedSampler(4, dataset=ds)
    s.set_epoch(5)
    list(DataLoader(ds, sampler=s))
    assert ds.epoch == 5


def test_world_and_rank_reads_torchrun_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert sampling.world_and_rank() == (4, 3)


def test_sample_seed_differs_per_index_and_epoch():
    seeds = {sample_seed(0, e, i) for e in range(3) for i in range(100)}
    assert len(seeds) == 300
