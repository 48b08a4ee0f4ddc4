#!/usr/bin/python3
"""The example programs under the real torchrun, and under elastic ptrun.

usage: test_launchers.py PTRUN FASHION_MNIST GPT_CHAR   (torchrun from PATH)

Every case compares final checkpoints tensor by tensor (read here, not by ptrain)
with a run of the same program under ptrun:
  torchrun.ddp      fashion_mnist --parallel ddp, 2 ranks under torchrun --no_python:
                    bitwise equal to 2 ranks under ptrun
  torchrun.gpt      gpt_char --parallel ddp the same way
  torchrun.nodes    two torchrun "nodes" (one rank each) on loopback with --rdzv_backend
                    c10d: bitwise equal
  torchrun.restart  torchrun --max_restarts 1: rank 1 SIGKILLed once a checkpoint exists;
                    the ranks resume from it and end bitwise equal
  error_file        fashion_mnist with a missing --data folder under torchrun and under ptrun,
                    each launcher given TORCHELASTIC_ERROR_FILE: both copy a rank's own record
                    (the exception, as ptrain::dist::record_error writes it) there, with errorCode 1
  elastic           three ptrun nodes with --nnodes 1:3 (one rank each); node 2 is killed
                    mid-run, the job goes on with two, node 2 comes back and the job grows
                    to three; no round starts more than --checkpoint-every steps behind
                    where the last one got (the metrics' samples), and 3 ranks resumed by
                    plain ptrun from the checkpoint the last round started from end
                    bitwise equal to the elastic run
Debian's torchrun (PyTorch 1.13 on Python 3.11) fails unless --redirects and --tee are
given values other than 0 and 3 (its Std flags do not iterate on 3.11), so the cases
pass --redirects 1 --tee 1."""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from ports import free_port_pair  # noqa: E402
from safetensors_io import read as read_safetensors  # noqa: E402

PTRUN, FASHION, GPT = sys.argv[1:4]
TORCHRUN = shutil.which("torchrun") or ""
TIMEOUT = 240
# One thread per rank everywhere: launchers set OMP_NUM_THREADS=1 only for several ranks
# per node, and a GEMM split over threads may round differently.
os.environ["OMP_NUM_THREADS"] = "1"


class Failure(Exception):
    pass


def text(path):
    with open(path, errors="replace") as f:
        return f.read()


def start(cmd, log):
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def finish(p, log, what, expect=0):
    try:
        rc = p.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise Failure(f"{what}: no end within {TIMEOUT} s\n{text(log)[-4000:]}")
    if expect is not None and rc != expect:
        raise Failure(f"{what}: exit code {rc}, expected {expect}\n{text(log)[-4000:]}")
    return text(log)


def run(cmd, log, what, expect=0):
    return finish(start(cmd, log), log, what, expect)


def steps(ckpt):
    return sorted(int(d.split("-")[1]) for d in os.listdir(ckpt)
                  if d.startswith("step-") and os.path.exists(os.path.join(ckpt, d, "COMMITTED")))


def tensors(step_dir):
    out = {}
    for f in sorted(glob.glob(os.path.join(step_dir, "*.safetensors"))):
        for name, t in read_safetensors(f).items():
            out[os.path.basename(f) + ":" + name] = t
    return out


def same_final(a, b, what):
    sa, sb = steps(a), steps(b)
    if not sa or not sb or sa[-1] != sb[-1]:
        raise Failure(f"{what}: final steps differ: {sa} vs {sb}")
    ta = tensors(os.path.join(a, f"step-{sa[-1]:08d}"))
    tb = tensors(os.path.join(b, f"step-{sb[-1]:08d}"))
    if ta.keys() != tb.keys() or not ta:
        raise Failure(f"{what}: tensor names differ: {sorted(ta)} vs {sorted(tb)}")
    for k in ta:
        if ta[k] != tb[k]:
            raise Failure(f"{what}: {k} differs")
    print(f"ok   {what}: step {sa[-1]}, {len(ta)} tensors bitwise equal")


def torchrun(args):
    return [TORCHRUN, "--no_python", "--redirects", "1", "--tee", "1"] + args


FASHION_ARGS = ["--parallel", "ddp", "--epochs", "1", "--batch", "512", "--log-every", "0"]
GPT_ARGS = ["--parallel", "ddp", "--steps", "12", "--batch", "4", "--block", "32", "--layers", "1", "--heads", "2",
            "--embd", "32", "--eval-every", "12", "--eval-batches", "1"]


def case_torchrun(work):
    ref = os.path.join(work, "ptrun-fm")
    run([PTRUN, "--nproc-per-node", "2", "--master-port", str(free_port_pair()), FASHION, "--checkpoint-dir", ref]
        + FASHION_ARGS, os.path.join(work, "ptrun-fm.log"), "ptrun fashion_mnist")
    got = os.path.join(work, "torchrun-fm")
    run(torchrun(["--nproc_per_node", "2", "--master_port", str(free_port_pair()), "--log_dir", os.path.join(work, "tl"),
                  FASHION, "--checkpoint-dir", got] + FASHION_ARGS), os.path.join(work, "torchrun-fm.log"),
        "torchrun fashion_mnist")
    same_final(ref, got, "torchrun.ddp (fashion_mnist, 2 ranks)")

    gref, ggot = os.path.join(work, "ptrun-gpt"), os.path.join(work, "torchrun-gpt")
    run([PTRUN, "--nproc-per-node", "2", "--master-port", str(free_port_pair()), GPT, "--checkpoint-dir", gref]
        + GPT_ARGS, os.path.join(work, "ptrun-gpt.log"), "ptrun gpt_char")
    run(torchrun(["--nproc_per_node", "2", "--master_port", str(free_port_pair()), "--log_dir", os.path.join(work, "tl"),
                  GPT, "--checkpoint-dir", ggot] + GPT_ARGS), os.path.join(work, "torchrun-gpt.log"),
        "torchrun gpt_char")
    same_final(gref, ggot, "torchrun.gpt (gpt_char, 2 ranks)")

    # Two nodes on loopback: c10d rendezvous, node ranks by arrival.
    nodes_dir = os.path.join(work, "torchrun-nodes")
    port = free_port_pair()
    procs = [start(torchrun(["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                             "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "fm-nodes",
                             "--log_dir", os.path.join(work, "tl"), FASHION, "--checkpoint-dir", nodes_dir]
                            + FASHION_ARGS), os.path.join(work, f"torchrun-node{i}.log")) for i in range(2)]
    for i, p in enumerate(procs):
        finish(p, os.path.join(work, f"torchrun-node{i}.log"), f"torchrun node {i}")
    same_final(ref, nodes_dir, "torchrun.nodes (c10d, 2 nodes x 1 rank)")

    # --max_restarts: rank 1 is killed once a checkpoint exists; both resume from it.
    restart_dir = os.path.join(work, "torchrun-restart")
    log = os.path.join(work, "torchrun-restart.log")
    p = start(torchrun(["--nproc_per_node", "2", "--master_port", str(free_port_pair()), "--max_restarts", "1",
                        "--log_dir", os.path.join(work, "tl"), FASHION, "--checkpoint-dir", restart_dir,
                        "--checkpoint-every", "10", "--resume"] + FASHION_ARGS), log)
    victim = wait_for_rank(p.pid, 1, lambda: steps(restart_dir) if os.path.isdir(restart_dir) else [])
    os.kill(victim, signal.SIGKILL)
    out = finish(p, log, "torchrun --max_restarts")
    if "resumed from" not in out:
        raise Failure(f"torchrun.restart: no resume in\n{out[-3000:]}")
    same_final(ref, restart_dir, "torchrun.restart (rank 1 SIGKILLed, resumed)")


def case_error_file(work):
    missing = os.path.join(work, "no-such-data")
    records = {}
    for name, cmd in (("torchrun", torchrun(["--nproc_per_node", "2", "--master_port", str(free_port_pair()),
                                             "--log_dir", os.path.join(work, "tl")])),
                      ("ptrun", [PTRUN, "--nproc-per-node", "2", "--master-port", str(free_port_pair())])):
        path, log = os.path.join(work, name + "-error.json"), os.path.join(work, name + "-error.log")
        env = dict(os.environ, TORCHELASTIC_ERROR_FILE=path, TMPDIR=work)  # ptrun keeps its folder of error files there
        p = subprocess.Popen(cmd + [FASHION, "--data", missing] + FASHION_ARGS, stdout=open(log, "w"),
                             stderr=subprocess.STDOUT, start_new_session=True, env=env)
        finish(p, log, f"{name} fashion_mnist --data {missing}", expect=1)  # torchrun's 1; ptrun: the rank's 1
        if not os.path.exists(path):
            raise Failure(f"error_file: {name} wrote no TORCHELASTIC_ERROR_FILE\n{text(log)[-3000:]}")
        with open(path) as f:
            records[name] = json.load(f)
    for name, r in records.items():
        m = r.get("message")
        if (not isinstance(m, dict) or not m.get("message", "").startswith("ptrain::DataError: ")
                or missing not in m["message"] or m.get("errorCode") != 1
                or sorted(m.get("extraInfo", {})) != ["py_callstack", "timestamp"]):
            raise Failure(f"error_file: {name}'s record is not the rank's own: {r}")
    if records["torchrun"]["message"]["message"] != records["ptrun"]["message"]["message"]:
        raise Failure(f"error_file: torchrun and ptrun copied different records: {records}")
    print("ok   error_file: torchrun and ptrun copy the rank's record:", records["ptrun"]["message"]["message"][:100])


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def wait_for_rank(launcher_pid, rank, ready):
    """The pid of `rank` among the launcher's descendants, once ready() is non-empty."""
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        if ready():
            for k in descendants(launcher_pid):
                try:
                    with open(f"/proc/{k}/environ", "rb") as f:
                        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
                    with open(f"/proc/{k}/comm") as f:
                        comm = f.read().strip()
                except OSError:
                    continue
                if env.get(b"RANK") == str(rank).encode() and comm in ("fashion_mnist", "gpt_char"):
                    return k
        time.sleep(0.02)
    raise Failure(f"rank {rank} of launcher {launcher_pid} never came")


def case_elastic(work):
    ckpt = os.path.join(work, "elastic")
    port = free_port_pair()
    every = 5
    args = [FASHION, "--parallel", "ddp", "--epochs", "1", "--batch", "64", "--log-every", "1", "--checkpoint-dir",
            ckpt, "--checkpoint-every", str(every), "--keep-checkpoints", "0", "--resume",
            "--metrics", os.path.join(work, "elastic-metrics.jsonl")]
    conf = "last_call_timeout=2,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=5"

    def node(i, serve, log):
        return start([PTRUN, "--nnodes", "1:3", "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend",
                      "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf",
                      conf + f",is_host={int(serve)}"] + args, log)

    logs = [os.path.join(work, f"elastic-node{i}.log") for i in range(4)]
    # A round that resumes on more ranks continues at a smaller step number, and its first
    # save deletes the larger-numbered checkpoints it superseded (the one it resumed from
    # among them), so every committed checkpoint is kept aside (hard links) as it appears.
    kept = os.path.join(work, "kept")
    stop = threading.Event()
    watcher = threading.Thread(target=keep_committed, args=(ckpt, kept, stop))
    watcher.start()
    nodes = [node(i, i == 0, logs[i]) for i in range(3)]
    wait_until(lambda: steps(ckpt)[-1] >= 4 * every if os.path.isdir(ckpt) and steps(ckpt) else False,
               "the three nodes' first checkpoints", logs)
    killed_at = steps(ckpt)[-1]
    os.killpg(nodes[2].pid, signal.SIGKILL)  # node 2's machine is gone: ptrun and its rank
    nodes[2].wait()
    # The job goes on with two nodes: a newer checkpoint appears.
    wait_until(lambda: steps(ckpt)[-1] >= killed_at + 3 * every, "progress on two nodes", logs)
    nodes.append(node(3, False, logs[3]))  # node 2 comes back
    del nodes[2]
    try:
        outs = [finish(p, logs[i if i < 2 else 3], f"elastic node {i}") for i, p in enumerate(nodes)]
    finally:
        stop.set()
        watcher.join()
    rounds = [m for m in (re.match(r"ptrun: round \d+ on (\d+) node", ln) for ln in outs[0].splitlines()) if m]
    sizes = [int(m.group(1)) for m in rounds]
    if sizes[0] != 3 or 2 not in sizes or sizes[-1] != 3:
        raise Failure(f"elastic: world sizes by round {sizes}, expected 3, then 2, then 3\n" + outs[0][-4000:])
    # No round lost more than --checkpoint-every steps: the metrics (a record per step,
    # appended by every round) go back at a new round by at most that many samples.
    with open(os.path.join(work, "elastic-metrics.jsonl")) as f:
        recs = [r for r in map(json.loads, f) if "loss" in r]
    batch = 64
    done = [r["step"] * batch * r["world_size"] for r in recs]
    lost = max([(prev - (cur - batch * r["world_size"])) / (batch * p["world_size"])
                for prev, cur, r, p in zip(done, done[1:], recs[1:], recs) if cur <= prev], default=0)
    if lost > every:
        raise Failure(f"elastic: a round lost {lost} steps, more than --checkpoint-every {every}\n" +
                      "\n".join(ln for ln in outs[0].splitlines() if "ptrun:" in ln or "resumed" in ln))
    last = re.findall(r"resumed from (\S+): step (\d+), .* on (\d+) data-parallel", outs[0])[-1]
    print(f"ok   elastic: world sizes by round {sizes}, at most {lost:g} steps lost at a round's start, "
          f"last round resumed from {os.path.basename(last[0])} (step {last[1]} at 3 ranks)")
    # Three ranks resumed from the same checkpoint by plain ptrun end bitwise equal.
    ref = os.path.join(work, "elastic-ref")
    os.makedirs(ref)
    source = os.path.join(kept, os.path.basename(last[0]), "w" + last[2])
    if not os.path.isdir(source):
        raise Failure(f"elastic: the checkpoint the last round resumed from ({last}) was not kept")
    shutil.copytree(source, os.path.join(ref, os.path.basename(last[0])))
    ref_args = [a if a != ckpt else ref for a in args]
    ref_args[ref_args.index("--metrics") + 1] = os.path.join(work, "ref-metrics.jsonl")
    run([PTRUN, "--nproc-per-node", "3", "--master-port", str(free_port_pair())] + ref_args,
        os.path.join(work, "elastic-ref.log"), "3 ranks resumed by ptrun")
    same_final(ckpt, ref, "elastic (final vs. a 3-rank run resumed from the last round's checkpoint)")
    timeline = os.environ.get("PTRAIN_ELASTIC_TIMELINE")
    if timeline:  # the metrics and rounds for docs/images (tools/plot_elastic.py)
        shutil.copy(os.path.join(work, "elastic-metrics.jsonl"), timeline + ".jsonl")
        with open(timeline + ".log", "w") as f:
            f.write(outs[0])


def keep_committed(ckpt, kept, stop):
    """Hard-links every committed checkpoint of `ckpt` into kept/step-N/w<world size>/."""
    seen = set()
    while not stop.is_set():
        for d in glob.glob(os.path.join(ckpt, "step-*")):
            try:
                with open(os.path.join(d, "trainer.json")) as f:
                    world = json.load(f)["world_size"]
                if not os.path.exists(os.path.join(d, "COMMITTED")) or (d, world) in seen:
                    continue
                dst = os.path.join(kept, os.path.basename(d), f"w{world}")
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(d, dst, copy_function=os.link)
                seen.add((d, world))
            except (OSError, ValueError, KeyError):
                continue  # removed or replaced meanwhile: the next pass sees its successor
        time.sleep(0.01)


def wait_until(cond, what, logs):
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        try:
            if cond():
                return
        except (OSError, IndexError, ValueError):
            pass
        time.sleep(0.05)
    raise Failure(f"elastic: no {what} within {TIMEOUT} s\n" +
                  "\n".join(text(log)[-2000:] for log in logs if os.path.exists(log)))


def main():
    cases = {"torchrun": case_torchrun, "error_file": case_error_file, "elastic": case_elastic}
    only = os.environ.get("PTRAIN_LAUNCHER_CASES", "").split(",")
    failed = []
    with tempfile.TemporaryDirectory(prefix="ptrain-launchers-") as work:
        for name, case in cases.items():
            if only != [""] and name not in only:
                continue
            if name in ("torchrun", "error_file") and not TORCHRUN:
                failed.append("torchrun: no torchrun found (tools/install-deps.sh --test installs python3-torch)")
                continue
            os.makedirs(os.path.join(work, name))
            try:
                case(os.path.join(work, name))
            except Failure as e:
                failed.append(f"{name}: {e}")
    for f in failed:
        print("FAIL", f)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
