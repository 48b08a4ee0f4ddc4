#!/usr/bin/env bash
# Builds everything (tests, examples, benchmarks, ptrun, the header check) and
# runs the whole test suite (labels: unit, dist, gpu, chaos; GPU tests are
# skipped where no GPU is visible). Extra arguments go to ctest, e.g. -L unit.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh --all
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
