"""Which fused kernel ``F.scaled_dot_product_attention`` runs: mptrain's measured priority per GPU generation.

torch picks the first back end of its priority list whose checks pass for the call (shapes, mask, dropout, dtype).
mptrain puts the back end measured fastest for training on the GPU at hand first, around every forward (the
plugin's ``forward_context``), whatever order the installed torch has.  Measured on torch 2.11 (H100), the order
decides eager steps; compiled graphs took cuDNN whichever order was in force while they were traced.  Nothing
else changes: a back end that cannot take a call is passed over exactly as torch would, and math stays last.

``sdpa=`` on the plugin and the Trainer:

- ``"auto"`` (default): :data:`MEASURED_ORDER` for the device's compute capability, torch's own order elsewhere.
- ``"torch"``: torch's own order (the off switch).
- a list of back-end names (``"cudnn"``, ``"flash"``, ``"efficient"``, ``"math"``): that priority; the others
  follow in the order of :data:`BACKENDS`.

A back end the user switched off (``torch.backends.cuda.enable_flash_sdp(False)`` and its kin) stays off, and a
``sdpa_kernel`` context in the user's own forward overrides this one inside it.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Optional, Sequence, Union

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}

# Compute capability (major) -> priority, from `python3 dev/sdpa_choice.py` on the GPU (docs/PERFORMANCE.md has
# the table): on an H100, cuDNN ran the user BERT's and the 1.2B Llama's attention fastest (eager flash: 1.6 ms
# more a step on two Llama layers); compiled graphs took cuDNN in every order tried.
MEASURED_ORDER: dict[int, tuple[str, ...]] = {
    9: ("cudnn", "flash", "efficient", "math"),
}

# a torch without sdpa_kernel(set_priority=...) cannot take an order: "auto" then leaves torch's, a list is refused
_HAS_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def parse_sdpa(value: Any) -> Union[str, tuple[str, ...]]:
    """``"auto"``, ``"torch"`` or a tuple of back-end names; ValueError naming the value and the valid ones."""
    if value in ("auto", "torch"):
        return value
    names = [value] if isinstance(value, str) else value
    if isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names):
        bad = [n for n in names if n not in BACKENDS]
        if not bad and len(set(names)) == len(names):
            if not _HAS_PRIORITY:
                raise ValueError(f"sdpa={value!r}: torch {torch.__version__} cannot set the back ends' priority "
                                 f"(torch.nn.attention.sdpa_kernel has no set_priority); use sdpa='auto' or 'torch', "
                                 f"or a newer torch")
            return tuple(names)
    raise ValueError(f"sdpa={value!r} is not supported. Valid values: 'auto' (mptrain's measured order for the GPU), "
                     f"'torch' (torch's own order), or a list of distinct back ends in priority order from "
                     f"{', '.join(map(repr, BACKENDS))}, e.g. sdpa=['flash', 'cudnn']")


def resolve(spec: Union[str, Sequence[str]], device: torch.device) -> Optional[tuple[str, ...]]:
    """The priority to put in force on ``device``, or None for torch's own."""
    if spec == "torch" or device.type != "cuda" or not _HAS_PRIORITY:
        return None
    if spec == "auto":
        return MEASURED_ORDER.get(torch.cuda.get_device_capability(device)[0])
    return tuple(spec)


_ENABLED = {
    "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
    "flash": torch.backends.cuda.flash_sdp_enabled,
    "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    "math": torch.backends.cuda.math_sdp_enabled,
}


def priority_context(order: Optional[Sequence[str]]) -> contextlib.AbstractContextManager:
    """``order`` first, then the back ends it leaves out: every back end enabled now stays enabled (a restriction
    would make a call that no listed back end takes fail instead of falling through), none is switched on."""
    if order is None:
        return contextlib.nullcontext()
    names = list(order) + [n for n in BACKENDS if n not in order]
    return sdpa_kernel([BACKENDS[n] for n in names if _ENABLED[n]()], set_priority=True)
