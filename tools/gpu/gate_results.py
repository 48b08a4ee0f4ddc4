"""The verification gate's results from one run of the GPU tests' XML report.

    ptrain_gpu "~[nccl]~[.]~[multirank]" -r xml -o gpu_tests.xml -d yes
    python3 tools/gpu/gate_results.py ptrain_gpu gpu_tests.xml NAME...

Prints the failed test cases with their failed checks and the slowest cases, then
one line per gated NAME:
  NAME passed   every test case tagged [cuda:NAME] ran in the report and passed
  NAME FAILED   one of them failed there
  NAME rerun    some did not run there ([nccl] or [multirank] cases, or the run
                ended early: a crash, the time cap), so run.sh runs them on their own
  NAME none     no test case is tagged [cuda:NAME]
The report may be cut short (the program killed): only whole <TestCase> elements count.
"""
import html
import re
import subprocess
import sys

CASE = re.compile(r'<TestCase name="([^"]*)" tags="([^"]*)"[^>]*>(.*?)</TestCase>', re.S)
RESULT = re.compile(r'<OverallResult success="(true|false)"(?: durationInSeconds="([^"]*)")?')
FAILURE = re.compile(r'<Expression success="false"[^>]*filename="([^"]*)" line="(\d+)">.*?<Expanded>\s*(.*?)\s*</Expanded>'
                     r'|<(FatalErrorCondition|Exception)[^>]*filename="([^"]*)" line="(\d+)">\s*(.*?)\s*</\4>', re.S)


def read_report(path):
    """{case name: (passed, seconds, [failed checks])} of the whole test cases in the report."""
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except OSError as e:
        print(f"gate_results: no report: {e}")
        return {}
    cases = {}
    for name, _tags, body in CASE.findall(text):
        result = RESULT.search(body)
        if not result:
            continue
        checks = []
        for m in FAILURE.finditer(body):
            where = f"{m.group(1)}:{m.group(2)}" if m.group(1) else f"{m.group(5)}:{m.group(6)}"
            checks.append(f"{where}: {html.unescape(m.group(3) or m.group(7))}")
        cases[html.unescape(name)] = (result.group(1) == "true", float(result.group(2) or 0), checks)
    return cases


def listed(tests_bin, name):
    out = subprocess.run([tests_bin, "--list-test-names-only", f"[cuda:{name}]"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def main():
    tests_bin, report, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    cases = read_report(report)
    failed = [(n, c) for n, c in cases.items() if not c[0]]
    print(f"gate_results: {len(cases)} test cases in the report, {len(failed)} failed")
    for n, (_, _, checks) in failed:
        print(f"FAILED: {n}")
        for c in checks[:10]:
            print(f"    {c}")
    for n, (_, seconds, _) in sorted(cases.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"{seconds:8.3f} s  {n}")
    for name in names:
        mine = listed(tests_bin, name)
        if not mine:
            verdict = "none"
        elif any(n in cases and not cases[n][0] for n in mine):
            verdict = "FAILED"
        elif all(n in cases for n in mine):
            verdict = "passed"
        else:
            verdict = "rerun"
        print(f"gate {name} {verdict}")


if __name__ == "__main__":
    main()
