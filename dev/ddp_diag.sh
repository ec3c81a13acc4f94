#!/usr/bin/env bash
# DDP scaling on nvidia-h200-x2, with the evidence for where a step's time goes: each
# configuration launched --repeat times (median), then per rank a log of every host-device
# sync in 2 steady-state steps and a GPU-only profile (compute / NCCL / idle ms per step).
# Usage: dev/ddp_diag.sh [part ...]   parts: bert lightning resnet (default: all).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mptrain-ddp-diag}
mkdir -p "$OUT/reports"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
export MPTRAIN_BUILD_DIR=${MPTRAIN_BUILD_DIR:-$PWD/.build/ext} MAX_JOBS=${MAX_JOBS:-32} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PARTS=${*:-bert lightning resnet}
want() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
# the sync logs and GPU-only profiles of both ranks: dev/ddp_diag_rank.py under torchrun, into $OUT/reports/TAG
diag() {  # diag TAG RANK-SCRIPT-ARGS...
  local tag=$1; shift; mkdir -p "$OUT/reports/$tag"
  python3 -m torch.distributed.run --standalone --nproc-per-node 2 dev/ddp_diag_rank.py --syncs 2 --profile 3 \
    --profile-mode cuda --out "$OUT/reports/$tag" "$@" >"$OUT/reports/$tag/torchrun.log" 2>&1
}
{
  t0=$SECONDS; python3 -m mptrain.ops.build >/dev/null && echo "extension ready: $((SECONDS - t0)) s"
  want bert && python3 -m mptrain.bench.ddp --models bert --repeat 2 --json "$OUT/ddp_bert.json" \
    && diag bert-mptrain --trainer mptrain --model bert --precision bf16-master --probe '{"warmup": 12, "steps": 5}'
  want lightning && python3 -m mptrain.bench.ddp --models bert --trainer lightning --precision bf16-mixed \
    --json "$OUT/ddp_bert_lightning.json" \
    && diag bert-lightning --trainer lightning --model bert --precision bf16-mixed --probe '{"warmup": 12, "steps": 5}'
  want resnet && python3 -m mptrain.bench.ddp --models resnet50 --json "$OUT/ddp_resnet.json"
} 2>&1 | tee "$OUT/ddp_diag.log"
tar -C "$OUT" -czf "$OUT/reports.tgz" reports && rm -rf "$OUT/reports"
