#!/usr/bin/env python3
"""Draws a run's JSON-lines metrics (--metrics of the examples, written by
ptrain's MetricsWriter) to a PNG: loss, throughput (samples/s) and each rank's
step time against the step, with the slowest rank of each report marked.

    python3 tools/plot_metrics.py metrics.jsonl [-o metrics.png]

Needs matplotlib (Debian: python3-matplotlib). Records without a "loss" and a
"step" (evaluation records) are skipped, except that their numeric fields are
plotted as points on the loss panel.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", help="JSON-lines metrics file")
    ap.add_argument("-o", "--output", default=None, help="PNG to write (default: METRICS with .png)")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_metrics.py: needs matplotlib; install python3-matplotlib", file=sys.stderr)
        return 2
    train, evals = [], []
    with open(args.metrics) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                print("plot_metrics.py: %s line %d is not JSON: %s" % (args.metrics, n, e), file=sys.stderr)
                return 2
            if "step" in rec and "loss" in rec:
                train.append(rec)
            elif "step" in rec:
                evals.append(rec)
    if not train:
        print("plot_metrics.py: no training records (step and loss) in %s; run with --log-every > 0" % args.metrics,
              file=sys.stderr)
        return 2
    steps = [r["step"] for r in train]
    fig, ax = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax[0].plot(steps, [r["loss"] for r in train], label="loss")
    for key in sorted({k for r in evals for k, v in r.items() if isinstance(v, (int, float)) and k not in
                       ("step", "epoch", "time")}):
        pts = [(r["step"], r[key]) for r in evals if isinstance(r.get(key), (int, float))]
        ax[0].plot([p[0] for p in pts], [p[1] for p in pts], "o", label=key)
    ax[0].set_ylabel("loss")
    ax[0].legend()
    ax[1].plot(steps, [r.get("samples_per_s", float("nan")) for r in train])
    ax[1].set_ylabel("samples/s")
    per_rank = [r.get("step_time_per_rank") for r in train]
    if any(per_rank):
        world = max(len(p) for p in per_rank if p)
        for q in range(world):
            ax[2].plot(steps, [1e3 * p[q] if p and q < len(p) else float("nan") for p in per_rank],
                       label="rank %d" % q)
        slow = [(r["step"], 1e3 * r["step_time_per_rank"][r["slowest_rank"]]) for r in train
                if r.get("step_time_per_rank") and "slowest_rank" in r]
        ax[2].plot([s[0] for s in slow], [s[1] for s in slow], "kx", label="slowest")
        if world <= 16:
            ax[2].legend(ncol=4, fontsize="small")
    ax[2].set_ylabel("step time (ms)")
    ax[2].set_xlabel("step")
    fig.tight_layout()
    out = args.output or (args.metrics.rsplit(".", 1)[0] + ".png")
    fig.savefig(out, dpi=100)
    print("plot_metrics.py: wrote %s" % out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
