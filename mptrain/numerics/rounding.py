"""Which updates bf16 round-to-nearest would lose: the measure for choosing ``bf16-sr`` or ``bf16-master`` over
``bf16-true``.

A ``bf16-true`` step computes the update and writes ``w + u`` back to the bf16 weight ``w`` rounded to nearest: when
``|u|`` is below half a bf16 ulp of ``w`` (2^-9 of ``|w|`` or less), the weight does not move at all.  With a small
learning rate (a fine-tune, the end of a cosine schedule) that can be most updates: the run stalls while its loss
curve looks merely flat.  ``bf16-master`` keeps the fp32 weight those updates accumulate in; ``bf16-sr`` rounds
stochastically, so each update moves the weight in expectation (without the fp32 copy's 4 bytes per parameter).

:func:`rounding_loss` steps a copy of the user's optimizer once, in fp32, on fp32 copies of the weights (the fp32
masters where the optimizer keeps them) with the current gradients, at each group's current learning rate and state,
and counts per parameter group the updates ``u`` (non-zero) for which ``bf16(bf16(w) + u) == bf16(w)``: what a
bf16-true step would lose (in fp32 math, as the fused kernels compute, then rounded to nearest).  The model, its
gradients and the optimizer are left as they were.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

#: lost share above which bf16-true is not advised (a tenth of the updates dropped every step)
ADVICE_THRESHOLD = 0.1


@dataclass
class GroupRounding:
    """One parameter group: how much of one step bf16 round-to-nearest would lose."""

    group: int
    lr: float
    params: int  # tensors with a gradient
    elements: int  # their elements
    updated: int  # elements with a non-zero update
    lost: int  # of those, updates round-to-nearest leaves out entirely
    lost_share: float  # lost / updated
    lost_mass_share: float  # sum |u| over the lost / sum |u|: how much of the step's movement is dropped
    median_update_to_half_ulp: float  # median over the updated elements of |u| / (half a bf16 ulp of w)
    worst: list = field(default_factory=list)  # up to 3 (parameter name, its lost share), highest first

    def to_dict(self) -> dict:
        return asdict(self)


def _half_ulp(w: torch.Tensor) -> torch.Tensor:
    """Half the spacing of bf16 values at ``w`` (fp32 of bf16 values): the upper spacing, from the bit pattern."""
    bits = w.float().view(torch.int32)
    up = (bits + 0x10000).view(torch.float32)
    return (up - w.float()).abs() / 2


def _shadow_optimizer(optimizer: torch.optim.Optimizer, weights: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``weights`` (one per param, in order), with its groups'
    hyper-parameters and its state (moments as fp32: the weights are)."""
    groups = [dict({k: v for k, v in g.items() if k != "params"}, params=ws)
              for g, ws in zip(optimizer.param_groups, weights)]
    try:
        shadow = type(optimizer)(groups)
    except TypeError as e:
        raise ValueError(f"rounding_loss: cannot make a {type(optimizer).__name__} from its own param groups ({e}); "
                         "pass an optimizer whose constructor takes them (torch.optim's and mptrain's do)") from None
    shadow.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # loading may keep tensors (step counts) as given
    return shadow


def _fp32_weight(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    """The fp32 value ``p`` stands for: its master when the optimizer keeps one (``*-master``), else ``p``."""
    if getattr(optimizer, "_mptrain_fused", False) and optimizer.uses_master(p):
        return optimizer.master_param(p)
    return p


@torch.no_grad()
def rounding_loss(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                  loss_fn: Optional[Callable[[], torch.Tensor]] = None,
                  dtype: torch.dtype = torch.bfloat16) -> list[GroupRounding]:
    """Per parameter group of ``optimizer``, the share of one step's updates that round-to-nearest to ``dtype``
    (bf16) would lose at the current learning rate; see the module docstring.  The parameters need gradients: run a
    backward first, or pass ``loss_fn`` (called with grad enabled, its result backpropagated; the gradients it
    leaves stay).  ``model`` names the parameters in ``worst``.  Nothing of the model or optimizer changes."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"rounding_loss: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if loss_fn is not None:
        with torch.enable_grad():
            loss_fn().backward()
    names = {id(p): n for n, p in model.named_parameters()}
    weights, pairs = [], []  # per group: an fp32 copy of every param; the (param, copy) pairs with a gradient
    for g in optimizer.param_groups:
        ws, ps = [], []
        for p in g["params"]:
            w = _fp32_weight(optimizer, p).detach().to(torch.float32, copy=True)
            ws.append(w)
            if p.grad is not None:
                w.grad = p.grad.detach().to(torch.float32, copy=True)
                ps.append((p, w))
        weights.append(ws)
        pairs.append(ps)
    if not any(pairs):
        raise ValueError("rounding_loss: no parameter of the optimizer has a gradient; run a backward first or pass "
                         "loss_fn")
    before = [[w.clone() for _, w in ps] for ps in pairs]
    _shadow_optimizer(optimizer, weights).step()
    out = []
    for index, (g, olds, ps) in enumerate(zip(optimizer.param_groups, before, pairs)):
        lr = g["lr"]
        lr = float(lr.item()) if torch.is_tensor(lr) else float(lr)
        updated = lost = elements = 0
        mass = lost_mass = 0.0
        ratios, worst = [], []
        for (p, w_new), w_old in zip(ps, olds):
            u = w_new - w_old
            low = w_old.to(dtype)
            moved = u != 0
            gone = moved & ((low.float() + u).to(dtype) == low)
            n_moved, n_gone = int(moved.sum()), int(gone.sum())
            elements += u.numel()
            updated += n_moved
            lost += n_gone
            mass += float(u.abs().sum(dtype=torch.float64))
            lost_mass += float(u[gone].abs().sum(dtype=torch.float64))
            if n_moved:
                half = _half_ulp(low)[moved]
                ratios.append((u[moved].abs() / torch.where(half > 0, half, torch.ones_like(half))).flatten())
                worst.append((names.get(id(p), f"group {index} param"), n_gone / n_moved))
        median = float(torch.cat(ratios).median()) if ratios else float("nan")
        worst.sort(key=lambda item: -item[1])
        out.append(GroupRounding(index, lr, len(ps), elements, updated, lost, lost / updated if updated else 0.0,
                                 lost_mass / mass if mass else 0.0, median, worst[:3]))
    return out


def format_rounding_report(rows: list[GroupRounding], dtype: str = "bf16") -> str:
    """A table of :func:`rounding_loss`'s groups and, last, the advice (bf16-true, or bf16-sr / bf16-master)."""
    head = (f"{'group':>5} {'lr':>9} {'params':>6} {'elements':>12} {'updated':>12} {'lost':>7} {'lost mass':>9} "
            f"{'|u|/half-ulp':>12}  worst")
    lines = [head, "-" * len(head)]
    for r in rows:
        worst = ", ".join(f"{n} {100 * s:.0f}%" for n, s in r.worst)
        lines.append(f"{r.group:>5} {r.lr:>9.3g} {r.params:>6} {r.elements:>12,} {r.updated:>12,} "
                     f"{100 * r.lost_share:>6.1f}% {100 * r.lost_mass_share:>8.1f}% "
                     f"{r.median_update_to_half_ulp:>12.3g}  {worst}")
    updated = sum(r.updated for r in rows)
    share = sum(r.lost for r in rows) / updated if updated else 0.0
    if share > ADVICE_THRESHOLD:
        advice = (f"{dtype} round-to-nearest would lose {100 * share:.1f}% of this step's updates: use precision="
                  f"'bf16-sr' (no fp32 copy) or 'bf16-master' rather than 'bf16-true'")
    else:
        advice = (f"{dtype} round-to-nearest would lose {100 * share:.1f}% of this step's updates: 'bf16-true' keeps "
                  f"most of them at this learning rate (re-check where the schedule lowers it)")
    return "\n".join(lines + [advice])


__all__ = ["GroupRounding", "rounding_loss", "format_rounding_report"]
