"""GPU time per kernel from Nsight Compute's CSV, the largest first.

    ncu --metrics gpu__time_duration.sum --csv --page raw --print-units base PROGRAM ... > ncu.csv
    python3 tools/gpu/ncu_summary.py ncu.csv [TOP]

Lines that are not ncu's CSV (the program's own output, ==PROF== notes) are
skipped. Kernels are grouped by name with template arguments and parameters
cut off; each group shows its launches, total milliseconds and share.
"""
import csv
import re
import sys


def short(name):
    name = re.sub(r"\(.*$", "", name)  # parameter list
    depth, out = 0, []
    for ch in name:  # template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    name = "".join(out)
    return name.replace("void ", "").split("::")[-1] or name


def main():
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, errors="replace") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        sys.exit(f"{path}: no ncu CSV rows")
    head = rows[0]
    name_col, time_col = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    groups, total = {}, 0.0
    for r in rows[1:]:
        try:
            ns = float(r[time_col].replace(",", ""))
        except (ValueError, IndexError):
            continue  # the units row
        g = groups.setdefault(short(r[name_col]), [0, 0.0, r[name_col]])
        g[0] += 1
        g[1] += ns
        total += ns
    print(f"{sum(g[0] for g in groups.values())} kernels, {total / 1e6:.2f} ms of GPU time")
    print(f"{'kernel':64} {'launches':>8} {'ms':>9} {'share':>6}")
    for k, (n, ns, _) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{k[:64]:64} {n:8d} {ns / 1e6:9.3f} {ns / total:6.1%}")
    print("\nfull names of the ten largest:")
    for k, (n, ns, full) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:10]:
        print(f"  {ns / 1e6:8.3f} ms  {full[:300]}")


if __name__ == "__main__":
    main()
