"""On 2 GPUs: BERT-large ``bf16-master`` sharded (FSDP + ShardedPrecision) against DDP.

Targets: per-GPU peak memory <= 0.6x DDP's, throughput >= 0.9x DDP's, loss after 200 steps within
1% of DDP's. Each strategy is one launch of this file (Lightning's launcher re-runs the command
line for rank 1); every rank writes what it measured. Run on a 2-GPU machine:

    python -m pytest tests/gpu/test_sharded_fsdp_2gpu.py -q -s

Knobs (environment): MPTRAIN_FSDP_BATCH (per GPU, default 32: activations grow with it and DDP's
fixed 16 bytes/param shrink in the ratio), MPTRAIN_FSDP_NORMS_FP32=0 (norms all-gathered in bf16:
no separate FSDP unit per LayerNorm), MPTRAIN_FSDP_SHARDING (FULL_SHARD, or SHARD_GRAD_OP: no
re-gather in backward, more memory).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

HERE = Path(__file__).resolve()
STEPS, WARMUP = 200, 30  # throughput is timed over steps WARMUP..STEPS
BATCH = int(os.environ.get("MPTRAIN_FSDP_BATCH", "32"))
NORMS_FP32 = os.environ.get("MPTRAIN_FSDP_NORMS_FP32", "1") != "0"
SHARDING = os.environ.get("MPTRAIN_FSDP_SHARDING", "FULL_SHARD")


def _launch(tmp_path, strategy: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[2]))
    r = subprocess.run([sys.executable, str(HERE), strategy, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=1200, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return {rank: json.loads((tmp_path / f"{strategy}.rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fsdp_bert_large_memory_throughput_and_loss_against_ddp(tmp_path):
    ddp, fsdp = _launch(tmp_path, "ddp"), _launch(tmp_path, "fsdp")
    print(json.dumps({"batch_per_gpu": BATCH, "norms_fp32": NORMS_FP32, "sharding": SHARDING, "ddp": ddp,
                      "fsdp": fsdp}, indent=1))
    peak = max(r["peak_gb"] for r in fsdp.values()) / max(r["peak_gb"] for r in ddp.values())
    speed = min(r["samples_per_s"] for r in fsdp.values()) / min(r["samples_per_s"] for r in ddp.values())
    loss_ddp, loss_fsdp = ddp[0]["final_loss"], fsdp[0]["final_loss"]
    print(f"peak memory FSDP/DDP {peak:.3f}, throughput FSDP/DDP {speed:.3f}, "
          f"loss at step {STEPS}: DDP {loss_ddp:.4f}, FSDP {loss_fsdp:.4f}")
    assert fsdp[0]["skipped"] == fsdp[1]["skipped"]
    assert peak <= 0.6, f"FSDP's per-GPU peak memory is {peak:.2f}x DDP's (target <= 0.6)"
    assert speed >= 0.9, f"FSDP's throughput is {speed:.2f}x DDP's (target >= 0.9)"
    assert abs(loss_fsdp - loss_ddp) <= 0.01 * abs(loss_ddp), f"loss {loss_fsdp} vs DDP's {loss_ddp}"


# -- the launched script ---------------------------------------------------------------------------------------

class _Probe(Callback):
    """Peak memory of the whole run, samples/s over steps WARMUP..STEPS, the mean loss of the last 10 steps."""

    def __init__(self):
        self.losses: list[torch.Tensor] = []
        self.t0 = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == WARMUP and self.t0 is None:
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > STEPS - 10:
            self.losses.append(outputs["loss"].detach().float())

    def result(self, trainer) -> dict:
        torch.cuda.synchronize()
        seconds = time.perf_counter() - self.t0
        return {"peak_gb": torch.cuda.max_memory_allocated() / 2**30,
                "samples_per_s": (STEPS - WARMUP) * BATCH / seconds,
                "final_loss": float(torch.stack(self.losses).mean()), "skipped": trainer.skipped_steps,
                "plugin": type(trainer.precision_plugin).__name__}


def _main(strategy_name: str, out: Path) -> None:
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.models.bert.modeling_bert import BertLayer

    from mptrain import ShardedPrecision, Trainer
    from mptrain.data import MLMDataModule
    from mptrain.models import BertMLM

    sharded = strategy_name == "fsdp"
    strategy = FSDPStrategy(auto_wrap_policy={BertLayer}, sharding_strategy=SHARDING) if sharded else "ddp"
    precision = {"plugins": [ShardedPrecision("bf16-master", norms_fp32=NORMS_FP32)]} if sharded else \
        {"precision": "bf16-master"}
    torch.manual_seed(0)
    model = BertMLM(vocab_size=30522, hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096,
                    warmup_steps=20, max_predictions=32)
    data = MLMDataModule(synthetic=True, vocab_size=30522, seq_len=128, batch_size=BATCH, synthetic_batches=STEPS)
    probe = _Probe()
    trainer = Trainer(**precision, strategy=strategy, accelerator="cuda", devices=2, max_steps=STEPS,
                      gradient_clip_val=1.0, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, seed=0, callbacks=[probe])
    trainer.fit(model, datamodule=data)
    (out / f"{strategy_name}.rank{trainer.global_rank}.json").write_text(json.dumps(probe.result(trainer)))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1], Path(sys.argv[2]))
