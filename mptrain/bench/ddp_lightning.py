"""One rank of `mptrain bench ddp`, started by torchrun: the e2e benchmark's model under
``mptrain.Trainer`` or ``lightning.Trainer`` with Lightning's DDP strategy, timed and digested by
``Probe``, on the rank's own synthetic batches (seeded by rank, as a sampler would shard data).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m mptrain.bench.ddp_lightning \\
        --trainer mptrain --model bert --precision bf16-master --out /tmp/ddp
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from mptrain.bench.ddp import Probe
from mptrain.bench.e2e import optimizer_factory
from mptrain.bench.e2e_models import MODELS, build, make_trainer, use_optimizer


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mptrain.bench.ddp_lightning", description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", required=True, choices=("mptrain", "lightning"))
    p.add_argument("--model", required=True, choices=MODELS)
    p.add_argument("--precision", required=True)
    p.add_argument("--batch", type=int, default=None, help="per-rank batch (default: the e2e benchmark's)")
    p.add_argument("--probe", default="{}", help="the Probe's arguments but out_dir, as JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="tiny models (CPU smoke tests)")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    probe = Probe(args.out, **json.loads(args.probe))
    total = probe.total_steps
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = "cpu" if args.cpu else f"cuda:{local_rank}"
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    module, batches, probe.batch = build(args.model, total, device, args.quick, args.batch, seed=rank,
                                         stock=args.trainer == "lightning")
    use_optimizer(module, optimizer_factory("mptrain" if args.trainer == "mptrain" else "torch-fused"))
    if args.trainer == "lightning" and args.model == "resnet50" and not args.cpu:
        module = module.to(memory_format=torch.channels_last)
    world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    trainer = make_trainer(args.trainer, args.precision, probe, total,
                           {"channels_last": args.model == "resnet50" and not args.cpu},
                           accelerator="cpu" if args.cpu else "cuda", devices=world, num_nodes=1,
                           strategy="ddp" if world > 1 else "auto", benchmark=not args.cpu)
    trainer.fit(module, train_dataloaders=batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
