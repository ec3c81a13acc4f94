"""The ``mptrain`` command (also ``python -m mptrain``): LightningCLI's ``fit|validate|test|predict``
with mptrain's Trainer, and the tools ``doctor|numerics|bench`` in the same flag style.  A config
mistake or a refusal (a device the precision mode needs, a damaged checkpoint, an optional extra not
installed) prints one line naming the thing, the value and the fix, exits 2 and leaves nothing
behind; ``MPTRAIN_TRACEBACK=1`` shows the traceback instead."""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from mptrain.cli.errors import ConfigError, one_line, refusal, show_traceback
from mptrain.cli.tools import TOOLS, run_tool

__all__ = ["TOOLS", "ConfigError", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one subcommand; returns the exit status (2 for a config mistake)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    wandb_offline_without_key()
    finished = False
    try:
        status = _run(argv)
        finished = True
        return status
    except Exception as e:
        # a tool's refusal (a damaged checkpoint, a missing extra) is reported as a config mistake is
        message = one_line(e) if isinstance(e, ConfigError) else refusal(e, loop_started=True)
        if message is None or show_traceback():
            raise
        cmd = f"mptrain {argv[0]}" if argv and not argv[0].startswith("-") else "mptrain"
        print(f"{cmd}: error: {message}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help, --print_config
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:  # tear the process group down now: gloo's threads left to the interpreter's teardown abort it
        _destroy_process_group(drain=finished)


def _run(argv: list[str]) -> int:
    """A tool's exit status (``bench ddp`` under torchrun sets up a process group too), or 0 once
    LightningCLI's subcommand returns."""
    if argv and argv[0] in TOOLS:
        return run_tool(argv[0], argv[1:])
    from mptrain.cli.config_files import check_config_file, config_paths
    from mptrain.cli.lightning_cli import MptrainCLI

    for path in config_paths(argv):
        check_config_file(path)
    MptrainCLI(args=argv)
    return 0


def _destroy_process_group(drain: bool) -> None:
    """Tear the process group down now: gloo's threads left to the interpreter's teardown abort it.

    ``drain`` (every rank finished the command): a barrier first, its work held until the group is gone.
    torch 2.6 destroys a gloo group holding the GIL and joins its worker threads; a worker still freeing a
    finished collective (the last broadcast) whose tensors' Python objects are gone needs the GIL: both
    ranks hang.  gloo's barrier work holds every collective queued or running when it is enqueued, so
    those are freed by this thread when it drops the barrier after the join.  Waiting in a barrier alone
    is not enough: its work, holding them, is then freed by a worker.  After an error a rank may be gone,
    so there is no barrier then."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    barrier = dist.barrier(async_op=True) if drain else None
    try:
        if barrier is not None:
            barrier.wait()
    finally:
        dist.destroy_process_group()
    del barrier  # only now: what it holds is freed by this thread (it has the GIL), not by a gloo worker


def wandb_offline_without_key() -> None:
    """W&B without credentials (``WANDB_API_KEY``, or the ~/.netrc entry ``wandb login`` writes)
    runs offline (``wandb sync`` later) instead of prompting; the key itself is never read."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return
    import netrc

    try:
        has_login = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        has_login = False
    if not has_login:
        os.environ["WANDB_MODE"] = "offline"
