#!/usr/bin/env bash
# Installs what only the tests need (the real torchrun, PyPI test tools), builds
# everything (tests, examples, benchmarks, ptrun, the header check) and runs the
# whole test suite (labels: unit, dist, gpu, chaos; GPU tests are skipped where no
# GPU is visible). Extra arguments go to ctest, e.g. -L unit. Prints the time of
# each phase and, at the end, the tests that were skipped and why.
set -euo pipefail
cd "$(dirname "$0")/.."

phases=()
phase() {  # phase NAME COMMAND...: runs the command and notes its wall time
  local name=$1 start=$SECONDS status=0
  shift
  "$@" || status=$?
  phases+=("$(printf '%-8s %4d s' "$name" $((SECONDS - start)))")
  return "$status"
}
report() {
  echo "test.sh: time per phase"
  printf '  %s\n' "${phases[@]}"
}
trap report EXIT

phase install tools/install-deps.sh --test
phase build tools/build.sh --all
log=build/Testing/ctest-output.log
mkdir -p build/Testing
rc=0
phase test bash -c 'ctest --test-dir build --output-on-failure -j"$(nproc)" "$@" 2>&1 | tee "$0"; exit "${PIPESTATUS[0]}"' \
  "$log" "$@" || rc=$?
# Skipped tests with their reasons: CTest marks them "***Skipped"; a test that
# skips prints "SKIPPED: <reason>" (tests/skip.hpp, the Python tests) and does so
# at once, so each is run again here to show its reason.
python3 - "$log" <<'PY'
import re, subprocess, sys
skipped = re.findall(r"Test +#\d+: (.+?) \.+\*+Skipped", open(sys.argv[1], errors="replace").read())
if skipped:
    print("test.sh: skipped tests")
for name in skipped:
    exact = "^" + re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", name) + "$"
    out = subprocess.run(["ctest", "--test-dir", "build", "-R", exact, "-V"], capture_output=True, text=True).stdout
    reason = re.search(r"SKIPPED: (.*)", out)
    print(f"  {name}: {reason.group(1) if reason else 'no reason printed'}")
PY
exit "$rc"
