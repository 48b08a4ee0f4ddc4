#!/usr/bin/env bash
# Full-suite soak: runs the whole CTest suite K times while every core is kept busy
# (stress-ng --cpu when installed, else one shell busy loop per core), and prints how
# often each test failed. A test that fails once here fails sometimes in CI too.
#
#   tools/build.sh --all && benchmarks/soak.sh          # 3 passes
#   benchmarks/soak.sh 5 -L dist                        # 5 passes; the rest goes to ctest
#
# Each pass's output (--output-on-failure) is kept in build/soak/pass-N.log; the
# summary names the log of every failure. BUILD_DIR overrides build/.
# Exit status: 0 when no test failed in any pass, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
passes=3
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then passes=$1; shift; fi
if ((passes < 1)); then echo "soak.sh: the number of passes must be at least 1" >&2; exit 2; fi
build=${BUILD_DIR:-build}
if [[ ! -f $build/CTestTestfile.cmake ]]; then
  echo "soak.sh: $build is not a configured build; run tools/build.sh --all first" >&2
  exit 2
fi
logs=$build/soak
mkdir -p "$logs"
cores=$(nproc)

load=()
stop_load() { ((${#load[@]})) && kill "${load[@]}" 2>/dev/null; wait 2>/dev/null || true; }
trap stop_load EXIT
if command -v stress-ng >/dev/null; then
  stress-ng --cpu "$cores" --quiet &
  load+=($!)
  what="stress-ng --cpu $cores"
else
  for ((i = 0; i < cores; i++)); do
    bash -c 'while :; do :; done' &
    load+=($!)
  done
  what="$cores busy loop(s)"
fi
echo "soak: $passes pass(es) of ctest -j$cores${*:+ $*} under $what; logs in $logs"

declare -A failed=()
for ((p = 1; p <= passes; p++)); do
  t0=$SECONDS
  rm -f "$build/Testing/Temporary/LastTestsFailed.log"
  rc=0
  ctest --test-dir "$build" --output-on-failure -j"$cores" "$@" >"$logs/pass-$p.log" 2>&1 || rc=$?
  names=()
  if [[ -f $build/Testing/Temporary/LastTestsFailed.log ]]; then
    while IFS=: read -r _ name; do names+=("$name"); done <"$build/Testing/Temporary/LastTestsFailed.log"
  fi
  for name in "${names[@]}"; do failed[$name]="${failed[$name]:-} $p"; done
  summary=$(grep -E '^[0-9]+% tests passed' "$logs/pass-$p.log" || echo "ctest exit status $rc")
  echo "pass $p: $summary ($((SECONDS - t0)) s)${names[*]:+; failed: ${names[*]}}"
done

echo
if ((${#failed[@]} == 0)); then
  echo "soak: no test failed in $passes pass(es)"
  exit 0
fi
printf '%-40s %8s  %s\n' test failures "passes ($logs/pass-N.log)"
for name in $(printf '%s\n' "${!failed[@]}" | sort); do
  read -ra in <<<"${failed[$name]}"
  printf '%-40s %4d/%-3d  %s\n' "$name" "${#in[@]}" "$passes" "${in[*]}"
done
exit 1
