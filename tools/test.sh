#!/usr/bin/env bash
# Installs what only the tests need (the real torchrun, PyPI test tools), builds
# everything (tests, examples, benchmarks, ptrun, the header check) and runs the
# whole test suite (labels: unit, dist, gpu, chaos; GPU tests are skipped where no
# GPU is visible). Extra arguments go to ctest, e.g. -L unit.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh --test
tools/build.sh --all
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
