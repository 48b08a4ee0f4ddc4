#!/usr/bin/env bash
# Cost of the tracing and flight-recorder hooks (Note [Tracing cost]) on the MLP
# DDP step (ddp_step, 2 ranks over MPI): the same benchmark built from the code
# before them (git revision BASE, default fe4a2ea) and from this tree, run
# alternately, with tracing off; then this tree with the flight recorder on, and
# with every step traced. Prints the median over runs of each run's median step.
#   benchmarks/trace_cost.sh [build-dir]     RUNS=7, BASE=fe4a2ea
# benchmarks/trace_bench gives the per-call costs (docs/observability.md).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
base=${BASE:-fe4a2ea}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
before=$(mktemp -d)
git archive "$base" | tar -x -C "$before"
cmake -S "$before" -B "$before/build" -DCMAKE_BUILD_TYPE=Release -DPTRAIN_WITH_CUDA=OFF \
      -DCMAKE_CXX_COMPILER_LAUNCHER=ccache > /dev/null
cmake --build "$before/build" --target ddp_step -j2 > /dev/null
cmake --build "$build" --target ddp_step -j2 > /dev/null
scratch=$(mktemp -d)
out=$(mktemp)
run() {  # label, binary, extra mpirun -x flags...
  local label=$1 bin=$2
  shift 2
  timeout 300 mpirun -np 2 --bind-to none "$@" "$bin" --steps 60 | grep '^{' | sed "s/^{/{\"variant\":\"$label\",/" >> "$out"
}
for i in $(seq "${RUNS:-7}"); do
  run before "$before/build/benchmarks/ddp_step"
  run off "$build/benchmarks/ddp_step"
  PTRAIN_FLIGHT_RECORDER_DIR=$scratch run recorder "$build/benchmarks/ddp_step" -x PTRAIN_FLIGHT_RECORDER_DIR
  PTRAIN_TRACE_DIR=$scratch PTRAIN_TRACE_STEPS=1:1000000 run traced "$build/benchmarks/ddp_step" \
    -x PTRAIN_TRACE_DIR -x PTRAIN_TRACE_STEPS
done
python3 - "$out" <<'PY'
import collections, json, statistics, sys
g = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    g[r["variant"]].append(r["step_ms_median"])
b = statistics.median(g["before"])
print("| ddp_step, MLP, 2 ranks (MPI) | runs | step (median of medians) | / before |")
print("|---|---|---|---|")
for v in ("before", "off", "recorder", "traced"):
    if g[v]:
        m = statistics.median(g[v])
        print(f"| {v} | {len(g[v])} | {m:.2f} ms | {m / b:.3f} |")
PY
rm -rf "$before" "$scratch" "$out"
