#!/usr/bin/env bash
# Cost of the default collective check (Note [Collective fingerprints]): ddp_step
# (MPI and Gloo, 2 ranks) with the check off (PTRAIN_DISTRIBUTED_DEBUG=OFF) and on,
# alternating runs, and comm_bench at 1, 4 and 16 MiB, which times each collective
# with and without the check in the same run (--unchecked); prints the median over
# runs of each benchmark's own median, and the ratio on/off.
#   benchmarks/check_cost.sh [build-dir]       RUNS=5 by default
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp)
t="timeout 300"
for i in $(seq "${RUNS:-5}"); do
  for mode in OFF ON; do
    export PTRAIN_DISTRIBUTED_DEBUG=$([ $mode = OFF ] && echo OFF || echo "")
    tag() { grep '^{' | sed "s/^{/{\"check\":\"$mode\",/" >> "$out"; }
    $t mpirun -np 2 --bind-to none -x PTRAIN_DISTRIBUTED_DEBUG "$build/benchmarks/ddp_step" | tag
    $t "$build/launcher/ptrun" --nproc-per-node 2 --master-port 0 "$build/benchmarks/ddp_step" | tag
  done
  # comm_bench times each collective with and without the check in one run (--unchecked).
  unset PTRAIN_DISTRIBUTED_DEBUG
  $t mpirun -np 2 --bind-to none "$build/benchmarks/comm_bench" --min-bytes 1048576 --max-bytes 16777216 \
    --iters 20 --backends mpi,gloo --unchecked | grep '^{' | sed 's/^{/{"check":"ON",/' >> "$out"
done
python3 - "$out" <<'PY'
import collections, json, statistics, sys
g = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("impl") == "raw_mpi" or r.get("impl") == "pytorch": continue
    if r.get("impl", "").endswith("_unchecked"):
        r["impl"], r["check"] = r["impl"][:-len("_unchecked")], "OFF"
    key = (r["bench"], r.get("impl", ""), r.get("backend", ""), r.get("op", ""), r.get("bytes", ""))
    g[(key, r["check"])].append(r.get("time_us", r.get("step_ms_median")))
print("| benchmark | off | on | on / off |")
print("|---|---|---|---|")
for key in sorted({k for k, _ in g}, key=str):
    off, on = g.get((key, "OFF")), g.get((key, "ON"))
    if not off or not on: continue
    unit = "us" if key[0] == "comm" else "ms"
    name = " ".join(str(x) for x in key if x != "")
    mo, mn = statistics.median(off), statistics.median(on)
    print(f"| {name} | {mo:.1f} {unit} | {mn:.1f} {unit} | {mn / mo:.3f} |")
PY
rm -f "$out"
