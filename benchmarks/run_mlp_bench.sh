#!/usr/bin/env bash
# Side-by-side MLP benchmarks: ptrain and PyTorch (Debian's python3-torch with
# OpenBLAS), one thread per rank, in one run. Prints the JSON lines, then a
# summary of medians and ratios.
#   benchmarks/run_mlp_bench.sh [build-dir]      (after tools/install-deps.sh --bench)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
py=/usr/bin/python3
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp)
runs=${RUNS:-3}
t="timeout 300"  # a stuck run is reported, not waited for
for i in $(seq "$runs"); do
  $t "$build/benchmarks/train_step" >> "$out"
  $t $py benchmarks/train_step.py >> "$out"
  $t mpirun -np 1 "$build/benchmarks/ddp_step" >> "$out"
  $t mpirun -np 2 --bind-to none "$build/benchmarks/ddp_step" >> "$out"
  $t "$build/launcher/ptrun" --nproc-per-node 2 --master-port 0 "$build/benchmarks/ddp_step" >> "$out"
  $t $py benchmarks/ddp_step.py --ranks 1 >> "$out"
  $t $py benchmarks/ddp_step.py --ranks 2 >> "$out"
done
cat "$out"
$py - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def med(bench, impl, ranks, backend=None):
    v = [r["step_ms_median"] for r in rows if r["bench"] == bench and r["impl"] == impl
         and r.get("ranks", 1) == ranks and (backend is None or r.get("backend") == backend)]
    return statistics.median(v) if v else float("nan")
t_p, t_t = med("train_step", "ptrain", 1), med("train_step", "pytorch", 1)
print(f"train_step 1 rank: ptrain {t_p:.1f} ms, pytorch {t_t:.1f} ms, ratio {t_p / t_t:.2f}")
for backend in ("mpi", "gloo"):
    p1, p2 = med("ddp_step", "ptrain", 1, "mpi"), med("ddp_step", "ptrain", 2, backend)
    t1, t2 = med("ddp_step", "pytorch", 1), med("ddp_step", "pytorch", 2)
    print(f"ddp_step ({backend}): ptrain 1 rank {p1:.1f} ms, 2 ranks {p2:.1f} ms; "
          f"pytorch 1 rank {t1:.1f} ms, 2 ranks {t2:.1f} ms; 2-rank ratio {p2 / t2:.2f}; "
          f"ptrain 2-rank throughput {2 * p1 / p2:.2f}x of 1 rank, pytorch {2 * t1 / t2:.2f}x")
PY
rm -f "$out"
