#!/usr/bin/env bash
# One kernel round on the GPU machine: build (timed; cached in .build/ while the machine is
# warm), the CUDA tests of the given test files, then the given benchmark families.
#   dev/round.sh "test_layer_norm.py test_optim.py" "norm,optim,softmax" [pytest -k expr]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mptrain-round}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MPTRAIN_BUILD_DIR=${MPTRAIN_BUILD_DIR:-$PWD/.build/ext} MAX_JOBS=${MAX_JOBS:-16}
tests=$1 families=$2 kexpr=${3:-}
{
  t0=$SECONDS; python3 -m mptrain.ops.build | tail -2; echo "build: $((SECONDS - t0)) s"
  files=(); for f in $tests; do files+=("tests/gpu/$f"); done
  if [[ ${#files[@]} -gt 0 ]]; then
    t0=$SECONDS
    python3 -m pytest "${files[@]}" -q -rfE --maxfail=20 --timeout=${TEST_TIMEOUT:-300} -p no:cacheprovider -o addopts="" ${kexpr:+-k "$kexpr"} | tail -25
    echo "tests: $((SECONDS - t0)) s"
  fi
  [[ -n "$families" ]] && python3 -m mptrain.bench.kernels --only "$families" --json "$OUT/bench.json"
} 2>&1 | tee "$OUT/round.log"
