#!/usr/bin/python3
"""The timeline of an elastic run: loss and world size against the steps run.

usage: plot_elastic.py METRICS.jsonl PTRUN_NODE0.log OUT.png

METRICS.jsonl holds the Trainer's records (--log-every 1), appended by every round;
the log is node 0's ptrun output (its 'round k on N node(s)' lines and the ranks'
'resumed from' lines). tests/dist/runtime/test_launchers.py writes both when
PTRAIN_ELASTIC_TIMELINE=<prefix> is set (<prefix>.jsonl, <prefix>.log)."""
import json
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    metrics, log, out = sys.argv[1:4]
    with open(metrics) as f:
        recs = [r for r in map(json.loads, f) if "loss" in r]
    with open(log, errors="replace") as f:
        text = f.read()
    rounds = [int(n) for n in re.findall(r"ptrun: round \d+ on (\d+) node", text)]
    x = list(range(1, len(recs) + 1))
    # A new round starts where the step count does not go on by one (it resumed from a
    # checkpoint, at a step that follows the new world size).
    starts = [i for i in range(1, len(recs)) if recs[i]["step"] != recs[i - 1]["step"] + 1]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    a.plot(x, [r["loss"] for r in recs], lw=0.8)
    a.set_ylabel("training loss")
    a.set_title(f"elastic run: rounds on {', '.join(map(str, rounds))} node(s)")
    b.step(x, [r["world_size"] for r in recs], where="post")
    b.set_ylabel("world size")
    b.set_xlabel("optimizer steps run (steps redone after a loss count again)")
    b.set_yticks(sorted({r["world_size"] for r in recs}))
    for s in starts:
        for ax in (a, b):
            ax.axvline(s + 1, color="grey", ls=":", lw=0.8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
