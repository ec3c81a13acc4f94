"""One rank of a DDP diagnosis run (lab tool, not shipped): `mptrain.bench.ddp_lightning` with a probe that,
after its timed steps, logs every host-device sync of ``--syncs`` steps with its Python stack
(``syncs_rank{r}.txt``), then profiles ``--profile`` steps (compute, NCCL and idle GPU time, top operators:
``profile_rank{r}.txt``); ``--profile-mode cuda`` records GPU activity only, so the profiler does not slow
the host and the GPU idle time is the real one.  Its own flags first, then the rank script's:

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 dev/ddp_diag_rank.py \\
        --syncs 2 --profile 3 --profile-mode cuda --trainer mptrain --model bert --precision bf16-master --out /tmp/d
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mptrain.bench.ddp_lightning as rank_script  # noqa: E402
from mptrain.bench.ddp import Probe  # noqa: E402
from profile_summary import summarize_profile  # noqa: E402


class DiagProbe(Probe):
    def __init__(self, out_dir: str, warmup: int = 5, steps: int = 20, syncs: int = 0, profile: int = 0,
                 profile_mode: str = "full"):
        super().__init__(out_dir, warmup, steps)
        self.syncs, self.profile, self.profile_mode = syncs, profile, profile_mode
        self._prof = self._sync_log = self._warn_ctx = self._pt0 = None

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps + self.syncs + self.profile

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        timed_end = self.warmup + self.steps
        syncs_end = timed_end + self.syncs
        if self.count == timed_end and self.syncs:
            self._start_sync_log()
        if self.count == syncs_end:
            if self._sync_log is not None:
                self._stop_sync_log(trainer.global_rank)
            if self.profile:
                self._start_profile()
        if self._prof is not None and self.count == syncs_end + self.profile:
            self._stop_profile(trainer.global_rank)

    def _start_sync_log(self) -> None:
        self._sync_log = []
        self._warn_ctx = warnings.catch_warnings()
        self._warn_ctx.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = lambda msg, *a, **k: self._sync_log.append(
            f"{msg}\n{''.join(traceback.format_stack(limit=14)[:-1])}")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")

    def _stop_sync_log(self, rank: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        self._warn_ctx.__exit__(None, None, None)
        log = [e for e in self._sync_log if "synchroniz" in e]
        text = f"{len(log)} synchronizing CUDA calls in {self.syncs} steps\n\n" + "\n----\n".join(log)
        Path(self.out_dir, f"syncs_rank{rank}.txt").write_text(text)
        self._sync_log = None

    def _start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if self.profile_mode == "full" else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._pt0 = time.perf_counter()

    def _stop_profile(self, rank: int) -> None:
        self._sync()
        wall = time.perf_counter() - self._pt0
        self._prof.__exit__(None, None, None)
        Path(self.out_dir, f"profile_rank{rank}.txt").write_text(summarize_profile(self._prof, self.profile, wall))
        self._prof = None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--syncs", type=int, default=0)
    p.add_argument("--profile", type=int, default=0)
    p.add_argument("--profile-mode", default="full", choices=("full", "cuda"))
    ours, rest = p.parse_known_args()
    rank_script.Probe = lambda out_dir, **kw: DiagProbe(out_dir, syncs=ours.syncs, profile=ours.profile,
                                                        profile_mode=ours.profile_mode, **kw)
    return rank_script.main(rest)


if __name__ == "__main__":
    sys.exit(main())
