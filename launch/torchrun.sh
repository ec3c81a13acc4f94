#!/usr/bin/env bash
# One node, NPROC processes (one per GPU) with DDP, through torchrun; Fabric reads torchrun's
# environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), mptrain starts no processes of its own.
#
#   launch/torchrun.sh RECIPE [NPROC] [--key.path=value ...]
#   launch/torchrun.sh recipes/resnet50.yaml 8 --data.data_dir=/data/imagenet
#   launch/torchrun.sh recipes/quickstart.yaml 2            # CPU (gloo): the recipe says accelerator: cpu
#
# NPROC defaults to the number of visible GPUs (1 without any). PYTHON picks the interpreter.
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit $([[ $# -lt 1 ]] && echo 2 || echo 0)
fi
recipe=$1; shift
if [[ ! -f "$recipe" ]]; then
    echo "launch/torchrun.sh: recipe '$recipe' not found" >&2; exit 2
fi
nprocs=""
if [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; then nprocs=$1; shift; fi
PYTHON=${PYTHON:-python}
if [[ -z "$nprocs" ]]; then
    nprocs=$("$PYTHON" -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
# torch sets 1 OpenMP thread per process under torchrun unless told otherwise; keep the cores busy.
cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / nprocs > 0 ? cores / nprocs : 1 ))}

# trainer.devices / num_nodes / strategy follow torchrun's environment (mptrain.cli: devices "auto"
# becomes LOCAL_WORLD_SIZE, strategy "auto" becomes ddp); a recipe that pins another count fails.
exec "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$nprocs" \
    -m mptrain fit --config "$recipe" "$@"
