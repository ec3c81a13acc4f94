#!/usr/bin/env bash
# The one GPU script: build the extension, run the CUDA tests and the benchmarks, in one
# call on the GPU machine.  Usage: tests/gpu/run.sh [stage ...]   (default: all stages)
# Stages: info build (cold, timed) load (warm) tests kernels gemm e2e numerics doctor ddp (2 GPUs).  Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/mptrain-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
export MPTRAIN_BUILD_DIR=${MPTRAIN_BUILD_DIR:-/tmp/mptrain-ext}
export MAX_JOBS=${MAX_JOBS:-16}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
STAGES=${*:-info build tests kernels gemm e2e numerics doctor}  # ddp: run alone on two GPUs
summary=()

stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== [$name] $(date +%T) $*"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  summary+=("$name rc=$rc $((SECONDS - t0))s")
}

stage info 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; python3 -c "import torch,lightning;print(torch.__version__, torch.version.cuda, lightning.__version__, torch.cuda.get_device_name())"; nvcc --version | tail -2'
stage build 330 bash -c 'rm -rf "$MPTRAIN_BUILD_DIR"; python3 -m mptrain.ops.build && python3 -c "
import time, torch
from mptrain.ops.build import get_extension
t=time.perf_counter()
get_extension(required=True)
print(f\"warm load: {time.perf_counter()-t:.2f} s\")"'
stage load 120 python3 -m mptrain.ops.build
stage tests 270 python3 -m pytest tests/gpu -q -rfE --timeout=300 --maxfail=30 -p no:cacheprovider -o addopts=""
stage kernels 420 python3 -m mptrain.bench.kernels --json "$OUT/bench_kernels.json"
stage gemm 200 python3 -m mptrain.bench.gemm --json "$OUT/bench_gemm.json"
stage e2e 420 python3 -m mptrain.bench.e2e --json "$OUT/bench_e2e.json"
stage numerics 200 python3 -m mptrain.numerics.report_models --out "$OUT"
stage doctor 120 python3 -m mptrain doctor
stage ddp 540 python3 -m mptrain.bench.ddp --nproc 2 --json "$OUT/bench_ddp.json"   # nvidia-h200-x2 only

echo "=== summary"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
