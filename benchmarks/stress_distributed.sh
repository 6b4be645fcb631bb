#!/usr/bin/env bash
# Run the distributed tests again and again under CPU load, and count passes.
#
#   benchmarks/stress_distributed.sh [ROUNDS] [BUSY_LOOPS]     (defaults: 20 rounds, 2 loops)
#
# Each round runs tests/test_distributed.py (two gloo processes, every scenario) and
# tests/cli/test_cli.py::test_run_under_torchrun_two_cpu_ranks (`ampx run` under torchrun), while
# BUSY_LOOPS `python -c 'while True: pass'` processes keep the CPUs busy, as on a shared CI
# machine. The busy loops are this script's children and are killed when it ends (also on
# Ctrl-C). A failing round prints the tail of its pytest output. Exit status: 0 only if every
# run passed. Run it from an environment where `python -m pytest` works (the test extra).
set -u
cd "$(dirname "$0")/.."

rounds=${1:-20}
busy=${2:-2}
log=$(mktemp)
loads=()
cleanup() {
    if [ ${#loads[@]} -gt 0 ]; then
        kill "${loads[@]}" 2>/dev/null
        wait "${loads[@]}" 2>/dev/null
    fi
    rm -f "$log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for _ in $(seq "$busy"); do
    python -c 'while True: pass' &
    loads+=($!)
done

dist_ok=0
run_ok=0
start=$(date +%s)
echo "stress: $rounds rounds, $busy busy loops, $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$rounds"); do
    line="round $round/$rounds:"
    if python -m pytest -q -p no:cacheprovider tests/test_distributed.py >"$log" 2>&1; then
        dist_ok=$((dist_ok + 1)); line="$line test_distributed pass,"
    else
        line="$line test_distributed FAIL,"; tail -n 40 "$log"
    fi
    if python -m pytest -q -p no:cacheprovider \
        "tests/cli/test_cli.py::test_run_under_torchrun_two_cpu_ranks" >"$log" 2>&1; then
        run_ok=$((run_ok + 1)); line="$line torchrun pass"
    else
        line="$line torchrun FAIL"; tail -n 40 "$log"
    fi
    echo "$line (load average $(cut -d' ' -f1 /proc/loadavg), $(($(date +%s) - start)) s)"
done
echo "tests/test_distributed.py: $dist_ok/$rounds passed"
echo "test_run_under_torchrun_two_cpu_ranks: $run_ok/$rounds passed"
[ "$dist_ok" -eq "$rounds" ] && [ "$run_ok" -eq "$rounds" ]
