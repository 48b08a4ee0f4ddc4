#!/usr/bin/python3
"""Every CTest test of this build has a TIMEOUT and none is WILL_FAIL.

Reads `ctest --show-only=json-v1` of the build folder (the Catch tests that
catch_discover_tests registers appear there once their binaries are built, which
they are when ctest runs this test) and fails naming each test without a TIMEOUT
property, or with WILL_FAIL (a test that passes on any failure cannot fail).

  /usr/bin/python3 tests/check_test_properties.py CTEST BUILD_DIR
"""

import json
import subprocess
import sys


def main():
    ctest, build = sys.argv[1], sys.argv[2]
    r = subprocess.run([ctest, "--test-dir", build, "--show-only=json-v1"], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"FAIL: {ctest} --show-only=json-v1 exited {r.returncode}:\n{r.stderr}")
        return 1
    tests = json.loads(r.stdout).get("tests", [])
    if not tests:
        print(f"FAIL: no tests listed in {build}")
        return 1
    bad = []
    for t in tests:
        props = {p["name"]: p.get("value") for p in t.get("properties", [])}
        timeout = props.get("TIMEOUT")
        if timeout is None or float(timeout) <= 0:
            bad.append(f"{t['name']}: no TIMEOUT")
        if props.get("WILL_FAIL") not in (None, False, "FALSE", "OFF", "0", 0):
            bad.append(f"{t['name']}: WILL_FAIL")
    for b in bad:
        print("FAIL", b)
    print(f"{len(tests)} tests checked, {len(bad)} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
