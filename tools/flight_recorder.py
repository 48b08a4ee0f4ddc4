#!/usr/bin/env python3
"""Reads the flight recorder dumps of every rank (rank<R>.json in one directory,
written by ptrain's RecordingCommunicator, Note [Flight recorder] in
include/ptrain/dist/flight_recorder.hpp) and names the first collective on
which the ranks of a group disagree or that a rank never reached.

    python3 tools/flight_recorder.py DIR [--world-size N] [--json] [--show K]

For each group (the world, and every split of it), collectives are matched by
their sequence number, as the backends match them (Note [Collective order
contract]). Scanning from the oldest sequence number every rank still holds:

  - a rank whose last collective is older than #k while others issued #k
    "never arrived" at #k (it is stuck elsewhere: compute, data, a send/recv,
    another group);
  - ranks that issued #k with another op, count, dtype, reduce op or root
    "disagree" at #k; for all_to_all_v, whose counts differ by rank, rank i's
    send_counts[j] must equal rank j's recv_counts[i];
  - when every rank issued #k the same way but some never completed it, #k is
    where the group stopped (a dead peer, a network fault), and the ranks that
    failed it are named with their errors.

A rank with no dump at all is reported first: it died, or it was never
signalled (send SIGUSR2 to every rank, or let the timeout fire). Exit status:
0 when a verdict was found, 1 when every group is consistent, 2 on bad input.
Send/recv entries are listed per rank but not matched (they pair per peer).
"""
import argparse
import glob
import json
import os
import sys


def describe(op):
    """all_reduce(F32 x 1000, sum), as ptrain names operations in its errors."""
    name, extra = op["op"], ""
    if op.get("reduce_op"):
        extra = ", " + op["reduce_op"]
    elif name == "broadcast":
        extra = ", root %d" % op["root"]
    if name in ("barrier", "split"):
        return name + "()"
    if name == "all_to_all":
        return "all_to_all(%s x %d per rank)" % (op["dtype"], op["count"])
    if name == "all_to_all_v":
        return "all_to_all_v(%s)" % op["dtype"]
    return "%s(%s x %d%s)" % (name, op["dtype"], op["count"], extra)


def signature(op):
    count = None if op["op"] == "all_to_all_v" else op["count"]  # its split sizes differ by rank
    return (op["op"], count, op["dtype"], op.get("reduce_op", ""), op.get("root", -1))


def split_mismatches(have):
    """For an all_to_all_v every rank issued: the pairs whose sizes differ, as ptrain's error names them."""
    pairs = []
    for i, op in sorted(have.items()):
        for j, sent in enumerate(op.get("send_counts", [])):
            other = have.get(j)
            if other is None or i >= len(other.get("recv_counts", [])):
                continue
            if sent != other["recv_counts"][i]:
                pairs.append("rank %d sends %d elements to rank %d, which expects %d" % (
                    i, sent, j, other["recv_counts"][i]))
    return pairs


def ranks_text(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def load(directory):
    dumps = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.json"))):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit("flight_recorder.py: cannot read %s: %s" % (path, e))
        if not isinstance(doc, dict) or "groups" not in doc or "rank" not in doc:
            raise SystemExit("flight_recorder.py: %s is not a ptrain flight recorder dump" % path)
        dumps[int(doc["rank"])] = doc
    return dumps


def analyse_group(name, members):
    """members: {group rank: recorder json}. Returns a verdict dict or None."""
    colls = {}
    for r, m in members.items():
        colls[r] = {op["seq"]: op for op in m["ops"] if op["seq"] > 0}
    last = {r: max(c) if c else 0 for r, c in colls.items()}
    first = {r: min(c) if c else 0 for r, c in colls.items()}
    top = max(last.values()) if last else 0
    start = max([first[r] for r in colls if colls[r]] or [1])
    for k in range(start, top + 1):
        have = {r: colls[r][k] for r in colls if k in colls[r]}
        absent = [r for r in colls if k not in colls[r] and last[r] < k]
        if absent:
            op = next(iter(have.values()))
            where = []
            for r in sorted(absent):
                lo = colls[r].get(last[r])
                where.append("rank %d's last collective: %s" % (
                    r, "#%d %s (%s)" % (last[r], describe(lo), lo["state"]) if lo else "none"))
            return {
                "group": name, "seq": k, "kind": "never_arrived", "ranks": sorted(absent),
                "op": describe(op), "label": op.get("label", ""),
                "text": "group %s: %s never arrived at collective #%d %s%s; %s issued it (%s); %s" % (
                    name, ranks_text(absent), k, describe(op),
                    " [label %s]" % op["label"] if op.get("label") else "", ranks_text(have),
                    ", ".join(sorted({o["state"] for o in have.values()})), "; ".join(where)),
            }
        groups = {}
        for r, op in have.items():
            groups.setdefault(signature(op), []).append(r)
        if len(groups) > 1:
            parts = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
            odd = sorted(r for _, rs in parts[1:] for r in rs)
            return {
                "group": name, "seq": k, "kind": "mismatch", "ranks": odd,
                "op": "; ".join("%s: %s" % (ranks_text(rs), describe(have[rs[0]])) for _, rs in parts),
                "text": "group %s: collective #%d differs across ranks: %s" % (
                    name, k, "; ".join("%s called %s" % (ranks_text(rs), describe(have[rs[0]])) for _, rs in parts)),
            }
        op0 = next(iter(have.values()))
        pairs = split_mismatches(have) if op0["op"] == "all_to_all_v" else []
        if pairs:
            return {
                "group": name, "seq": k, "kind": "mismatch", "ranks": sorted(have), "op": describe(op0),
                "text": "group %s: collective #%d %s: the split sizes differ across ranks: %s" % (
                    name, k, describe(op0), "; ".join(pairs)),
            }
        unfinished = [r for r, op in have.items() if op["state"] != "completed"]
        if unfinished:
            op = have[unfinished[0]]
            failed = {r: have[r].get("error", "") for r in unfinished if have[r]["state"] == "failed"}
            return {
                "group": name, "seq": k, "kind": "not_completed", "ranks": sorted(unfinished), "op": describe(op),
                "text": "group %s: every rank issued collective #%d %s, but %s did not complete it%s" % (
                    name, k, describe(op), ranks_text(unfinished),
                    "".join("; rank %d: %s" % (r, e) for r, e in sorted(failed.items()) if e)),
            }
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="PTRAIN_FLIGHT_RECORDER_DIR of the run")
    ap.add_argument("--world-size", type=int, default=0, help="ranks expected (default: the world group's size)")
    ap.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    ap.add_argument("--show", type=int, default=3, help="last K operations to list per rank and group")
    args = ap.parse_args()
    if not os.path.isdir(args.dir):
        print("flight_recorder.py: %s is not a directory" % args.dir, file=sys.stderr)
        return 2
    dumps = load(args.dir)
    if not dumps:
        print("flight_recorder.py: no rank*.json in %s; set PTRAIN_FLIGHT_RECORDER_DIR for the run and send "
              "SIGUSR2 to its ranks" % args.dir, file=sys.stderr)
        return 2
    groups = {}
    for world_rank, doc in dumps.items():
        for g in doc["groups"]:
            groups.setdefault(g["group"], {})[g["rank"]] = dict(g, world_rank=world_rank)
    world_size = args.world_size or max((g["size"] for d in dumps.values() for g in d["groups"]
                                         if g["group"] == "world"), default=len(dumps))
    verdicts = []
    absent = [r for r in range(world_size) if r not in dumps]
    if absent:
        verdicts.append({"group": "world", "kind": "no_dump", "ranks": absent,
                         "text": "no dump from %s (dead, or not signalled)" % ranks_text(absent)})
    for name in sorted(groups):
        v = analyse_group(name, groups[name])
        if v:
            verdicts.append(v)
    if args.json:
        print(json.dumps({"ranks": sorted(dumps), "verdicts": verdicts}, indent=1))
    else:
        print("flight recorder: dumps from %s (world of %d)" % (ranks_text(sorted(dumps)), world_size))
        for world_rank, doc in sorted(dumps.items()):
            first = doc.get("first_reason", "")
            print("  rank %d: %s%s" % (world_rank, doc.get("reason", ""),
                                       "" if not first or first == doc.get("reason") else " (first dump: %s)" % first))
            for g in doc["groups"]:
                for op in g["ops"][-args.show:]:
                    num = "#%d" % op["seq"] if op["seq"] else "p2p#%d peer %d" % (op["p2p_seq"], op["peer"])
                    print("    %s %s %s %s%s" % (g["group"], num, describe(op), op["state"],
                                                   " [%s]" % op["label"] if op.get("label") else ""))
        for v in verdicts:
            print("VERDICT: " + v["text"])
        if not verdicts:
            print("no disagreement: every group's ranks issued and completed the same collectives")
    return 0 if verdicts else 1


if __name__ == "__main__":
    sys.exit(main())
