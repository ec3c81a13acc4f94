"""The dtype groups every layer of mptrain tests against, defined once here: ``ops`` imports only torch, so
``nn``, ``optim``, ``precision`` and (through ``precision``) ``callbacks`` may all import it."""
from __future__ import annotations

import torch

#: the 16-bit float dtypes: what the half modes keep weights and compute in, and what the fp32 fallback upcasts
HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
