"""CUDA graph capture with errors that say what failed and where (``cuda_graphs=True``).

CUDA reports a host sync, a CPU tensor or an unservable allocation during capture only as "operation not
permitted when stream is capturing"; :func:`capture` raises a :class:`CudaGraphError` naming the part of
the step, the line of user code that issued the failing call and the fix.
"""
from __future__ import annotations

import contextlib
import os
import traceback
from typing import Iterator, Optional

import torch

_INTERNAL = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, contextlib))
_MODE_HANDLERS = ("__torch_function__", "__torch_dispatch__")
_HOST_SYNC = ("stream is capturing", "StreamCapture", "during capture")


class CudaGraphError(RuntimeError):
    """``cuda_graphs=True`` cannot capture this run, or the run changed what was captured."""


@contextlib.contextmanager
def capture(graph: "torch.cuda.CUDAGraph", pool, what: str, fix: str) -> Iterator[None]:
    """Capture the block into ``graph`` (memory from ``pool``); a failure raises :class:`CudaGraphError` naming
    ``what`` part of the step failed and the ``fix``.  Autocast's weight cache is off while capturing: a cast
    cached by eager code before the capture would be read by every replay after the cache let it go."""
    device = torch.cuda.current_device()
    autocast = contextlib.nullcontext()
    if torch.is_autocast_enabled("cuda"):
        autocast = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
    try:
        # thread_local: a loader's pin-memory thread may allocate while the training thread captures
        with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"), \
                autocast:
            yield
    except CudaGraphError:
        _release_generators(device)
        raise
    except Exception as exc:
        _release_generators(device)
        raise CudaGraphError(describe_capture_error(exc, what, fix)) from exc


def _release_generators(device: int) -> None:
    """After a failed capture, a fresh state (same seed and offset) takes the default CUDA generator out of it:
    ``capture_end`` raised before telling it, and every later random op would fail ("Offset increment ...")."""
    if device >= len(torch.cuda.default_generators):  # CUDA not initialized: nothing was capturing
        return
    gen = torch.cuda.default_generators[device]
    gen.graphsafe_set_state(gen.clone_state())


def describe_capture_error(exc: BaseException, what: str, fix: str) -> str:
    """The message for a failed capture: the first error of the chain, the user line that raised it, the fix."""
    first = _first_error(exc)
    where = _user_frame(first)
    text = f"{type(first).__name__}: {str(first).strip().splitlines()[0] if str(first).strip() else ''}"
    hint = ""
    if any(s in str(first) for s in _HOST_SYNC):
        hint = (" The step needs the host there: a host sync (.item(), .cpu(), .tolist(), bool(tensor), "
                "boolean-mask indexing, torch.nonzero, printing a tensor) or a CPU tensor cannot be captured.")
    return (f"cuda_graphs=True could not capture {what}: {text}"
            f"{f' at {where}' if where else ''}.{hint} {fix} Or train with cuda_graphs=False.")


def _first_error(exc: BaseException) -> BaseException:
    """The error that started it: ``capture_end`` re-raises a failed capture from ``__exit__``."""
    seen = {id(exc)}
    while exc.__context__ is not None and id(exc.__context__) not in seen:
        exc = exc.__context__
        seen.add(id(exc))
    return exc


def _user_frame(exc: BaseException) -> Optional[str]:
    """``file:line in function: `code``` of the innermost frame that issued the op: outside torch, contextlib,
    this module and the handlers of torch function/dispatch modes (the fp32 fallback's, for one)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_INTERNAL) and f.filename != __file__ and f.name not in _MODE_HANDLERS]
    if not frames:
        return None
    f = frames[-1]
    code = f" `{f.line.strip()}`" if f.line else ""
    return f"{f.filename}:{f.lineno} in {f.name}:{code}"
