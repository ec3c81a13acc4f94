#!/usr/bin/env bash
# One node, NPROC processes (one per GPU) with DDP, through torchrun; Lightning reads torchrun's
# environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), mptrain starts no processes of its own.
#
#   launch/torchrun.sh RECIPE [NPROC] [--key.path=value ...]
#   launch/torchrun.sh recipes/resnet50.yaml 8 --data.data_dir=/data/imagenet
#   launch/torchrun.sh recipes/quickstart.yaml 2            # CPU (gloo): the recipe says accelerator: cpu
#
# NPROC defaults to the number of visible GPUs (1 without any). PYTHON picks the interpreter.
# The script passes --trainer.devices=NPROC and --trainer.strategy=ddp unless the recipe names a
# strategy (Lightning checks them against torchrun's WORLD_SIZE); later --key.path=value override.
# Resume a stopped run: add --ckpt_path=<log_dir>/checkpoints/last.ckpt (the recipe's
# trainer.checkpoint_every_n_steps writes last.ckpt).
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit $([[ $# -lt 1 ]] && echo 2 || echo 0)
fi
recipe=$1; shift
if [[ ! -f "$recipe" ]]; then
    echo "launch/torchrun.sh: recipe '$recipe' not found" >&2; exit 2
fi
nprocs=""
if [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; then nprocs=$1; shift; fi
PYTHON=${PYTHON:-python}
# A recipe that names its own trainer.strategy (bert_large: FSDP) keeps it; the others get ddp.
strategy_arg=--trainer.strategy=ddp
if grep -qE '^[[:space:]]+strategy:' "$recipe"; then strategy_arg=""; fi
if [[ -z "$nprocs" ]]; then
    nprocs=$("$PYTHON" -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
# torch sets 1 OpenMP thread per process under torchrun unless told otherwise; keep the cores busy.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / nprocs > 0 ? cores / nprocs : 1 ))}

exec "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$nprocs" \
    -m mptrain fit --config "$recipe" --trainer.devices="$nprocs" ${strategy_arg:+"$strategy_arg"} "$@"
