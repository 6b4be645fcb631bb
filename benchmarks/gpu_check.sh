#!/usr/bin/env bash
# The GPU check, in one call: CUDA build, selftest, CUDA kernel comparisons, speed tables.
#
#   bash benchmarks/gpu_check.sh          (from a fresh checkout on a CUDA machine)
#
# Steps, each logged to $OUT/<step>.log with its exit status and time in $OUT/summary.txt:
#   env       GPU, torch, nvcc, ninja, pytest as found
#   build     ampx build-ext --require-cuda (archs: TORCH_CUDA_ARCH_LIST, else the visible GPU)
#   info      ampx info (must say cuda_kernels: True)
#   selftest  ampx selftest: native vs reference on CPU and every GPU through ampx._ext,
#             the launch-batching cases, graph capture, a 2**31-element tensor; training checks
#   tests     pytest tests/kernels/test_cuda_build.py tests/kernels/test_kernels.py tests/cli/test_selftest.py
#   compensated  pytest tests/kernels/test_compensated_kernels.py -k cuda: the compensated (Kahan)
#             SGD/Adam CUDA kernels bitwise against the CPU spec (a skip fails the step)
#   kernels   benchmarks/bench_kernels.py --device cuda:0 (GB/s: native, reference, torch)
#   bench     benchmarks/bench_gpu.py (fp16 step times: fp32, autocast+GradScaler, O1, O2,
#             O2 on the reference kernels; ResNet-18-like and transformer; interleaved)
# Needs python with a CUDA torch, wrapt, ninja (pip's or on PATH), a C++ compiler and nvcc
# ($CUDA_HOME, PATH, pip's nvidia-cuda-nvcc, /usr/local/cuda); pytest for the tests step.
# Nothing is installed or downloaded: ampx runs from this checkout (PYTHONPATH). About 5
# minutes on one H200 (the build about 1); every step has a time limit and all of them
# together at most GPU_CHECK_BUDGET_S (default 540 s). Exit status 0 only if every step passed.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-${TMPDIR:-/tmp}/ampx-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export AMPX_CACHE_DIR=${AMPX_CACHE_DIR:-${TMPDIR:-/tmp}/ampx-gpu-check-cache}
unset AMPX_DISABLE_EXT
: > "$OUT/summary.txt"
failed=0
deadline=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-540} ))  # all steps together

# step NAME TIMEOUT_S COMMAND...: run, log, record status and time; never stops the script.
step() {
    local name=$1 limit=$2 start rc left
    shift 2
    left=$(( deadline - $(date +%s) ))
    if [ "$left" -lt 15 ]; then
        echo "$name: SKIPPED, out of time (GPU_CHECK_BUDGET_S)" | tee -a "$OUT/summary.txt"
        failed=1
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "== $name: $*" | tee "$OUT/$name.log"
    start=$(date +%s)
    if declare -F "$1" > /dev/null; then  # a function of this script (timeout cannot run it)
        "$@" >> "$OUT/$name.log" 2>&1
    else
        timeout "$limit" "$@" >> "$OUT/$name.log" 2>&1
    fi
    rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "$name: rc=$rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || failed=1
}

env_report() {
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    timeout 60 "$PY" - <<'EOF'
import shutil, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
from ampx import _build
print("nvcc home", _build.cuda_home(), "| why not:", _build.cuda_why_not())
print("compiler", _build.find_compiler(), "| ninja", shutil.which("ninja"))
for name in ("ninja", "pytest", "wrapt"):
    try:
        __import__(name)
        print(name, "importable")
    except ImportError:
        print(name, "MISSING")
sys.exit(0 if torch.cuda.is_available() else 1)
EOF
}

# The compensated-kernel CUDA tests must run, not skip (a skip would pass pytest).
compensated_check() {
    local log
    log=$(timeout 180 "$PY" -m pytest -q -p no:cacheprovider -rs \
        tests/kernels/test_compensated_kernels.py -k cuda 2>&1)
    local rc=$?
    echo "$log"
    [ "$rc" -eq 0 ] && ! grep -q "skipped" <<< "$log"
}

step env 120 env_report
step build 420 "$PY" -m ampx build-ext --require-cuda
step info 60 "$PY" -m ampx info
step selftest 240 "$PY" -m ampx selftest
if "$PY" -c "import pytest" 2>/dev/null; then
    step tests 420 "$PY" -m pytest -q -p no:cacheprovider -rs tests/kernels/test_cuda_build.py \
        tests/kernels/test_kernels.py tests/cli/test_selftest.py
    step compensated 180 compensated_check
else
    echo "tests: SKIPPED, pytest is not installed" | tee -a "$OUT/summary.txt"
fi
step kernels 240 "$PY" benchmarks/bench_kernels.py --device cuda:0 --numel 100000000 \
    --tensors 400 --reps 15
step bench 420 "$PY" benchmarks/bench_gpu.py --out "$OUT"
echo "== summary"
cat "$OUT/summary.txt"
exit "$failed"
