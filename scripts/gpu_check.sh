#!/usr/bin/env bash
# The one prepared check for a GPU machine: environment, the kernel tests compiled
# on CUDA, then the benchmark (correctness first, then timings).
#
#   bash scripts/gpu_check.sh            # results in $OUT (default /tmp/pagedq-gpu-check)
#
# Needs python3 with torch and triton; pagedq need not be pip-installed: a temporary
# folder maps pagedq.kernels / pagedq.config onto this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/pagedq-gpu-check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

shim="$(mktemp -d)"
mkdir -p "$shim/pagedq"
ln -s "$PWD/kernels" "$shim/pagedq/kernels"
ln -s "$PWD/config" "$shim/pagedq/config"
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

{
  date -u
  nvidia-smi
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "| torch", torch.__version__,
"| triton", triton.__version__, "| cuda", torch.version.cuda, "|", torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/env.log"

# Kernel tests compiled on the GPU (no conftest: the rest of the suite's fixtures are not needed here).
xdist=""
"$PY" -c 'import xdist' 2>/dev/null && xdist="-n 8"
PAGEDQ_KERNEL_TEST_DEVICE=cuda timeout 200 "$PY" -m pytest tests/engine/test_kernels.py -q --noconftest \
  -p no:cacheprovider $xdist 2>&1 | tee "$OUT/pytest_cuda.log"
tests_rc=${PIPESTATUS[0]}

timeout 240 "$PY" scripts/bench_kernels.py --out "$OUT/bench_kernels.md" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

rm -rf "$shim"
echo "gpu_check: tests rc=$tests_rc bench rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
