#!/usr/bin/env bash
# Several nodes with torchrun's c10d rendezvous: run the same command on every node.
#
#   launch/multinode.sh RECIPE NNODES NPROC_PER_NODE RDZV_HOST:PORT [--key.path=value ...]
#   launch/multinode.sh recipes/bert_base.yaml 4 8 node001:29500 --data.data_dir=/shared/corpus
#
# NNODES may be a range (MIN:MAX) for elastic runs. Failed workers are restarted up to
# MAX_RESTARTS times (default 3); every (re)start runs with --ckpt_path=auto, so it resumes from
# <default_root_dir>/checkpoints/last.ckpt when one exists. default_root_dir must be on a file
# system all nodes share, and the recipe should set trainer.checkpoint_every_n_steps.
# Devices and nodes follow torchrun's environment at each (re)start (elastic sizes included).
# Environment: RDZV_ID (job id shared by the nodes; default mptrain-<recipe name>),
# MAX_RESTARTS, PYTHON.
set -euo pipefail

if [[ $# -lt 4 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit $([[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]] && echo 0 || echo 2)
fi
recipe=$1 nnodes=$2 nproc=$3 endpoint=$4; shift 4
if [[ ! -f "$recipe" ]]; then
    echo "launch/multinode.sh: recipe '$recipe' not found" >&2; exit 2
fi
PYTHON=${PYTHON:-python}
rdzv_id=${RDZV_ID:-mptrain-$(basename "$recipe" .yaml)}

exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$nnodes" --nproc-per-node="$nproc" \
    --rdzv-backend=c10d --rdzv-endpoint="$endpoint" --rdzv-id="$rdzv_id" \
    --max-restarts="${MAX_RESTARTS:-3}" \
    -m mptrain fit --config "$recipe" --ckpt_path=auto "$@"
