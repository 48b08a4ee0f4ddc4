#!/usr/bin/env bash
# Configures build/ once (Release) and builds what the README's first command
# runs: the ptrun launcher and the fashion_mnist example (target quickstart).
#   tools/build.sh                      ptrun and fashion_mnist, in parallel
#   tools/build.sh --all                everything: tests, examples, benchmarks, ptrun
#   tools/build.sh --target gpt_char    the named targets (repeatable)
# Other arguments (-D...) go to the first configure, e.g. tools/build.sh -DPTRAIN_WITH_CUDA=OFF
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(quickstart)
chosen=()
all=0
configure=()
while (($#)); do
  case "$1" in
    --all) all=1 ;;
    --target) chosen+=("$2"); shift ;;
    *) configure+=("$1") ;;
  esac
  shift
done
if ((${#chosen[@]})); then targets=("${chosen[@]}"); fi
if [[ ! -f build/CMakeCache.txt ]]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${configure[@]}"
fi
if ((all)); then
  cmake --build build -j"$(nproc)"
else
  cmake --build build -j"$(nproc)" --target "${targets[@]}"
fi
