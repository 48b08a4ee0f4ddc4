#!/usr/bin/python3
"""Chaos test: examples/gpt_char and examples/fashion_mnist under `ptrun --max-restarts`
with random faults drawn from a seed, each final model checked against a reference run.

usage: chaos.py --ptrun PTRUN --gpt-char GPT_CHAR --fashion-mnist FASHION_MNIST
                [--faults N] [--seed S] [--only REGEX] [--reshape-to 1,3] [--work DIR] [--keep]

Scenarios (2 ranks each, one ptrun job with --checkpoint-every INTERVAL --resume):
gpt_char ddp, fsdp and pipeline; fashion_mnist ddp and fsdp (a 3072-image subset of
Debian's Fashion-MNIST, written here). The N faults go round-robin to the scenarios;
each fault's kind comes from the seed, and so does the step at which it strikes
(the driver reads the progress line, --log-every 1):

  kill      SIGKILL of a random rank; ptrun restarts every rank, they resume
  stop      SIGSTOP of a random rank for longer than the communication timeout
            (PTRAIN_COMM_TIMEOUT_S, short here): its peers fail with a timeout, ptrun
            stops the job (SIGKILL after --grace-period) and restarts it; SIGCONT after
  disk      the checkpoint directory's file system (a small tmpfs) filled up to the last
            byte: the next checkpoint write fails with ENOSPC, the job fails and ptrun
            restarts it; the filler is removed once the restart has begun
  term      SIGTERM to ptrun: the ranks commit a checkpoint of the step they reached and
            exit; the driver runs the same command again (--resume)
  truncate  as term, then the newest checkpoint's model file is cut to half its size:
            the next start skips it and resumes from the one before
  reshape   SIGKILL of ptrun and its ranks, then a restart on another number of ranks
            (--reshape-to; at most once per scenario, and last): it resumes there

Checks after every fault and scenario: no job ran past its deadline (hung), every exit
status was the expected one, every resume started from the newest committed checkpoint
(truncate: the one before, at most the checkpoint interval older), the steps trained
again stay within 2 intervals (a failed background write is reported by the next save),
and the final checkpoint equals the reference run's bit for bit
(model, optimizer, trainer.json) where the world size never changed; after a reshape,
the reference is the uninterrupted run's checkpoint of the same step resumed on the
same new number of ranks, and the final models agree within 1e-4 relative.
Prints a table of faults by kind, hung runs, steps lost and bitwise-equal finals.
Exit 0 when every check passes, 1 otherwise (also without stdbuf or Fashion-MNIST: nothing here skips).

The disk fault needs a tmpfs: as root one is mounted on the work directory; otherwise
the driver runs itself again in a new user and mount namespace (`unshare -rm`); where
neither works, disk faults are not drawn, and the table says so.
"""

import argparse
import collections
import gzip
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "dist", "ckpt"))
from test_gpt_char_resume import (Failure, committed_steps, diff_checkpoints, max_rel_diff,  # noqa: E402
                                  rank_pid, step_dir, write_corpus)

KINDS = ["kill", "stop", "disk", "term", "truncate", "reshape"]
COMM_TIMEOUT_S = 6  # PTRAIN_COMM_TIMEOUT_S of every job: the stop fault waits this long, plus slack
GRACE_S = 2  # ptrun --grace-period
INTERVAL = 20  # --checkpoint-every
PREEMPT_EXIT = 75  # --preempt-exit-code: what the ranks, and so ptrun, exit with after SIGTERM
TOL = 1e-4  # relative, after a world-size change
TMPFS_MB = 48
GPT = ["--layers", "1", "--heads", "2", "--embd", "32", "--block", "32", "--batch", "4", "--dropout", "0.1",
       "--warmup", "3", "--eval-every", "1000000", "--sample-tokens", "0", "--threads", "1"]
PROGRESS = re.compile(r"^(?:\[default\d+\]:)?step (\d+)/", re.M)  # ptrun prefixes the ranks' lines
RESUMED = re.compile(r"resumed from \S*step-(\d+)")
SIGNAL_SAVE = re.compile(r"signal 15: checkpoint of step (\d+) committed")


class Hang(Failure):
    """A job still running at its deadline (it is killed)."""


def log(msg):
    print(msg, flush=True)


# length: gpt_char's --steps, fashion_mnist's --epochs
Scenario = collections.namedtuple("Scenario", "name program mode length")


def scenarios(faults_each):
    # Enough steps that every fault finds a checkpoint before it and room after it.
    gpt_steps = max(240, INTERVAL * (2 * faults_each + 4))
    epochs = max(2, -(-INTERVAL * (2 * faults_each + 4) // 96))  # 96 steps per epoch on 2 ranks
    return [Scenario("gpt_char.ddp", "gpt_char", "ddp", gpt_steps),
            Scenario("gpt_char.fsdp", "gpt_char", "fsdp", gpt_steps),
            Scenario("gpt_char.pipeline", "gpt_char", "pipeline", gpt_steps),
            Scenario("fashion_mnist.ddp", "fashion_mnist", "ddp", epochs),
            Scenario("fashion_mnist.fsdp", "fashion_mnist", "fsdp", epochs)]


def write_fashion_subset(src, dst, train=3072, test=512):
    """The first images of Debian's Fashion-MNIST as IDX files (what --data reads)."""
    os.makedirs(dst, exist_ok=True)
    for name, n in (("train", train), ("t10k", test)):
        for kind, head in (("images-idx3", 16), ("labels-idx1", 8)):
            path = os.path.join(src, f"{name}-{kind}-ubyte")
            raw = gzip.open(path + ".gz").read() if os.path.exists(path + ".gz") else open(path, "rb").read()
            dims = struct.unpack(f">{head // 4}I", raw[:head])
            per = 1
            for d in dims[2:]:
                per *= d
            out = struct.pack(f">{head // 4}I", dims[0], n, *dims[2:]) + raw[head:head + n * per]
            with open(os.path.join(dst, f"{name}-{kind}-ubyte"), "wb") as f:
                f.write(out)


class Job:
    """One ptrun invocation, its output in files (read while it runs)."""

    def __init__(self, ctx, sc, ranks, ckpt, tag, restarts=0, keep_all=False):
        self.ranks = ranks
        self.out_path = os.path.join(ctx.work, f"{tag}.out")
        self.err_path = os.path.join(ctx.work, f"{tag}.err")
        argv = [ctx.ptrun, "--standalone", "--nproc-per-node", str(ranks), "--max-restarts", str(restarts),
                "--grace-period", str(GRACE_S), "stdbuf", "-oL"] + ctx.program_args(sc, ckpt)
        if keep_all:  # references keep every checkpoint (a reshape resumes one of them)
            argv += ["--keep-checkpoints", "0"]
        self.argv = argv
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, env=ctx.env, start_new_session=True)
        self.started = time.time()
        ctx.jobs.append(self)

    def out(self):
        with open(self.out_path) as f:
            return f.read()

    def err(self):
        with open(self.err_path) as f:
            return f.read()

    def restarts(self):
        return self.err().count("ptrun: starting all")

    def resumes(self):
        """Steps of the checkpoints the rounds so far resumed from."""
        return [int(s) for s in RESUMED.findall(self.out())]

    def progress(self):
        """The step the current round reached (0 before its first progress line)."""
        out = self.out()
        m = PROGRESS.findall(out[out.rfind("resumed from") + 1:])
        return int(m[-1]) if m else 0

    def reached(self):
        """The step the round before the current one reached."""
        out = self.out()
        end = out.rfind("resumed from")
        m = PROGRESS.findall(out[out.rfind("resumed from", 0, max(end, 0)) + 1:end])
        return int(m[-1]) if m else 0

    def wait(self, deadline):
        """Exit status, or None when the job is still running at `deadline` (then it is killed)."""
        try:
            return self.proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.kill_all()
            return None

    def rank_pids(self):
        return [rank_pid(self.proc.pid, r) for r in range(self.ranks)]

    def kill_all(self):
        """SIGKILL ptrun first (so it restarts nothing), then its ranks (own process groups)."""
        pids = []
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in pids:
            try:
                os.kill(p, signal.SIGCONT)
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def describe(self):
        return f"{' '.join(self.argv)}\n--- stdout (tail)\n{self.out()[-3000:]}\n--- stderr (tail)\n{self.err()[-3000:]}"


class Context:
    def __init__(self, args, work, reshape_to):
        self.ptrun, self.work, self.reshape_to = args.ptrun, work, reshape_to
        self.exe = {"gpt_char": args.gpt_char, "fashion_mnist": args.fashion_mnist}
        self.env = dict(os.environ, PTRAIN_COMM_TIMEOUT_S=str(COMM_TIMEOUT_S))
        self.corpus = os.path.join(work, "corpus.txt")
        self.fashion = os.path.join(work, "fashion")
        self.jobs = []  # every job started, so that a failed check leaves none running

    def program_args(self, sc, ckpt):
        common = ["--checkpoint-dir", ckpt, "--checkpoint-every", str(INTERVAL), "--resume", "--log-every", "1",
                  "--parallel", sc.mode, "--preempt-exit-code", str(PREEMPT_EXIT)]
        if sc.program == "gpt_char":
            return [self.exe["gpt_char"], "--data", self.corpus, "--steps", str(sc.length)] + GPT + common
        return [self.exe["fashion_mnist"], "--data", self.fashion, "--hidden", "32", "--batch", "16", "--epochs",
                str(sc.length)] + common


def tmpfs_mount(path):
    """Mounts a TMPFS_MB tmpfs on `path`; False where this process may not."""
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", path],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def fill(fs_dir):
    """Fills the file system of fs_dir up to its last byte; returns the filler's path."""
    path = os.path.join(fs_dir, "filler")
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    return path


class Stats:
    def __init__(self):
        self.injected = {k: 0 for k in KINDS}
        self.recovered = {k: 0 for k in KINDS}
        self.lost = {k: 0 for k in KINDS}  # most committed steps a resume lost
        self.redone = {k: 0 for k in KINDS}  # most steps a resume trained again
        self.missed = 0  # faults drawn whose run ended before their step came
        self.runs = self.hung = self.bitwise = self.same_world = self.tolerance = self.reshaped = 0
        self.failures = []


def wait_for(job, cond, deadline, what):
    while not cond():
        if job.proc.poll() is not None:
            return False
        if time.time() > deadline:
            raise Hang(f"{what}: nothing happened before the deadline (hang)\n{job.describe()}")
        time.sleep(0.005)
    return True


def newest(ckpt):
    """The newest committed checkpoint whose files have the sizes index.json records
    (a truncated one is skipped, as ptrain's latest() does), or None."""
    for step in reversed(committed_steps(ckpt)):
        d = step_dir(ckpt, step)
        try:
            with open(os.path.join(d, "index.json")) as f:
                files = json.load(f)["files"]
            if all(os.path.getsize(os.path.join(d, name)) == v["bytes"] for name, v in files.items()):
                return step
        except (OSError, ValueError, KeyError):
            continue  # rotated away while being read, or not complete
    return None


def reference(ctx, sc, ranks, tag, start_from=None):
    """An uninterrupted run that keeps every checkpoint; start_from: a checkpoint
    directory copied in first, which it resumes from. Returns (its directory, seconds)."""
    ckpt = os.path.join(ctx.work, tag)
    os.makedirs(ckpt)
    if start_from:
        shutil.copytree(start_from, os.path.join(ckpt, os.path.basename(start_from)))
    job = Job(ctx, sc, ranks, ckpt, tag, keep_all=True)
    rc = job.wait(time.time() + 600)
    if rc is None:
        raise Hang(f"{tag}: reference run still running after 600 s; killed\n{job.describe()}")
    if rc != 0:
        raise Failure(f"{tag}: reference run: exit status {rc}\n{job.describe()}")
    return ckpt, time.time() - job.started


def inject_in_job(job, kind, victim, ckpt, base, deadline, what):
    """kill, stop or disk in the running job. Returns, once ptrun has started the next
    round, the newest checkpoint committed before that (read while the failed round ran)."""
    n = job.restarts()
    pid = job.rank_pids()[victim]
    committed = newest(ckpt)
    if kind == "kill":
        os.kill(pid, signal.SIGKILL)
    elif kind == "stop":
        os.kill(pid, signal.SIGSTOP)
    filler = fill(base) if kind == "disk" else None
    cont = time.time() + COMM_TIMEOUT_S + GRACE_S + 1  # SIGCONT then, if ptrun has not killed it yet
    try:
        # A checkpoint read while no restart is announced yet is one the failed round committed.
        while job.restarts() <= n:
            if job.proc.poll() is not None:
                raise Failure(f"{what}: the job ended instead of restarting\n{job.describe()}")
            if time.time() > deadline:
                raise Hang(f"{what}: no restart before the deadline (hang)\n{job.describe()}")
            committed = newest(ckpt)
            time.sleep(0.005)
    finally:
        if filler:
            os.remove(filler)
        if kind == "stop":
            while time.time() < cont and os.path.exists(f"/proc/{pid}"):
                time.sleep(0.05)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return committed


def account(st, kind, committed, resumed, reached, expect, what, job):
    """Checks and records one resume: from `expect` (the newest committed checkpoint, or
    for truncate the one before it), having reached step `reached` before the fault."""
    lost, redone = committed - resumed, reached - resumed
    st.lost[kind] = max(st.lost[kind], lost)
    st.redone[kind] = max(st.redone[kind], redone)
    if resumed != expect or redone > 2 * INTERVAL + 2:
        raise Failure(f"{what}: resumed from step {resumed}, expected {expect} (newest committed: {committed}, "
                      f"step reached: {reached})\n{job.describe()}")
    st.recovered[kind] += 1
    log(f"   -> resumed from step {resumed}")


def run_scenario(ctx, sc, kinds, rng, st):
    """One chaos run of scenario `sc` with faults of `kinds` (in this order); updates st."""
    log(f"== {sc.name}: faults {', '.join(kinds) or 'none'}")
    ref, ref_time = reference(ctx, sc, 2, f"{sc.name}-ref")
    ref_steps = committed_steps(ref)
    final_step = ref_steps[-1]
    base = os.path.join(ctx.tmpfs or ctx.work, f"{sc.name}-chaos")
    ckpt = os.path.join(base, "ckpt")
    os.makedirs(ckpt)
    targets = sorted(rng.sample(range(INTERVAL + 2, final_step - INTERVAL // 2), len(kinds)))
    pending = list(zip(kinds, targets))
    ranks, ref_final, segment = 2, ref, 0
    after = None  # the last segment's fault: (kind, newest committed, step to resume from, step reached)
    while True:
        job = Job(ctx, sc, ranks, ckpt, f"{sc.name}-chaos{segment}", restarts=2 * len(kinds) + 2)
        st.runs += 1
        budget = 60 + 4 * ref_time + (COMM_TIMEOUT_S + GRACE_S + 20) * len(pending)
        deadline = job.started + budget
        if after:
            kind, committed, expect, reached = after
            if not wait_for(job, job.resumes, deadline, f"{sc.name} resume after {kind}"):
                raise Failure(f"{sc.name}: no resume after {kind}\n{job.describe()}")
            account(st, kind, committed, job.resumes()[0], reached, expect, f"{sc.name}: {kind}", job)
        ended_by = None
        while pending:
            kind, target = pending[0]
            # The fault comes at its step, once a checkpoint exists (else "lost" means nothing);
            # a reshape once the newest is one the reference has too (not a signal's).
            ready = (lambda: newest(ckpt) in ref_steps) if kind == "reshape" else (lambda: newest(ckpt) is not None)
            if not wait_for(job, lambda: job.progress() >= target and ready(), deadline,
                            f"{sc.name}: {kind} at step {target}"):
                break
            pending.pop(0)
            st.injected[kind] += 1
            seen = len(job.resumes())
            log(f"   {kind} at step {job.progress()} (newest checkpoint {newest(ckpt)})")
            if kind in ("term", "truncate", "reshape"):
                ended_by = kind
                if kind == "reshape":
                    job.kill_all()
                else:
                    os.kill(job.proc.pid, signal.SIGTERM)
                break
            what = f"{sc.name}: {kind} at step {target}"
            committed = inject_in_job(job, kind, rng.randrange(ranks), ckpt, base, deadline, what)
            if not wait_for(job, lambda: len(job.resumes()) > seen, deadline, what):
                raise Failure(f"{what}: the restarted ranks did not resume\n{job.describe()}")
            account(st, kind, committed, job.resumes()[-1], job.reached(), committed, what, job)
        rc = job.wait(deadline)
        if rc is None:
            raise Hang(f"{sc.name}: job still running {budget:.0f} s after its start (hung); killed\n"
                          f"{job.describe()}")
        if ended_by is None:
            st.missed += len(pending)
            if rc != 0:
                raise Failure(f"{sc.name}: exit status {rc}, expected 0\n{job.describe()}")
            break
        committed = expect = newest(ckpt)
        if ended_by in ("term", "truncate"):
            m = SIGNAL_SAVE.search(job.out())
            if rc != PREEMPT_EXIT or not m or int(m.group(1)) != committed:
                raise Failure(f"{sc.name}: SIGTERM to ptrun: exit {rc}, expected {PREEMPT_EXIT} and a "
                              f"committed checkpoint of the step reached (newest: {committed})\n{job.describe()}")
        if ended_by == "truncate":
            d = step_dir(ckpt, committed)
            victim = os.path.join(d, sorted(f for f in os.listdir(d) if f.startswith("model"))[0])
            os.truncate(victim, os.path.getsize(victim) // 2)
            expect = newest(ckpt)
            if expect is None or committed - expect > INTERVAL:
                raise Failure(f"{sc.name}: checkpoints {committed_steps(ckpt)}: more than {INTERVAL} steps "
                              f"between the newest two")
        if ended_by == "reshape":
            # Up to here the run equals the reference bit for bit; the reference then
            # resumes from its own checkpoint of this step on the new number of ranks.
            d = diff_checkpoints(step_dir(ref, committed), step_dir(ckpt, committed))
            if d is not None:
                raise Failure(f"{sc.name}: checkpoint {committed} differs from the reference's: {d}")
            ranks = rng.choice(ctx.reshape_to)
            ref_final, _ = reference(ctx, sc, ranks, f"{sc.name}-ref{ranks}", step_dir(ref, committed))
            st.reshaped += 1
            log(f"   -> resuming on {ranks} rank(s)")
        after = (ended_by, committed, expect, job.progress())
        segment += 1
    final, ref_step = newest(ckpt), newest(ref_final)
    if final != ref_step:
        raise Failure(f"{sc.name}: final checkpoint of step {final}, the reference's is {ref_step}")
    d = diff_checkpoints(step_dir(ref_final, final), step_dir(ckpt, final))
    if ref_final == ref:
        st.same_world += 1
        if d is not None:
            raise Failure(f"{sc.name}: the final checkpoint differs from the uninterrupted run's: {d}")
        st.bitwise += 1
        log(f"   final step {final}: bitwise equal to the reference")
    else:
        rel = max_rel_diff(step_dir(ckpt, final), step_dir(ref_final, final))
        if rel > TOL:
            raise Failure(f"{sc.name}: final model {rel:.3g} (relative) from the reference resumed on {ranks} "
                          f"rank(s); tolerance {TOL}")
        st.tolerance += 1
        st.bitwise += d is None
        log(f"   final step {final}: within {rel:.2g} (relative) of the reference resumed on {ranks} rank(s)"
            f"{', bitwise equal' if d is None else ''}")
    shutil.rmtree(base)


def draw(rng, n, count, have_tmpfs):
    """Fault kinds for `count` scenarios, n in all, round-robin; at most one reshape per
    scenario, last in its list."""
    kinds = [k for k in KINDS if have_tmpfs or k != "disk"]
    per = [[] for _ in range(count)]
    for i in range(n):
        lst = per[i % count]
        k = rng.choice(kinds)
        while k == "reshape" and "reshape" in lst:
            k = rng.choice(kinds)
        lst.append(k)
    for lst in per:
        if "reshape" in lst:
            lst.remove("reshape")
            lst.append("reshape")
    return per


def table(st, have_tmpfs, seconds):
    rows = [("fault", "injected", "recovered", "committed steps lost (max)", "steps trained again (max)")]
    for k in KINDS:
        note = "" if have_tmpfs or k != "disk" else " (no tmpfs: not drawn)"
        rows.append((k + note, st.injected[k], st.recovered[k], st.lost[k], st.redone[k]))
    rows.append(("total", sum(st.injected.values()), sum(st.recovered.values()), max(st.lost.values()),
                 max(st.redone.values())))
    w = [max(len(str(r[i])) for r in rows) for i in range(5)]
    lines = ["| " + " | ".join(str(r[i]).ljust(w[i]) for i in range(5)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (x + 2) for x in w) + "|")
    lines += ["", f"jobs started: {st.runs}; hung: {st.hung}; faults whose run ended first: {st.missed}",
              f"final models: {st.bitwise} bitwise equal to their reference; {st.same_world} scenario(s) "
              f"kept 2 ranks throughout, {st.reshaped} changed the world size ({st.tolerance} within {TOL})",
              f"failures: {len(st.failures)}; wall time {seconds:.0f} s"]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptrun", required=True)
    ap.add_argument("--gpt-char", required=True)
    ap.add_argument("--fashion-mnist", required=True)
    ap.add_argument("--fashion-data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--faults", type=int, default=8, help="faults in all, spread over the scenarios")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default="", help="run the scenarios whose name matches this regex")
    ap.add_argument("--reshape-to", default="1,3",
                    help="world sizes a reshape fault resumes on (comma-separated, from 1 to 4)")
    ap.add_argument("--work", help="work directory (default: a new temporary one, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    if args.faults < 0:
        ap.error("--faults must be >= 0")
    try:
        reshape_to = [int(x) for x in args.reshape_to.split(",")]
    except ValueError:
        reshape_to = []
    if not reshape_to or any(not 1 <= x <= 4 or x == 2 for x in reshape_to):
        ap.error(f"--reshape-to {args.reshape_to!r}: give world sizes from 1 to 4 other than 2, e.g. 1,3")
    count = sum(1 for s in scenarios(0) if re.search(args.only, s.name))
    if not count:
        ap.error(f"--only {args.only!r} matches no scenario")
    for exe in (args.ptrun, args.gpt_char, args.fashion_mnist):
        if not os.access(exe, os.X_OK):
            ap.error(f"{exe} is not an executable")
    if not os.path.exists(os.path.join(args.fashion_data, "train-images-idx3-ubyte.gz")) and \
            not os.path.exists(os.path.join(args.fashion_data, "train-images-idx3-ubyte")):
        print(f"chaos: FAIL: no Fashion-MNIST in {args.fashion_data} (run tools/install-deps.sh --test: it installs "
              "dataset-fashion-mnist; or give --fashion-data)")
        return 1
    if shutil.which("stdbuf") is None:
        print("chaos: FAIL: stdbuf (coreutils) not found; it line-buffers the progress the faults are timed by")
        return 1
    # Without root, tmpfs needs a user and mount namespace of our own: run again inside one.
    if os.geteuid() != 0 and "PTRAIN_CHAOS_NS" not in os.environ and shutil.which("unshare") and \
            subprocess.run(["unshare", "-rm", "true"], stderr=subprocess.DEVNULL).returncode == 0:
        os.environ["PTRAIN_CHAOS_NS"] = "1"
        os.execvp("unshare", ["unshare", "-rm", sys.executable] + sys.argv)
    work = args.work or tempfile.mkdtemp(prefix="ptrain-chaos-")
    os.makedirs(work, exist_ok=True)
    ctx = Context(args, work, reshape_to)
    tmpfs = os.path.join(work, "tmpfs")
    ctx.tmpfs = tmpfs if tmpfs_mount(tmpfs) else None
    log(f"chaos: seed {args.seed}, {args.faults} fault(s), work {work}; checkpoints on "
        f"{'a ' + str(TMPFS_MB) + ' MiB tmpfs' if ctx.tmpfs else 'the work directory (no tmpfs: no disk faults)'}")
    write_corpus(ctx.corpus)
    write_fashion_subset(args.fashion_data, ctx.fashion)
    rng = random.Random(args.seed)
    scs = [s for s in scenarios(-(-args.faults // count)) if re.search(args.only, s.name)]
    plan = draw(rng, args.faults, len(scs), ctx.tmpfs is not None)
    st = Stats()
    t0 = time.time()
    try:
        for sc, kinds in zip(scs, plan):
            try:
                run_scenario(ctx, sc, kinds, rng, st)
            except Failure as e:
                st.hung += isinstance(e, Hang)
                st.failures.append(f"{sc.name}: {e}")
                log(f"FAIL {e}")
            except Exception:  # a bug of this driver, or a file ptrain should have written
                st.failures.append(f"{sc.name}: {traceback.format_exc()}")
                log(f"FAIL {sc.name}:\n{traceback.format_exc()}")
            finally:
                for job in ctx.jobs:
                    if job.proc.poll() is None:
                        job.kill_all()
    finally:
        if ctx.tmpfs:
            subprocess.run(["umount", "-l", ctx.tmpfs], stderr=subprocess.DEVNULL)
    print()
    print(table(st, ctx.tmpfs is not None, time.time() - t0))
    if st.failures:
        print(f"logs of every job: {work}")
    if not st.failures and not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if st.failures else 0


if __name__ == "__main__":
    sys.exit(main())
