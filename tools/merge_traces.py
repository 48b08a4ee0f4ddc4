#!/usr/bin/env python3
"""Merges the per-rank Chrome traces of a run (trace_rank<R>.json, written by
ptrain's tracer, include/ptrain/obs/trace.hpp) into one file that Perfetto
(ui.perfetto.dev) or chrome://tracing shows as one timeline, one process row per
rank.

    python3 tools/merge_traces.py TRACE_DIR [-o merged.json] [--align steady|wall|step]

--align wall (default) puts every rank on the wall clock (each file records the
offset between its steady clock and the wall clock when written), which lines
up ranks of different hosts as well as their clocks agree (NTP: typically well
under a millisecond). --align steady keeps the raw steady timestamps (exact on
one host). --align step shifts each rank so that its first "step" marker
coincides with rank 0's (for hosts whose clocks disagree; hides any skew in
when the ranks started the step). Times start at 0 in the output.
"""
import argparse
import glob
import json
import os
import re
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="directory holding trace_rank*.json")
    ap.add_argument("-o", "--output", default=None, help="merged file (default: DIR/trace_merged.json)")
    ap.add_argument("--align", choices=["wall", "steady", "step"], default="wall")
    args = ap.parse_args()
    paths = sorted(glob.glob(os.path.join(args.dir, "trace_rank*.json")),
                   key=lambda p: int(re.search(r"trace_rank(\d+)\.json$", p).group(1)))
    if not paths:
        print("merge_traces.py: no trace_rank*.json in %s; run with PTRAIN_TRACE_DIR (or --trace-dir) set" % args.dir,
              file=sys.stderr)
        return 2
    ranks = []
    for p in paths:
        try:
            with open(p) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            print("merge_traces.py: cannot read %s: %s" % (p, e), file=sys.stderr)
            return 2
        ranks.append(doc)

    def first_step(doc):
        ts = [e["ts"] for e in doc["traceEvents"] if e.get("name") == "step" and "ts" in e]
        return min(ts) if ts else 0.0

    shifts = []
    for doc in ranks:
        if args.align == "wall":
            shifts.append(doc.get("otherData", {}).get("wall_minus_steady_us", 0.0))
        elif args.align == "step":
            shifts.append(first_step(ranks[0]) - first_step(doc))
        else:
            shifts.append(0.0)
    t0 = min(e["ts"] + s for doc, s in zip(ranks, shifts) for e in doc["traceEvents"] if "ts" in e)
    events = []
    for doc, s in zip(ranks, shifts):
        for e in doc["traceEvents"]:
            e = dict(e)
            if "ts" in e:
                e["ts"] = round(e["ts"] + s - t0, 3)
            events.append(e)
    out = args.output or os.path.join(args.dir, "trace_merged.json")
    with open(out, "w") as f:
        json.dump({"displayTimeUnit": "ms", "traceEvents": events}, f)
    print("merge_traces.py: %d ranks, %d events -> %s" % (len(ranks), len(events), out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
