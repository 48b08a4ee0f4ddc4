#!/usr/bin/python3
"""Draws the per-stage timelines that pipeline_bench prints as a PNG.

    /usr/bin/python3 benchmarks/plot_pipeline.py pipe.jsonl docs/images/pipeline_timeline.png [--m 8]

One panel per schedule (GPipe, 1F1B, interleaved with each v) for the chosen
micro-batch count (default: the largest m in the file that is 4p, else the
largest): a row per stage, one bar per forward (light) and backward (dark)
labelled with its micro-batch, a colour per chunk of an interleaved stage; the
gaps are the bubble. The title gives the measured bubble and the theory
(p - 1) / (v·m + p - 1). Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    runs, lines = {}, {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            j = json.loads(line)
            key = (j.get("schedule"), j.get("v", 1), j.get("m"))
            if j.get("bench") == "pipeline":
                runs[key] = j
            elif j.get("bench") == "pipeline_timeline":
                lines.setdefault(key, []).append(j)
    return runs, lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl")
    ap.add_argument("png")
    ap.add_argument("--m", type=int, default=None, help="micro-batch count to draw")
    args = ap.parse_args()
    runs, lines = load(args.jsonl)
    if not runs:
        raise SystemExit(f"{args.jsonl}: no pipeline_bench records")
    p = next(iter(runs.values()))["p"]
    ms = sorted({m for (_, _, m) in runs})
    m = args.m if args.m is not None else (4 * p if 4 * p in ms else ms[-1])
    schedules = sorted((s, v) for (s, v, mm) in runs if mm == m)
    order = {"gpipe": 0, "1f1b": 1, "interleaved": 2}
    schedules.sort(key=lambda sv: (order.get(sv[0], 3), sv[1]))
    if not schedules:
        raise SystemExit(f"no run with m = {m} (have {ms})")

    fig, axes = plt.subplots(len(schedules), 1, figsize=(12, 1.0 + 0.9 * p * len(schedules)), squeeze=False)
    colors = [{"F": "#7fb3e0", "B": "#1f5a99"}, {"F": "#f2b880", "B": "#b35a00"},
              {"F": "#9fd8a0", "B": "#2e7d32"}, {"F": "#d0a8e0", "B": "#6a1b9a"}]  # by chunk
    span = max(e[3] for sv in schedules for st in lines[(*sv, m)] for e in st["events"])
    for ax, (sched, v) in zip(axes[:, 0], schedules):
        run = runs[(sched, v, m)]
        for st in lines[(sched, v, m)]:
            y = st["stage"]
            for mb, kind, t0, t1, *chunk in st["events"]:
                color = colors[(chunk[0] if chunk else 0) % len(colors)][kind]
                ax.barh(y, t1 - t0, left=t0, height=0.8, color=color, edgecolor="black", linewidth=0.4)
                if t1 - t0 > span / 80:
                    ax.text((t0 + t1) / 2, y, str(mb), ha="center", va="center", fontsize=7,
                            color="black" if kind == "F" else "white")
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"stage {s}" for s in range(p)])
        ax.invert_yaxis()
        ax.set_xlim(0, span * 1.01)
        name = {"gpipe": "GPipe", "1f1b": "1F1B"}.get(sched, f"Interleaved 1F1B, v = {v}")
        ax.set_title(f"{name}: p = {p}, m = {m}, "
                     f"step {run['step_ms']:.0f} ms, bubble {run['bubble']:.3f} measured vs "
                     f"{run['theory']:.3f} theory", fontsize=10)
    axes[-1, 0].set_xlabel("ms from the first event (light: forward, dark: backward; numbers: micro-batch; "
                           "colours: chunks)")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png} (m = {m}, schedules {', '.join(f'{s} v={v}' for s, v in schedules)})")


if __name__ == "__main__":
    main()
