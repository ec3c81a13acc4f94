"""The baseline of `mptrain bench ddp --lightning`: the same model and per-GPU batch under a plain
``lightning.Trainer`` with its own DDP, launched by torchrun (one process per GPU).  It shares the
``Probe`` callback with the mptrain runs, so both are timed and digested the same way.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m mptrain.bench.ddp_lightning \\
        --model bert_base --precision bf16-mixed --out /tmp/ddp-l
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mptrain.bench.ddp_lightning", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, choices=("resnet50", "bert_base"))
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--batch", type=int, default=None, help="per-GPU batch (default: the recipe's)")
    p.add_argument("--probe", default="{}", help="the Probe's arguments but out_dir, as JSON")
    p.add_argument("--out", required=True)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    import lightning as L

    from mptrain.bench.ddp import Probe
    from mptrain.bench.e2e import DEFAULT_BATCH, build

    batch = args.batch or DEFAULT_BATCH[args.model]
    model, loader = build(args.model, batch, 128)
    if args.model == "resnet50":
        model = model.to(memory_format=torch.channels_last)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    probe = Probe(args.out, **json.loads(args.probe))
    total = probe.total_steps
    trainer = L.Trainer(precision=args.precision, accelerator="cuda", devices=world,
                        strategy="ddp" if world > 1 else "auto", max_steps=total, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, benchmark=True, log_every_n_steps=total + 1,
                        use_distributed_sampler=False,  # the synthetic loader shards by rank itself
                        # no clipping: Lightning refuses it with a fused optimizer under AMP
                        callbacks=[probe])
    trainer.fit(model, train_dataloaders=loader)
    return 0


if __name__ == "__main__":
    sys.exit(main())
