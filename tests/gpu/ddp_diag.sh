#!/usr/bin/env bash
# Where does BERT-base lose its DDP scaling?  One call on nvidia-h200-x2: build the extension,
# then time bert_base on 1 and 2 GPUs with a torch.profiler summary per rank, a plain Lightning
# DDP baseline on the same model, and 2-GPU variants that each switch one suspect off.
# Usage: tests/gpu/ddp_diag.sh [variant ...]   (default: all).  Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/mptrain-ddp-diag}
mkdir -p "$OUT/prof"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
export MPTRAIN_BUILD_DIR=${MPTRAIN_BUILD_DIR:-/tmp/mptrain-ext} MAX_JOBS=${MAX_JOBS:-32} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
VARIANTS=${*:-base lightning nofallback noclip mixed}
bench() { python3 -m mptrain.bench.ddp --nproc 2 --recipes bert_base --warmup 6 --steps 15 "$@"; }
want() { case " $VARIANTS " in *" $1 "*) return 0 ;; esac; return 1; }
{
  t0=$SECONDS; python3 -m mptrain.ops.build; echo "build: $((SECONDS - t0)) s"
  want base && bench --profile 3 --reports-out "$OUT/prof" --json "$OUT/base.json"
  want lightning && bench --lightning bf16-mixed --profile 3 --reports-out "$OUT/prof" --json "$OUT/lightning.json"
  want nofallback && bench --skip-single -- "--trainer.fp32_fallback=[]"
  want noclip && bench --skip-single -- --trainer.gradient_clip_val=null
  want mixed && bench --skip-single -- --trainer.precision=bf16-mixed
} 2>&1 | tee "$OUT/diag.log"
tar -C "$OUT" -czf "$OUT/prof.tgz" prof && rm -rf "$OUT/prof"
