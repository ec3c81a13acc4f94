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


def test_skip_resumes_mid_epoch(monkeypatch):
    monkeypatch.setattr(sampling, "world_and_rank", lambda: (1, 0))
    s = ShardedSampler(20, seed=0)
    s.set_epoch(1)
    full = list(s)
    s.skip(7)
    assert len(s) == 13
    assert list(s) == full[7:]
    assert list(s) == full  # the skip applies to one iteration only


def test_without_set_epoch_each_iteration_reshuffles(monkeypatch):
    monkeypatch.setattr(sampling, "world_and_rank", lambda: (1, 0))
    s = ShardedSampler(30, seed=0)
    assert list(s) != list(s)


def test_fabric_leaves_it_alone():
    # Fabric swaps only samplers that are not DistributedSampler instances.
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
