#!/usr/bin/env bash
# Several nodes with torchrun's c10d rendezvous: run the same command on every node.
#
#   launch/multinode.sh RECIPE NNODES NPROC_PER_NODE RDZV_HOST:PORT [--key.path=value ...]
#   launch/multinode.sh recipes/bert_base.yaml 4 8 node001:29500 --data.data_dir=/shared/corpus
#
# NNODES is a fixed count (Lightning's num_nodes). No automatic restart: when a worker dies,
# torchrun stops the job; relaunch the same command with
# --ckpt_path=<log_dir>/checkpoints/last.ckpt to resume (the recipe's trainer.checkpoint_every_n_steps
# writes it; put the log dir on a file system all nodes share). A resume with another world size
# or batch size is refused with a message naming both, never silently remapped.
# Environment: RDZV_ID (job id shared by the nodes; default mptrain-<recipe name>), PYTHON.
set -euo pipefail

if [[ $# -lt 4 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit $([[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]] && echo 0 || echo 2)
fi
recipe=$1 nnodes=$2 nproc=$3 endpoint=$4; shift 4
if [[ ! -f "$recipe" ]]; then
    echo "launch/multinode.sh: recipe '$recipe' not found" >&2; exit 2
fi
if [[ ! "$nnodes" =~ ^[0-9]+$ ]]; then
    echo "launch/multinode.sh: NNODES must be a number of nodes, got '$nnodes'" >&2; exit 2
fi
PYTHON=${PYTHON:-python}
# A recipe that names its own trainer.strategy (bert_large: FSDP) keeps it; the others get ddp.
strategy_arg=--trainer.strategy=ddp
if grep -qE '^[[:space:]]+strategy:' "$recipe"; then strategy_arg=""; fi
rdzv_id=${RDZV_ID:-mptrain-$(basename "$recipe" .yaml)}

exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$nnodes" --nproc-per-node="$nproc" \
    --rdzv-backend=c10d --rdzv-endpoint="$endpoint" --rdzv-id="$rdzv_id" --max-restarts=0 \
    -m mptrain fit --config "$recipe" --trainer.devices="$nproc" --trainer.num_nodes="$nnodes" \
    ${strategy_arg:+"$strategy_arg"} "$@"
