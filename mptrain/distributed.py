"""What Fabric does not do for us: rank-zero helpers, found_inf all-reduce, gathering RNG states."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_max_(t: torch.Tensor) -> torch.Tensor:
    """found_inf must agree on every rank, or ranks would diverge (one steps, one skips)."""
    if is_dist() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def grads_all_reduced(strategy: Any) -> bool:
    """True when the strategy leaves every rank with the same, all-reduced gradients (plain
    DDP): then found_inf computed from them is already identical on every rank.  DeepSpeed
    derives from Fabric's DDPStrategy but may partition gradients (ZeRO): not counted."""
    from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy

    return isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy)


def tune_ddp(strategy: Any, module: torch.nn.Module, user_strategy: Any) -> None:
    """Our defaults for the DDP wrapper, applied only when the user named the strategy by a
    string (a strategy object is taken as given):

    * ``gradient_as_bucket_view=True``: gradients live in DDP's all-reduce buckets, so the
      per-parameter copy into the bucket and back (two launches per parameter per step,
      ~400 for BERT-base) disappears; ``zero_grad(set_to_none=True)`` stays valid.
    * ``broadcast_buffers`` only if the module has floating-point buffers (BatchNorm running
      statistics): otherwise every forward would start with a broadcast, a collective that
      makes the ranks wait for each other before any compute (BERT's buffers are constant
      position and token-type ids)."""
    if not grads_all_reduced(strategy) or not isinstance(user_strategy, str):
        return
    kwargs = getattr(strategy, "_ddp_kwargs", None)
    if kwargs is None:  # a Lightning version without the attribute: keep its defaults
        return
    kwargs.setdefault("gradient_as_bucket_view", True)
    kwargs.setdefault("broadcast_buffers", any(b.is_floating_point() for b in module.buffers()))


def rng_state() -> dict:
    """This process's RNG states, in types ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": np_state[0],
            "key": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_objects(obj: Any) -> list:
    """Every rank's ``obj``, in rank order (just ``[obj]`` without a process group)."""
    if not is_dist() or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

