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
# Skipped tests with their reasons: CTest marks them "***Skipped" (exit 77, or a
# missing prerequisite); a test that skips prints "SKIPPED: <reason>"
# (tests/skip.hpp, the Python tests), which CTest's log of the run keeps.
python3 - "$log" build/Testing/Temporary/LastTest.log <<'PY'
import re, sys
summary, full = (open(p, errors="replace").read() for p in sys.argv[1:3])
skipped = re.findall(r"Test +#\d+: (.+?) \.+\*+Skipped", summary)
reasons, name = {}, None
for line in full.splitlines():
    m = re.match(r"\d+/\d+ Test: (.+)$", line)
    if m:
        name = m.group(1)
    elif name and "SKIPPED: " in line and name not in reasons:
        reasons[name] = line.split("SKIPPED: ", 1)[1]
if skipped:
    print("test.sh: skipped tests")
    for t in skipped:
        print(f"  {t}: {reasons.get(t, 'no reason printed')}")
PY
exit "$rc"
