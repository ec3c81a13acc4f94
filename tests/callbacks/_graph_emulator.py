"""A CPU stand-in for CUDA graphs, faithful enough to test code that captures and replays.

A capture runs nothing on the GPU: it records kernels that read and write fixed addresses.  Here a
capture records every aten op issued in the block (below autograd, as kernels are), with the tensor
objects it read and wrote (the fixed addresses); afterwards the tensors the block allocated hold
NaN (on the GPU they are uninitialised until the first replay) and writes to tensors that existed
before the capture are undone.  A replay re-runs the recorded ops on the same tensor objects and
writes each op's new outputs into the tensors recorded at capture, without touching autograd's
version counters (a replay writes memory, not tensors).  A host sync inside a capture raises as
CUDA does.  Code that reads a capture-time tensor which the step replaced since (a stale address)
gets stale values here, wrong values on the GPU: both fail a comparison with eager training.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

SYNCING = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "_unique2", "unique_dim",
           "unique_consecutive"}
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class FakeGraph:
    """Stands for ``torch.cuda.CUDAGraph``."""

    def __init__(self):
        self.ops: list = []
        self.replays = 0

    def replay(self) -> None:
        with torch._C._AutoDispatchBelowADInplaceOrView(), torch.no_grad():
            for func, args, kwargs, recorded in self.ops:
                if func.overloadpacket.__name__ in NO_KERNEL:
                    continue
                new = _outputs(func, func(*args, **kwargs))
                for (rec, fresh), (out, _) in zip(recorded, new):
                    if fresh:
                        rec.copy_(out)
        self.replays += 1


class _Record(TorchDispatchMode):
    def __init__(self, graph: FakeGraph):
        super().__init__()
        self.graph, self.fresh, self.saved = graph, set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if name in SYNCING or bool_index:  # a boolean index is a nonzero: its size is read on the host
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing (aten.{name})")
        # every tensor that existed before the capture, not only the schema's mutable arguments:
        # some kernels write more than they declare (native_batch_norm's running statistics)
        for t in tree_leaves((args, kwargs)):
            self._save(t)
        out = func(*args, **kwargs)
        recorded = _outputs(func, out)
        self.fresh.update(t.untyped_storage().data_ptr() for t, fresh in recorded if fresh)
        self.graph.ops.append((func, _copy_containers(args), _copy_containers(kwargs), recorded))
        return out

    def _save(self, t) -> None:
        """Undo at the end: a write to a tensor that existed before the capture."""
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.fresh:
            s = t.untyped_storage()
            self.saved.setdefault(s.data_ptr(), (s, s.clone()))

    def finish(self) -> None:
        for storage, before in self.saved.values():
            storage.copy_(before)
        with torch._C._AutoDispatchBelowADInplaceOrView(), torch.no_grad():
            for _, _, _, recorded in self.graph.ops:
                for t, fresh in recorded:
                    if fresh:
                        t.fill_(float("nan") if t.is_floating_point() else 7)


def _outputs(func, out) -> list:
    """[(tensor, fresh)] for the op's tensor outputs; fresh: newly allocated (no alias in the schema)."""
    returns = func._schema.returns
    items = [out] if len(returns) == 1 else list(out) if returns else []
    flat = []
    for ret, item in zip(returns, items):
        fresh = ret.alias_info is None
        for t in item if isinstance(item, (list, tuple)) else [item]:
            if isinstance(t, torch.Tensor):
                flat.append((t, fresh))
    return flat


def _copy_containers(x):
    if isinstance(x, (list, tuple)):
        return type(x)(_copy_containers(v) for v in x)
    if isinstance(x, dict):
        return {k: _copy_containers(v) for k, v in x.items()}
    return x


@contextlib.contextmanager
def _graph(graph: FakeGraph, pool=None, stream=None, capture_error_mode="global"):
    mode = _Record(graph)
    try:
        with mode:
            yield
    finally:
        mode.finish()


def emulate_cuda_graphs(monkeypatch) -> None:
    """Route torch.cuda's graph API (as the capture code calls it) to the emulator."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
