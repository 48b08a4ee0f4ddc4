#!/usr/bin/python3
"""A picture of a merged trace (tools/merge_traces.py's output): one row per
rank and thread, each span a bar coloured by what it is (compute, communication,
waiting, data, optimizer), the names of the longer spans written on them.

    python3 tools/plot_trace.py TRACE_DIR/trace_merged.json OUT.png [--step N] [--title T]

--step N draws only the time between the N-th and the (N+1)-th "step" marker of
rank 0 (the whole trace without it). Needs python3-matplotlib.
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# What a span is, from its name: the first prefix that matches.
KINDS = [
    ("comm.", "communication", "#d62728"),
    ("ddp.bucket_wait", "waiting", "#ff9896"),
    ("data", "data", "#9467bd"),
    ("optimizer_step", "optimizer", "#2ca02c"),
    ("clip_grad_norm", "optimizer", "#2ca02c"),
    ("checkpoint", "checkpoint", "#8c564b"),
    ("pipeline.forward", "forward", "#1f77b4"),
    ("fsdp.forward", "forward", "#1f77b4"),
    ("pipeline.backward", "backward", "#17becf"),
    ("fsdp.backward", "backward", "#17becf"),
    ("forward_backward", "forward + backward", "#aec7e8"),
]


def kind(name):
    for prefix, label, colour in KINDS:
        if name.startswith(prefix):
            return label, colour
    return "other", "#7f7f7f"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--title", default=None)
    a = ap.parse_args()
    with open(a.trace) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        print("plot_trace.py: no spans in %s" % a.trace, file=sys.stderr)
        return 2
    lo, hi = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    if a.step is not None:
        marks = sorted(e["ts"] for e in events if e.get("ph") == "i" and e.get("name") == "step" and e["pid"] == 0)
        if len(marks) < a.step:
            print("plot_trace.py: rank 0 has %d step markers, not %d" % (len(marks), a.step), file=sys.stderr)
            return 2
        lo = marks[a.step - 1]
        hi = marks[a.step] if a.step < len(marks) else hi
        spans = [e for e in spans if e["ts"] < hi and e["ts"] + e["dur"] > lo]

    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    index = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.4))
    # Longer spans first, so that the spans nested in them are drawn on top, and thinner.
    spans.sort(key=lambda e: -e["dur"])

    def depth(e):
        return sum(1 for o in spans if o is not e and (o["pid"], o["tid"]) == (e["pid"], e["tid"])
                   and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"] and o["dur"] > e["dur"])

    seen = {}
    for e in spans:
        label, colour = kind(e["name"])
        start, end = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        y = index[(e["pid"], e["tid"])]
        d = depth(e)
        height = max(0.2, 0.8 - 0.25 * d)
        bar = ax.barh(y, (end - start) / 1000.0, left=(start - lo) / 1000.0, height=height, color=colour,
                      edgecolor="black", linewidth=0.3, label=None if label in seen else label)
        seen[label] = bar
        if (end - start) > 0.08 * (hi - lo) and d == 0:
            ax.text((start + end - 2 * lo) / 2000.0, y - 0.3, e["name"], ha="center", va="bottom", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["rank %d, thread %d" % r for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(a.title or a.trace)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(seen), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("plot_trace.py: %d spans on %d rows -> %s" % (len(spans), len(rows), a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
