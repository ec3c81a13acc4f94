"""Resuming a checkpoint in another precision mode: one rule for every change.

Every mode but ``16-true`` / ``bf16-true`` keeps its weights and its optimizer state in fp32 (``*-master`` and
``fp8-master`` in the masters, ``32-true`` and ``*-mixed`` in fp32 parameters), so its checkpoint holds fp32 weights
and fp32 optimizer state; the two half ``*-true`` modes keep both in half precision.  The rule: a resume may change
the mode when the new mode keeps every saved value exactly, that is into any mode but ``16-true`` / ``bf16-true``
(which would round the saved state to half) and ``bf16-sr`` (bf16 weights, fp32 optimizer state: it would round
the saved fp32 weights; from ``bf16-true``, whose weights are bf16 already, nothing rounds and the change is
allowed); such a change warns once, naming both modes, because the resumed run cannot repeat the original one (the
loss scaler's state carries over between modes that have one, starts afresh in a mode that gains one, and is
dropped by a mode without).  A change that would round is refused.  A checkpoint without mptrain's precision state
(plain Lightning) is loaded as Lightning loads it.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_warn

HALF_STATE_MODES = ("16-true", "bf16-true")  # half weights and half optimizer state in the checkpoint
HALF_WEIGHT_MODES = HALF_STATE_MODES + ("bf16-sr",)  # half weights in the checkpoint
RULE = ("a resume may change the precision mode, except into 16-true, bf16-true or bf16-sr, whose half weights "
        "(and, in the *-true modes, half optimizer state) would round the checkpoint's fp32 state; bf16-true into "
        "bf16-sr rounds nothing (docs/resume.md)")


def rounds_saved_state(saved: str, now: str) -> bool:
    """Whether resuming a checkpoint trained in ``saved`` in ``now`` would round a saved value."""
    return now in HALF_WEIGHT_MODES and now != saved and (saved, now) != ("bf16-true", "bf16-sr")


def saved_mode(checkpoint: dict[str, Any]) -> Optional[str]:
    """The mode a checkpoint's run started in, from any mptrain precision plugin's state in it; None for none."""
    for value in checkpoint.values():
        if isinstance(value, dict) and isinstance(value.get("initial_precision"), str) and "guard" in value:
            return value["initial_precision"]
    return None


def check_mode_change(saved: Optional[str], now: str) -> None:
    """Refuse a resume in ``now`` of a checkpoint trained in ``saved`` against the rule, or warn that it changes."""
    if saved is None or saved == now:
        return
    if rounds_saved_state(saved, now):
        raise ValueError(f"cannot resume a {saved!r} checkpoint in {now!r}: {RULE}. Resume in {saved!r}, or start a "
                         f"new run from the weights alone (LightningModule.load_from_checkpoint(path))")
    rank_zero_warn(f"resuming a {saved!r} checkpoint in {now!r}: the weights and optimizer state carry over exactly, "
                   f"but this run will not repeat the original one ({RULE})")
