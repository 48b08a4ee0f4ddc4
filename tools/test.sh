#!/usr/bin/env bash
# Builds and runs the whole test suite (labels: unit, dist, gpu; GPU tests are
# skipped where no GPU is visible). Extra arguments go to ctest, e.g. -L unit.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
