#!/usr/bin/env bash
# Configures (once) and builds ptrain's tests, examples and benchmarks in build/.
# Extra arguments go to the first configure, e.g. tools/build.sh -DPTRAIN_WITH_CUDA=OFF
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -f build/CMakeCache.txt ]]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@"
fi
cmake --build build -j"$(nproc)"
