#!/bin/sh
# GPT training step, ptrain and PyTorch side by side on one thread.
#   benchmarks/run_gpt_step.sh [build-dir] [extra flags for both, e.g. --steps 20]
# Quiet machine first: the numbers are medians, but a loaded core still skews them.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
[ $# -gt 0 ] && shift
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
echo "# load: $(cat /proc/loadavg)"
"$build/benchmarks/gpt_step" "$@"
/usr/bin/python3 "$here/gpt_step.py" "$@"
