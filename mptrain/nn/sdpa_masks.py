"""No materialized attention mask where a transformers model needs none, under ``torch.compile`` too.

transformers builds the mask of an SDPA model in its mask interface (``masking_utils``): with no padding
(``attention_mask=None``) and as many queries as keys, it passes SDPA no mask and ``is_causal`` instead, which lets
the flash back end run and spares the others a read of an ``(batch, 1, seq, seq)`` tensor.  While compiling it
refuses that skip (transformers 5.17 on every torch, and every version before torch 2.14, where dynamo read
``torch.compiler.is_exporting()`` as True) and hands SDPA the full mask: measured with
``python3 dev/sdpa_mask_under_compile.py`` (torch 2.11, transformers 5.17: a compiled BertForMaskedLM and
LlamaForCausalLM both get a ``(2, 1, 16, 16)`` mask and ``is_causal=False``; eagerly ``None``).

It reaches the models that build their masks through ``transformers.masking_utils``: every model in
transformers 5, Llama and the other decoders in 4.5x (measured with 4.57: the compiled Llama gets no mask inside
the context, BERT, which builds its mask elsewhere there, still gets one).

:func:`skip_trivial_masks` puts, for the duration of a ``with`` block, a mask function under the ``"sdpa"`` key of
transformers' mask interface that makes the same decision eagerly and compiled: no mask when the call has no
padding mask (``attention_mask is None``, a Python-level fact the compiled graph is specialized on, never a read
of tensor values), no local window, and transformers itself allows the skip (``allow_is_causal_skip`` with one
query or as many queries as keys; ``allow_is_bidirectional_skip``).  Every other call goes to transformers' own
function.  The plugin holds this around every forward (``sdpa="torch"`` turns it off); export, generation and
anything else outside a training forward keep transformers' behaviour.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Optional


_interface: list = []  # transformers' mask interface once found (every forward asks)


def _mask_interface() -> Optional[Any]:
    """transformers' mask interface, when transformers (>= 4.53, with ``masking_utils``) is already imported: a
    model of it is then in the process; otherwise None (importing transformers here would cost seconds for
    nothing)."""
    if _interface:
        return _interface[0]
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:
        return None
    _interface.append(ALL_MASK_ATTENTION_FUNCTIONS)
    return ALL_MASK_ATTENTION_FUNCTIONS


def trivial(kwargs: dict) -> bool:
    """Whether transformers' eager rule skips this mask: no padding mask, no local window reaching the keys, and
    the skip allowed for the pattern (causal: one query or as many queries as keys)."""
    if kwargs.get("attention_mask") is not None:
        return False
    kv_length = kwargs.get("kv_length")
    local = kwargs.get("local_size")
    if kv_length is None or (local is not None and kv_length >= local):
        return False
    if kwargs.get("allow_is_bidirectional_skip", False):
        return True
    q_length = kwargs.get("q_length")
    if q_length is None and kwargs.get("cache_position") is not None:  # transformers 4.x passes the positions
        q_length = kwargs["cache_position"].shape[0]
    return bool(kwargs.get("allow_is_causal_skip", True)) and q_length is not None and (
        q_length == 1 or q_length == kv_length)


_WRAPPED: dict[Callable, Callable] = {}  # one wrapper per function: a compiled graph guards on its identity


def without_trivial_masks(sdpa_mask: Callable) -> Callable:
    """``sdpa_mask`` returning None for the calls :func:`trivial` accepts (transformers calls it by keyword); the
    same wrapper object for the same function, so that entering the context again recompiles nothing."""
    if sdpa_mask in _WRAPPED:
        return _WRAPPED[sdpa_mask]

    def mask(*args: Any, **kwargs: Any) -> Any:
        if not args and trivial(kwargs):
            return None
        return sdpa_mask(*args, **kwargs)

    mask.__wrapped__ = sdpa_mask
    mask.skips_trivial_masks = True
    _WRAPPED[sdpa_mask] = mask
    return mask


@contextlib.contextmanager
def skip_trivial_masks() -> Iterator[None]:
    """Inside: transformers' ``"sdpa"`` mask function skips the masks :func:`trivial` accepts (module docstring)."""
    interface = _mask_interface()
    if interface is None or "sdpa" not in interface:
        yield
        return
    current = interface["sdpa"]
    if getattr(current, "skips_trivial_masks", False):  # already inside (a nested forward): nothing to add
        yield
        return
    interface["sdpa"] = without_trivial_masks(current)  # the instance's local mapping, over the class-wide one
    try:
        yield
    finally:
        del interface["sdpa"]
        if interface.get("sdpa") is not current:  # the user had a local override of their own: put it back
            interface["sdpa"] = current
