"""Mid-epoch resume for a plain ``DataLoader``: the Trainer converts the train loader, once Lightning has prepared
it, to a torchdata ``StatefulDataLoader``, whose position Lightning saves and restores.

A shuffled loader keeps torch's exact order (``ResumableRandomSampler`` runs ``RandomSampler``'s own code from a
generator state recorded each epoch); loader workers' RNGs are part of the worker state torchdata snapshots; other
samplers are fast-forwarded, exact when their order depends only on the epoch or when they keep state (a mid-epoch
resume with any other sampler warns, naming it).  Other loader classes and iterable datasets are left as they are.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler,
                              SequentialSampler, get_worker_info)
from torchdata.stateful_dataloader import Stateful, StatefulDataLoader
from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

from mptrain.compat.lightning import prepare_dataloader, set_sampler_epoch, wrap_dataloader_preparation
from mptrain.compat.torchdata import drop_iterator, live_iterator
from mptrain.resume.rng import preserved_rng, rng_state, set_rng_state

_BATCHING = (BatchSampler, StatefulBatchSampler)  # batch what their sampler gives, in its order
# order fixed by (seed, epoch), so a fast-forward replays it, or kept in the iterator's state
_RESTORABLE = (SequentialSampler, DistributedSampler, *_BATCHING, StatefulRandomSampler)
# and their subclasses: a DistributedSampler's order is a function of (seed, epoch) (e.g. mptrain.data.ShardedSampler)
_EPOCH_ORDERED = (DistributedSampler,)


class ResumableRandomSampler(RandomSampler):
    """``torch.utils.data.RandomSampler`` whose iterator can save and restore its position."""

    def __iter__(self) -> Iterator[int]:
        return _ResumableOrder(self)


class _ResumableOrder(Iterator[int]):
    """One epoch of a ``RandomSampler``: the generator state it started from and how far it got."""

    def __init__(self, sampler: RandomSampler):
        self.sampler = sampler
        self.yielded = 0
        self._start_state: Optional[torch.Tensor] = None
        self._order: Optional[Iterator[int]] = None

    def _begin(self, start_state: Optional[torch.Tensor]) -> None:
        generator = self.sampler.generator
        if start_state is not None:  # a restored epoch: its generator state, nothing drawn from the global RNG
            generator = generator or torch.Generator()
            generator.set_state(start_state)
        elif generator is None:  # what RandomSampler.__iter__ does without a generator, at the same moment
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator().manual_seed(seed)
        self._start_state = generator.get_state()
        view = copy.copy(self.sampler)
        view.generator = generator
        self._order = RandomSampler.__iter__(view)  # torch's own draws, from the recorded state

    def __next__(self) -> int:
        if self._order is None:
            self._begin(None)
        index = next(self._order)
        self.yielded += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.yielded, "generator": self._start_state}  # (0, None) until the epoch begins

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["generator"] is None:
            self._order, self._start_state, self.yielded = None, None, 0
            return
        self._begin(state["generator"])
        # drawn now, not lazily: a sampler's own generator must be where the saved epoch left it even if this
        # iterator is never read (a resume at the epoch's end begins the next epoch from that generator)
        for _ in range(state["yielded"]):
            next(self._order)
        self.yielded = state["yielded"]


class WorkerRngDataset(Dataset):
    """A map-style dataset whose state (saved in each loader worker) is that worker's RNG state.

    Attribute reads go to the wrapped dataset; a Stateful dataset's own state is kept too.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def state_dict(self) -> dict[str, Any]:
        own = self.dataset.state_dict() if isinstance(self.dataset, Stateful) else None
        # in the main process the RNG is ResumeState's, restored after the loader is rebuilt
        return {"rng": rng_state() if get_worker_info() is not None else None, "dataset": own}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["rng"] is not None:
            set_rng_state(state["rng"])
        if state["dataset"] is not None:
            self.dataset.load_state_dict(state["dataset"])


class ResumableDataLoader(StatefulDataLoader):
    """``StatefulDataLoader`` that sets its sampler's epoch (``epoch()``) before building an iterator.

    On a resume Lightning builds the iterator before it calls ``set_epoch``, and torchdata fast-forwards a restored
    iterator at once: a ``DistributedSampler`` would replay epoch 0's order."""

    def __init__(self, *args: Any, epoch: Optional[Callable[[], int]] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._epoch = epoch

    def __iter__(self):
        if self._epoch is not None and self.next_iter_state is not None:  # a restored iterator; else Lightning's
            set_sampler_epoch(self, self._epoch())                        # own call sets the epoch, once
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        if live_iterator(self) is not None:
            return super().state_dict()
        # torchdata builds an iterator to read the state from, drawing its base seed from the global RNG: a save
        # (after fit, before the first batch) must not change what training draws next
        with preserved_rng():
            state = super().state_dict()
        drop_iterator(self)
        return state


def to_resumable(loader: Any, epoch: Optional[Callable[[], int]] = None) -> Any:
    """A ``StatefulDataLoader`` equivalent to a plain ``DataLoader``; anything else is returned as is."""
    if type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset):
        return loader
    sampler = loader.sampler
    if type(sampler) is RandomSampler:
        # the user's sampler object stays (its attributes, set_epoch, identity); only its iterator records its
        # position: ResumableRandomSampler adds nothing but that
        sampler.__class__ = ResumableRandomSampler
    common = {k: getattr(loader, k) for k in ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                                              "multiprocessing_context", "generator", "prefetch_factor",
                                              "persistent_workers", "pin_memory_device")}
    if getattr(loader, "in_order", True) is False:  # torch >= 2.6
        common["in_order"] = False
    dataset = WorkerRngDataset(loader.dataset) if loader.num_workers > 0 else loader.dataset
    batches = loader.batch_sampler
    if batches is None or type(batches) is BatchSampler and batches.sampler is loader.sampler:  # no batching, or own
        return ResumableDataLoader(dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, sampler=sampler,
                                   epoch=epoch, **common)
    return ResumableDataLoader(dataset, batch_sampler=batches, epoch=epoch, **common)


def order_not_restorable(loader: Any) -> list[str]:
    """Names of the samplers of a resumable loader whose mid-epoch position cannot be restored exactly."""
    if not isinstance(loader, StatefulDataLoader):
        return []  # Lightning warns about a loader without state itself
    batches = loader.batch_sampler
    # a custom batch sampler decides the order alone
    samplers = [loader.sampler] if batches is None or type(batches) in _BATCHING else [batches]
    return [type(s).__name__ for s in samplers
            if not isinstance(s, (Stateful, ResumableRandomSampler, *_EPOCH_ORDERED)) and type(s) not in _RESTORABLE]


def make_train_loader_resumable(trainer: Any) -> None:
    """Convert the train loader right after Lightning prepares it (sampler injection included), by wrapping the
    data connector method that prepares it (no public hook lies in between)."""
    wrap_dataloader_preparation(trainer, lambda connector, prepare: _PrepareResumable(connector, trainer))


class _PrepareResumable:
    """Lightning's preparation of a loader, then the conversion of a train loader (a picklable callable:
    the Trainer and everything it holds pickle, ``strategy="ddp_spawn"`` sends them to its processes)."""

    def __init__(self, connector: Any, trainer: Any):
        self.connector = connector
        self.trainer = trainer

    def __call__(self, dataloader: Any, shuffle: bool, mode: Any) -> Any:
        from lightning.pytorch.trainer.states import RunningStage

        prepared = prepare_dataloader(self.connector, dataloader, shuffle=shuffle, mode=mode)
        if mode != RunningStage.TRAINING:
            return prepared
        return to_resumable(prepared, epoch=FitEpoch(self.trainer))


class FitEpoch:
    """The epoch the fit loop is in (the sampler's epoch), as a picklable callable."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def __call__(self) -> int:
        return self.trainer.fit_loop.epoch_progress.current.processed
