#!/usr/bin/python3
"""examples/gpt_char resumes exactly from its checkpoints.

usage: test_gpt_char_resume.py GPT_CHAR [PTRUN]

A tiny GPT (1 layer, width 32, dropout 0.1, so the dropout streams matter) trains
on a corpus written here. Each case compares the tensors of a resumed run's final
checkpoint byte for byte with those of an uninterrupted run (model and optimizer
tensors, read by the parser below, not by ptrain: whole files, or the shards of
--parallel fsdp assembled from index.json's pieces), and trainer.json's step, data
position, dropout offsets and optimizer step count:
  single.copy    resume from the step-8 checkpoint of a 12-step run, to step 12
  single.signal  SIGTERM a longer run once a checkpoint exists: exit code
                 --preempt-exit-code, a committed checkpoint of the step it stopped at,
                 then --resume to the end
  single.control resume with another --seed must NOT match (the comparison can fail)
  config         --resume with --layers 2 / --heads 4 fails with [ptrain.example.config]
                 naming the flag, exit code != 0, within a timeout
  flags          --steps abc, --temperature -1, a --prompt character outside the
                 corpus, an --export into a missing folder, a --batch that
                 --micro-batches does not divide and more --stages than ranks or units
                 fail before training
  bf16.*         --precision bf16: copy as above, BF16 parameters and F32 optimizer state
                 (with the master weights) in the files, an fp32 resume refused; with
                 OpenBLAS on a CPU with AVX2 the copy runs again with its Haswell kernels, whose
                 rounding depends on operand alignment (heap placement must not matter)
  ddp.*          the same with 2 ranks under ptrun (--parallel ddp); the signal goes to
                 rank 1 only, and every rank must stop at the same step
  ddp.restart    ptrun --max-restarts 1: SIGKILL rank 1 once a checkpoint exists; ptrun starts
                 both ranks again, they resume from the last checkpoint and end bitwise equal
                 to the uninterrupted run; ddp.restart-nodes: the same with two ptrun nodes
                 (--nnodes 2, one rank each), restarted together through node 0's agent store
  fsdp.*         copy, config and signal with 2 ranks under --parallel fsdp (full_shard):
                 sharded checkpoints, resumed bitwise on the same layout
  fsdp.ddp       fsdp's final parameters equal ddp's within 1e-5 relative (same flags);
                 --export equals the assembled checkpoint bitwise
  fsdp.cross     a ddp checkpoint resumed with fsdp, and an fsdp one with ddp, end within
                 1e-5 of the uninterrupted runs
  fsdp.reshape   (dropout 0) a 2-rank fsdp checkpoint resumed by 1 process (--parallel
                 none, --batch 8) and by 2 ranks with the other strategies: within 1e-5
  accum          (dropout 0, no clipping) --grad-accum 2 at half the batch, resumed from step 8 of
                 1 process with --batch 8, by 1 process and by 2 ranks (ddp, fsdp full_shard
                 and shard_optimizer): model and AdamW moments within 1e-5 of its step 12;
                 ddp-accum.copy resumes --grad-accum bitwise
  init.*         --init-from single.copy's final model, as ptrain wrote it and converted here to
                 Hugging Face's GPT-2 layout: a run with lr 0 validates as that run ended;
                 init.resume: a checkpoint to resume wins (--init-from's file is not read)
  tokens.*       the corpus's character ids written here as nanoGPT's uint16 train.bin/val.bin and
                 as llm.c shards train (1 process, and ddp on 2 ranks) bitwise like the text;
                 a too small --vocab-size, a truncated shard, a pattern that matches nothing
                 and a missing --vocab-size are refused before training
  fsdp.sample    1 process loading fsdp's final checkpoint evaluates and samples
                 (greedy) exactly as the fsdp run did
  pipeline.*     --parallel pipeline (untied model, stage checkpoints): copy and signal
                 with 2 stages, bitwise; without dropout, 2 stages end within 1e-5 of one
                 --untied process and 2 replicas x 2 stages (4 ranks, gpipe) of ddp
                 --untied on 2 ranks; its final checkpoint loaded by 1 process evaluates
                 and samples as the pipeline did, and --export equals it; checkpoints cross
                 between pipeline and none/ddp, and from 2 stages to 3 (within 1e-5); a
                 tied checkpoint is refused naming --untied
Exit 0 on success, 1 on failure.
"""

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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from gpt_char_util import Failure  # noqa: E402
from ports import free_port_pair  # noqa: E402
from safetensors_io import read as read_safetensors, write as write_safetensors  # noqa: E402

TIMEOUT_S = 120
PREEMPT_CODE = 75
TINY = ["--layers", "1", "--heads", "2", "--embd", "32", "--block", "32", "--batch", "4", "--dropout", "0.1",
        "--warmup", "3", "--eval-every", "1000000", "--sample-tokens", "0", "--log-every", "0", "--threads", "1"]
LONG_STEPS = 1000  # the signal cases: long enough that the run is still going when the signal comes
FSDP_LONG_STEPS = 400  # fsdp's steps cost about 3 ddp steps here (more, smaller collectives)
LONG_EVERY = 50
TOL = 1e-5  # relative, where the number of ranks or the reduction order changes
SAMPLE = ["--sample-tokens", "40", "--temperature", "0"]


def write_corpus(path):
    rng = random.Random(6)
    words = ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog.", "A", "cat", "sat", "on",
             "a", "mat,", "and", "then", "it", "slept."]
    with open(path, "w") as f:
        f.write(" ".join(rng.choice(words) for _ in range(4000)) + "\n")


def step_dir(ckpt, step):
    return os.path.join(ckpt, f"step-{step:08d}")


def committed_steps(ckpt):
    if not os.path.isdir(ckpt):
        return []
    return sorted(int(d[5:]) for d in os.listdir(ckpt)
                  if d.startswith("step-") and os.path.exists(os.path.join(ckpt, d, "COMMITTED")))


def read_checkpoint(d):
    """role ("model", "optimizer") -> name -> (dtype, shape, raw bytes) of a checkpoint
    directory, whole tensors: a tensor stored in pieces (sharded saves: key "name@offset",
    1-D, elements [offset, offset + numel) of the flattened tensor, described in
    index.json's "pieces") is assembled here, checking that the pieces tile it exactly."""
    with open(os.path.join(d, "index.json")) as f:
        index = json.load(f)
    files = {name: read_safetensors(os.path.join(d, name)) for name in set(index["weight_map"].values())}
    pieces = index.get("pieces", {})
    out, parts = {}, {}
    for key, fname in index["weight_map"].items():
        role = fname.split("-")[0].split(".")[0]
        if key not in files[fname]:
            raise Failure(f"{d}: index.json puts {key} in {fname}, which does not hold it")
        dtype, shape, raw = files[fname][key]
        if key in pieces:
            p = pieces[key]
            if shape != (p["numel"],) or p["tensor"] != key.rsplit("@", 1)[0]:
                raise Failure(f"{d}: piece {key} is {shape}, index.json says {p}")
            parts.setdefault((role, p["tensor"]), []).append((p["offset"], p["numel"], tuple(p["shape"]), dtype, raw))
        else:
            out.setdefault(role, {})[key] = (dtype, shape, raw)
    for (role, name), ps in parts.items():
        ps.sort()
        if len({p[2] for p in ps}) != 1 or len({p[3] for p in ps}) != 1 or name in out.get(role, {}):
            raise Failure(f"{d}: pieces of {name} disagree on shape or dtype, or it is also stored whole")
        shape, dtype = ps[0][2], ps[0][3]
        total, pos, blob = 1, 0, b""
        for n in shape:
            total *= n
        for off, n, _, _, raw in ps:
            if off != pos:
                raise Failure(f"{d}: pieces of {name} leave a gap or overlap at element {pos} (next at {off})")
            blob += raw
            pos += n
        if pos != total:
            raise Failure(f"{d}: pieces of {name} cover {pos} of {total} elements")
        out.setdefault(role, {})[name] = (dtype, shape, blob)
    return out


def floats(t):
    n = len(t[2]) // 4
    return struct.unpack(f"<{n}f", t[2])


def max_rel_diff(a, b, role="model"):
    """Largest |a - b| over the largest |b|, over every tensor of `role` in two checkpoints."""
    ta, tb = read_checkpoint(a)[role], read_checkpoint(b)[role]
    if sorted(ta) != sorted(tb):
        raise Failure(f"{a} vs {b}: {role} tensor names differ: {sorted(set(ta) ^ set(tb))}")
    diff, scale = 0.0, 0.0
    for name in ta:
        if ta[name][:2] != tb[name][:2] or ta[name][0] != "F32":
            raise Failure(f"{a} vs {b}: {name}: {ta[name][:2]} vs {tb[name][:2]}")
        xb = floats(tb[name])
        diff = max(diff, max(abs(x - y) for x, y in zip(floats(ta[name]), xb)))
        scale = max(scale, max(abs(y) for y in xb))
    return diff / scale


def diff_checkpoints(a, b):
    """First difference between two checkpoint directories, or None when they are identical."""
    ca, cb = read_checkpoint(a), read_checkpoint(b)
    for fname in ("model", "optimizer"):
        ta, tb = ca.get(fname, {}), cb.get(fname, {})
        if sorted(ta) != sorted(tb):
            return f"{fname}: tensor names differ: {sorted(set(ta) ^ set(tb))}"
        if not ta:
            return f"{fname}: no tensors"
        for name in sorted(ta):
            if ta[name][:2] != tb[name][:2]:
                return f"{fname}: {name}: {ta[name][:2]} vs {tb[name][:2]}"
            if ta[name][2] != tb[name][2]:
                worst = 0.0
                if ta[name][0] == "F32":
                    worst = max(abs(x - y) for x, y in zip(floats(ta[name]), floats(tb[name])))
                return f"{fname}: tensor {name} differs (max |diff| {worst:.3g})"
    ja, jb = (json.load(open(os.path.join(d, "trainer.json"))) for d in (a, b))
    for key in ("step", "sampler", "rng", "optimizer", "world_size"):
        if ja.get(key) != jb.get(key):
            return f"trainer.json: {key}: {ja.get(key)} vs {jb.get(key)}"
    return None


class Runner:
    def __init__(self, exe, ptrun, work):
        self.exe, self.ptrun, self.work = exe, ptrun, work
        self.env = dict(os.environ, PTRAIN_COMM_TIMEOUT_S=os.environ.get("PTRAIN_COMM_TIMEOUT_S", "60"))

    def argv(self, ranks, args, mode=None, restarts=0):
        """TINY with args (a flag of TINY given in args takes args' value); mode: --parallel,
        by default none on 1 rank and ddp on more; restarts: ptrun's --max-restarts."""
        flags = list(TINY)
        where = {TINY[k]: k for k in range(0, len(TINY), 2)}  # TINY is flag, value pairs
        rest = []
        i = 0
        while i < len(args):
            if args[i] in where and i + 1 < len(args):
                flags[where[args[i]] + 1] = args[i + 1]
                i += 2
            else:
                rest.append(args[i])
                i += 1
        data = [] if "--train-tokens" in args else ["--data", os.path.join(self.work, "corpus.txt")]
        base = [self.exe] + data + flags + rest
        mode = mode or ("none" if ranks == 1 else "ddp")
        if mode == "none":
            return base
        # --standalone: a free store port, so that concurrent tests do not collide on 29500.
        return ([self.ptrun, "--standalone", "--nproc-per-node", str(ranks), "--max-restarts", str(restarts)] + base
                + ["--parallel", mode])

    def start(self, ranks, args, mode=None, restarts=0):
        return subprocess.Popen(self.argv(ranks, args, mode, restarts), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=self.env, start_new_session=True)

    def finish(self, proc, what):
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise Failure(f"{what}: no exit within {TIMEOUT_S} s (hang)\n{out}\n{err}")
        # ptrun prefixes the lines of several ranks with the rank ("[default0]:"); the
        # checks read the program's own lines.
        return proc.returncode, RANK_PREFIX.sub("", out), RANK_PREFIX.sub("", err)

    def run(self, ranks, args, what, expect=0, mode=None):
        rc, out, err = self.finish(self.start(ranks, args, mode), what)
        if expect is not None and rc != expect:
            raise Failure(f"{what}: exit code {rc}, expected {expect}\nstdout:\n{out}\nstderr:\n{err}")
        return rc, out, err


RANK_PREFIX = re.compile(r"^\[default\d+\]:", re.M)


def rank_pid(ptrun_pid, rank):
    """The pid of rank `rank` among ptrun's children (from RANK in its environment)."""
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with open(f"/proc/{ptrun_pid}/task/{ptrun_pid}/children") as f:
                kids = [int(p) for p in f.read().split()]
        except OSError:
            kids = []
        for k in kids:
            try:
                with open(f"/proc/{k}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except OSError:
                continue
            if env.get(b"RANK") == str(rank).encode():
                return k
        time.sleep(0.01)
    raise Failure(f"rank {rank} of ptrun (pid {ptrun_pid}) not found in /proc")


def expect_same(ref, got, what):
    d = diff_checkpoints(ref, got)
    if d is not None:
        raise Failure(f"{what}: resumed checkpoint {got} differs from uninterrupted {ref}: {d}")
    print(f"ok   {what}: {got} == {ref} (model, optimizer, trainer state)")


def case_copy(r, ranks, tag, mode=None, extra=(), flags=()):
    """Uninterrupted 12 steps (checkpoints 4, 8, 12), then resume from copies of steps 4 and 8.
    extra: flags of the uninterrupted run only; flags: of every run.
    Returns the reference directory and the uninterrupted run's output."""
    ref = os.path.join(r.work, f"{tag}-ref")
    _, ref_out, _ = r.run(ranks, ["--steps", "12", "--checkpoint-dir", ref, "--checkpoint-every", "4",
                                  "--keep-checkpoints", "0"] + list(extra) + list(flags), f"{tag} uninterrupted run",
                          mode=mode)
    if committed_steps(ref) != [4, 8, 12]:
        raise Failure(f"{tag}: expected committed checkpoints 4, 8, 12 in {ref}, found {committed_steps(ref)}")
    if diff_checkpoints(step_dir(ref, 8), step_dir(ref, 12)) is None:
        raise Failure(f"{tag}: steps 8 and 12 are identical: the model does not train")
    for start in (4, 8):
        res = os.path.join(r.work, f"{tag}-from{start}")
        os.makedirs(res)
        shutil.copytree(step_dir(ref, start), step_dir(res, start))
        _, out, _ = r.run(ranks, ["--steps", "12", "--checkpoint-dir", res, "--checkpoint-every", "4", "--resume"]
                          + list(flags), f"{tag} resume from step {start}", mode=mode)
        if f"step {start}" not in out or "resumed from" not in out:
            raise Failure(f"{tag}: the resumed run did not report resuming from step {start}:\n{out}")
        expect_same(step_dir(ref, 12), step_dir(res, 12), f"{tag}.copy (from step {start})")
    return ref, ref_out


def case_control(r, ranks, tag, ref):
    """Resuming with another --seed changes data and dropout streams: must differ (and say so)."""
    res = os.path.join(r.work, f"{tag}-control")
    os.makedirs(res)
    shutil.copytree(step_dir(ref, 8), step_dir(res, 8))
    _, out, _ = r.run(ranks, ["--steps", "12", "--checkpoint-dir", res, "--resume", "--seed", "7"],
                      f"{tag} resume with --seed 7")
    if "not the bit-exact continuation" not in out or "--seed 7" not in out:
        raise Failure(f"{tag}.control: no note about the changed --seed:\n{out}")
    if diff_checkpoints(step_dir(ref, 12), step_dir(res, 12)) is None:
        raise Failure(f"{tag}.control: another --seed gave the same step-12 checkpoint; "
                      "the comparison does not see data or dropout state")
    print(f"ok   {tag}.control: another --seed differs, with a note")


def wait_first_checkpoint(r, proc, ckpt, what):
    deadline = time.time() + TIMEOUT_S
    while not committed_steps(ckpt):
        if proc.poll() is not None or time.time() > deadline:
            _, out, err = r.finish(proc, what)
            raise Failure(f"{what}: the run ended (or stalled) before its first checkpoint\n{out}\n{err}")
        time.sleep(0.002)


def case_signal(r, ranks, tag, mode=None, long_steps=LONG_STEPS):
    """SIGTERM (to the only rank, or to rank 1 of 2) once a checkpoint exists; resume; compare."""
    ref = os.path.join(r.work, f"{tag}-long-ref")
    long = ["--steps", str(long_steps)]
    r.run(ranks, long + ["--checkpoint-dir", ref], f"{tag} uninterrupted {long_steps}-step run", mode=mode)
    ckpt = os.path.join(r.work, f"{tag}-signal")
    args = long + ["--checkpoint-dir", ckpt, "--checkpoint-every", str(LONG_EVERY), "--preempt-exit-code",
                   str(PREEMPT_CODE), "--resume"]
    proc = r.start(ranks, args, mode)
    target = proc.pid if ranks == 1 else rank_pid(proc.pid, 1)
    wait_first_checkpoint(r, proc, ckpt, tag)
    os.kill(target, signal.SIGTERM)
    rc, out, err = r.finish(proc, f"{tag} signalled run")
    if rc == 0 and f"step {long_steps}:" in out:
        raise Failure(f"{tag}: the run finished before SIGTERM arrived; raise {long_steps} (LONG_STEPS)")
    if rc != PREEMPT_CODE:
        raise Failure(f"{tag}: exit code {rc} after SIGTERM, expected --preempt-exit-code {PREEMPT_CODE}\n"
                      f"{out}\n{err}")
    marker = "signal 15: checkpoint of step "
    if marker not in out:
        raise Failure(f"{tag}: rank 0 did not report the signal checkpoint:\n{out}\n{err}")
    stopped = int(out.split(marker, 1)[1].split()[0])
    if not (LONG_EVERY <= stopped < long_steps) or committed_steps(ckpt)[-1] != stopped:
        raise Failure(f"{tag}: stopped at step {stopped}, committed {committed_steps(ckpt)}")
    print(f"ok   {tag}.signal: SIGTERM to {'rank 1 of 2' if ranks > 1 else 'the process'} -> exit {rc}, "
          f"checkpoint of step {stopped} committed")
    _, out, _ = r.run(ranks, args, f"{tag} resume after the signal", mode=mode)
    if f"resumed from {step_dir(ckpt, stopped)}: step {stopped}" not in out:
        raise Failure(f"{tag}: the resumed run did not start at step {stopped}:\n{out}")
    expect_same(step_dir(ref, long_steps), step_dir(ckpt, long_steps), f"{tag}.signal (stopped at {stopped})")


def case_restart(r, tag="ddp"):
    """ptrun --max-restarts 1 and a crash: SIGKILL rank 1 of 2 once a checkpoint exists (no checkpoint
    at the kill). ptrun starts both ranks again, they resume from the last committed checkpoint and
    end bitwise where case_signal's uninterrupted run ended."""
    ref = os.path.join(r.work, f"{tag}-long-ref")
    ckpt = os.path.join(r.work, f"{tag}-restart")
    args = ["--steps", str(LONG_STEPS), "--checkpoint-dir", ckpt, "--checkpoint-every", str(LONG_EVERY), "--resume"]
    proc = r.start(2, args, restarts=1)
    target = rank_pid(proc.pid, 1)
    wait_first_checkpoint(r, proc, ckpt, f"{tag}.restart")
    os.kill(target, signal.SIGKILL)
    rc, out, err = r.finish(proc, f"{tag} restarted run")
    if rc != 0 or "restart 1 of 1" not in err:
        raise Failure(f"{tag}.restart: exit code {rc}, expected 0 after one restart\n{out}\n{err}")
    marker = f"resumed from {ckpt}/"
    if marker not in out:
        raise Failure(f"{tag}.restart: the restarted ranks did not resume from {ckpt}:\n{out}")
    resumed = int(out.split(marker, 1)[1].split(": step ", 1)[1].split()[0])
    if not LONG_EVERY <= resumed < LONG_STEPS:
        raise Failure(f"{tag}.restart: resumed at step {resumed}")
    expect_same(step_dir(ref, LONG_STEPS), step_dir(ckpt, LONG_STEPS),
                f"{tag}.restart (rank 1 killed, ptrun restarted both, resumed at step {resumed})")


def case_restart_nodes(r, tag="ddp"):
    """The same crash with two ptrun "nodes" of one rank each (--nnodes 2, --max-restarts 1):
    node 1's rank is SIGKILLed; both nodes agree through node 0's agent store, start round 1
    together, resume, and end bitwise where the uninterrupted run ended."""
    ref = os.path.join(r.work, f"{tag}-long-ref")
    ckpt = os.path.join(r.work, f"{tag}-restart-nodes")
    port = str(free_port_pair())
    base = r.argv(1, ["--steps", str(LONG_STEPS), "--checkpoint-dir", ckpt, "--checkpoint-every", str(LONG_EVERY),
                      "--resume"]) + ["--parallel", tag]
    procs = [subprocess.Popen([r.ptrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                               "--master-port", port, "--max-restarts", "1"] + base, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=r.env, start_new_session=True)
             for node in (0, 1)]
    target = rank_pid(procs[1].pid, 1)
    wait_first_checkpoint(r, procs[0], ckpt, f"{tag}.restart-nodes")
    os.kill(target, signal.SIGKILL)
    (rc0, out, err0), (rc1, _, err1) = (r.finish(p, f"{tag} restarted node {i}") for i, p in enumerate(procs))
    if rc0 != 0 or rc1 != 0 or "restart 1 of 1" not in err0 or "restart 1 of 1" not in err1:
        raise Failure(f"{tag}.restart-nodes: exit codes {rc0}, {rc1}, expected 0 after one restart on both nodes\n"
                      f"{out}\n{err0}\n{err1}")
    resumed = int(out.split(f"resumed from {ckpt}/", 1)[1].split(": step ", 1)[1].split()[0])
    expect_same(step_dir(ref, LONG_STEPS), step_dir(ckpt, LONG_STEPS),
                f"{tag}.restart-nodes (node 1's rank killed, both nodes restarted, resumed at step {resumed})")


def case_config(r, ranks, tag, ref, mode=None):
    """--resume with another model shape, or another --heads (same tensor shapes), is refused."""
    before = committed_steps(ref)
    for flag, value, saved in (("--layers", "2", "1"), ("--heads", "4", "2")):
        args = ["--steps", "12", "--checkpoint-dir", ref, "--resume"]
        argv = r.argv(ranks, args, mode)
        i = argv.index(flag)
        argv[i + 1] = value
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=r.env,
                                start_new_session=True)
        rc, out, err = r.finish(proc, f"{tag} resume with {flag} {value}")
        want = f"{flag} {saved} in the checkpoint, {value} now"
        if rc == 0 or "[ptrain.example.config]" not in err or want not in err:
            raise Failure(f"{tag}: resume with {flag} {value}: exit code {rc}, expected != 0 and "
                          f"[ptrain.example.config] naming '{want}'\nstdout:\n{out}\nstderr:\n{err}")
        print(f"ok   {tag}.config: {flag} {value} refused (exit {rc})")
    if committed_steps(ref) != before:
        raise Failure(f"{tag}.config: the refused resumes changed {ref}: {before} -> {committed_steps(ref)}")


def case_bad_flags(r, ref):
    """Bad flags and end-of-run arguments fail at once, before any training, with a short message."""
    before = committed_steps(ref)
    cases = ((["--steps", "abc"], "--steps: abc is not a number"),
             (["--temperature", "-1"], "--temperature: -1 must be >= 0"),
             (["--prompt", "a\u2603", "--sample-tokens", "5"], "[ptrain.data.tokenizer.unknown]"),
             (["--export", os.path.join(r.work, "missing", "x.safetensors")], "[gpt_char.export]"),
             (["--export-hf", os.path.join(r.work, "missing", "hf")], "[gpt_char.export]"),
             (["--parallel", "pipeline", "--batch", "6"], "[gpt_char.micro_batches]"),
             (["--parallel", "pipeline", "--stages", "4"], "[gpt_char.stages]"),
             (["--parallel", "pipeline", "--grad-accum", "2"], "[gpt_char.grad_accum]"))
    for args, want in cases:
        what = f"bad flag {' '.join(args)}"
        t0 = time.time()
        rc, out, err = r.run(1, args + ["--checkpoint-dir", ref, "--resume"], what, expect=None)
        if rc == 0 or want not in err or "step " in out:
            raise Failure(f"{what}: exit code {rc}, expected != 0, '{want}' and no training\n"
                          f"stdout:\n{out}\nstderr:\n{err}")
        print(f"ok   flags: {' '.join(args)} refused in {time.time() - t0:.1f} s")
    if committed_steps(ref) != before:
        raise Failure(f"flags: the refused runs changed {ref}: {before} -> {committed_steps(ref)}")


def expect_close(ref, got, what, tol=TOL):
    rel = max_rel_diff(got, ref)
    if rel > tol:
        raise Failure(f"{what}: model tensors of {got} differ from {ref} by {rel:.3g} relative (> {tol:g})")
    print(f"ok   {what}: model within {rel:.2g} relative of {ref}")


def copy_step(src, step, dst):
    os.makedirs(dst)
    shutil.copytree(step_dir(src, step), step_dir(dst, step))
    return dst


def case_bf16(r):
    """--precision bf16: the checkpoints hold BF16 parameters and F32 optimizer state (moments
    and fp32 master weights), a resume is bitwise, and an fp32 run refuses the checkpoint
    naming --precision."""
    ref, _ = case_copy(r, 1, "bf16", flags=["--precision", "bf16"])
    ck = read_checkpoint(step_dir(ref, 12))
    model = {t[0] for t in ck["model"].values()}
    state = {t[0] for t in ck["optimizer"].values()}
    masters = [n for n in ck["optimizer"] if n.endswith(".master")]
    if model != {"BF16"} or state != {"F32"} or len(masters) != len(ck["model"]):
        raise Failure(f"bf16: model dtypes {model}, optimizer dtypes {state}, {len(masters)} master copies for "
                      f"{len(ck['model'])} parameters")
    print(f"ok   bf16.dtypes: {len(ck['model'])} BF16 parameters, F32 moments and master weights")
    before = committed_steps(ref)
    rc, out, err = r.run(1, ["--steps", "16", "--checkpoint-dir", ref, "--resume"], "bf16 checkpoint resumed in fp32",
                         expect=None)
    want = '--precision "bf16" in the checkpoint, "fp32" now'
    if rc == 0 or "[ptrain.example.config]" not in err or want not in err or committed_steps(ref) != before:
        raise Failure(f"bf16: an fp32 resume of a bf16 checkpoint: exit code {rc}, expected != 0 and "
                      f"[ptrain.example.config] naming '{want}'\nstdout:\n{out}\nstderr:\n{err}")
    print(f"ok   bf16.config: an fp32 run refuses the bf16 checkpoint (exit {rc})")
    if cpu_flags() >= {"avx2", "fma"} and links_openblas(r.exe):
        env = r.env
        r.env = dict(env, OPENBLAS_CORETYPE="Haswell")
        try:
            case_copy(r, 1, "bf16-haswell", flags=["--precision", "bf16"])
        finally:
            r.env = env


def links_openblas(exe):
    """Whether exe uses OpenBLAS (OPENBLAS_CORETYPE means nothing to an Eigen-only build)."""
    try:
        out = subprocess.run(["ldd", exe], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "libopenblas" in out


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def case_fsdp_vs_ddp(r, fsdp_ref, ddp_ref, export):
    """Same flags, same 2 ranks: fsdp's checkpoints are sharded and end where ddp's do."""
    names = sorted(os.listdir(step_dir(fsdp_ref, 12)))
    want = [f"{role}-0000{k}-of-00002.safetensors" for role in ("model", "optimizer") for k in (0, 1)]
    if any(w not in names for w in want) or "model.safetensors" in names:
        raise Failure(f"fsdp: step 12 is not a 2-rank sharded checkpoint: {names}")
    for k in (0, 1):  # each rank saved pieces of parameters, not a copy of the whole model
        part = read_safetensors(os.path.join(step_dir(fsdp_ref, 12), f"model-0000{k}-of-00002.safetensors"))
        if not any("@" in name for name in part):
            raise Failure(f"fsdp: rank {k}'s file holds no pieces: {sorted(part)}")
    scale = max_rel_diff(step_dir(ddp_ref, 8), step_dir(ddp_ref, 12))
    if scale < 100 * TOL:
        raise Failure(f"fsdp.ddp: steps 8 and 12 differ by only {scale:.3g}; the tolerance would not see an error")
    expect_close(step_dir(ddp_ref, 12), step_dir(fsdp_ref, 12), f"fsdp.ddp (steps 8 and 12 differ by {scale:.2g})")
    model = read_checkpoint(step_dir(fsdp_ref, 12))["model"]
    if read_safetensors(export) != model:
        raise Failure(f"fsdp: --export {export} differs from the assembled step-12 checkpoint")
    print(f"ok   fsdp.export: {export} == the step-12 checkpoint's {len(model)} model tensors")


def case_fsdp_cross(r, fsdp_ref, ddp_ref):
    """A ddp checkpoint resumed with fsdp, and an fsdp checkpoint with ddp."""
    for src, mode, other in ((ddp_ref, "fsdp", "ddp"), (fsdp_ref, "ddp", "fsdp")):
        res = copy_step(src, 8, os.path.join(r.work, f"cross-{other}-to-{mode}"))
        _, out, _ = r.run(2, ["--steps", "12", "--checkpoint-dir", res, "--resume"], f"{other} checkpoint resumed "
                          f"with --parallel {mode}", mode=mode)
        if f"--parallel {mode}" not in out or "not the bit-exact continuation" not in out:
            raise Failure(f"fsdp.cross: no note about the changed --parallel:\n{out}")
        expect_close(step_dir(src, 12), step_dir(res, 12), f"fsdp.cross ({other} step 8 -> {mode})")


def case_fsdp_reshape(r):
    """Without dropout a global batch of 8 is one batch of 8 on 1 process, or 4 on each of 2
    ranks (same windows): a 2-rank fsdp checkpoint resumed on 1 process, and on 2 ranks with
    each other strategy, ends where the uninterrupted 2-rank fsdp run does."""
    ref = os.path.join(r.work, "fsdp0-ref")
    r.run(2, ["--steps", "12", "--dropout", "0", "--checkpoint-dir", ref, "--checkpoint-every", "4",
              "--keep-checkpoints", "0"], "fsdp uninterrupted run without dropout", mode="fsdp")
    res = copy_step(ref, 8, os.path.join(r.work, "fsdp0-to-1"))
    _, out, _ = r.run(1, ["--steps", "12", "--dropout", "0", "--batch", "8", "--checkpoint-dir", res, "--resume"],
                      "2-rank fsdp checkpoint resumed by 1 process")
    if "saved on 2 rank(s)" not in out:
        raise Failure(f"fsdp.reshape: the 1-process run did not report a 2-rank checkpoint:\n{out}")
    expect_close(step_dir(ref, 12), step_dir(res, 12), "fsdp.reshape (2 ranks fsdp -> 1 process none)")
    for strategy in ("shard_grad_op", "shard_optimizer", "no_shard", "hybrid"):
        res = copy_step(ref, 8, os.path.join(r.work, f"fsdp0-{strategy}"))
        _, out, _ = r.run(2, ["--steps", "12", "--dropout", "0", "--checkpoint-dir", res, "--resume",
                              "--fsdp-strategy", strategy, "--hybrid-shard-size", "1"],
                          f"fsdp checkpoint resumed with {strategy}", mode="fsdp")
        if f"FSDP({strategy}" not in out:
            raise Failure(f"fsdp.reshape: the run did not report strategy {strategy}:\n{out}")
        expect_close(step_dir(ref, 12), step_dir(res, 12), f"fsdp.reshape (full_shard -> {strategy})")


def case_grad_accum(r):
    """--grad-accum 2 at half the batch takes the same windows per step as one process with
    --batch 8: resumed from that run's step 8 by 1 process (4 x 2), and by 2 ranks (2 x 2 each)
    under ddp, fsdp full_shard (shards accumulate) and shard_optimizer (no_sync), the model and
    the AdamW moments end within TOL of its step 12. No dropout, and no clipping, which would
    hide a wrong gradient scale (AdamW's moments, carried over from step 8, do not)."""
    ref = os.path.join(r.work, "accum-ref")
    flags = ["--dropout", "0", "--grad-clip", "0"]
    r.run(1, ["--steps", "12", "--batch", "8", "--checkpoint-dir", ref, "--checkpoint-every", "4",
              "--keep-checkpoints", "0"] + flags, "accum reference: 1 process, --batch 8")
    for i, (ranks, mode, batch, extra) in enumerate(((1, None, "4", []), (2, "ddp", "2", []), (2, "fsdp", "2", []),
                                                     (2, "fsdp", "2", ["--fsdp-strategy", "shard_optimizer"]))):
        what = " ".join([f"{ranks} x {mode or 'none'}"] + extra + ["--batch", batch, "--grad-accum", "2"])
        res = copy_step(ref, 8, os.path.join(r.work, f"accum-{i}"))
        _, out, _ = r.run(ranks, ["--steps", "12", "--batch", batch, "--grad-accum", "2", "--checkpoint-dir", res,
                                  "--resume"] + flags + extra, what, mode=mode)
        if "--grad-accum 2 (checkpoint: 1)" not in out:
            raise Failure(f"accum: no note about the changed --grad-accum:\n{out}")
        expect_close(step_dir(ref, 12), step_dir(res, 12), f"accum ({what})")
        rel = max_rel_diff(step_dir(res, 12), step_dir(ref, 12), role="optimizer")
        if rel > TOL:
            raise Failure(f"accum ({what}): AdamW moments differ by {rel:.3g} relative (> {TOL:g})")


def case_init_from(r, ref, ref_out):
    """--init-from the step-12 model of single.copy's run, as ptrain wrote it and converted
    here to Hugging Face's GPT-2 layout ("transformer." names, Conv1D weights transposed,
    the mask buffers): a run that trains with lr 0 validates exactly as that run ended."""
    model = read_checkpoint(step_dir(ref, 12))["model"]
    hf = {}
    for name, (dtype, shape, blob) in model.items():
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            n_out, n_in = shape
            vals = struct.unpack(f"<{n_out * n_in}f", blob)
            blob = struct.pack(f"<{n_out * n_in}f", *(vals[o * n_in + i] for i in range(n_in) for o in range(n_out)))
            shape = [n_in, n_out]
        hf["transformer." + name.replace("embed.", "").replace("head.", "")] = (dtype, shape, blob)
    hf["transformer.h.0.attn.bias"] = ("F32", [1], struct.pack("<f", 1.0))
    hf_path = os.path.join(r.work, "hf-gpt2.safetensors")
    write_safetensors(hf_path, hf)
    want = ref_out.split("final val_loss ", 1)[1].split()[0]
    for tag, path in (("ptrain", os.path.join(step_dir(ref, 12), "model.safetensors")), ("hf", hf_path)):
        _, out, _ = r.run(1, ["--steps", "1", "--lr", "0", "--min-lr", "0", "--init-from", path], f"init.{tag}")
        got = out.split("final val_loss ", 1)[1].split()[0] if "final val_loss " in out else None
        if "initialised from" not in out or got != want:
            raise Failure(f"init.{tag}: final val_loss {got}, expected {want} (the run it starts from)\n{out}")
        print(f"ok   init.{tag}: --init-from {os.path.basename(path)} validates as the run it comes from ({want})")
    # A checkpoint to resume wins: the weights file is not read (here it is gone).
    res = copy_step(ref, 8, os.path.join(r.work, "init-resume"))
    _, out, _ = r.run(1, ["--steps", "12", "--checkpoint-dir", res, "--checkpoint-every", "4", "--resume",
                          "--init-from", os.path.join(r.work, "gone.safetensors")], "init.resume")
    if "initialised from" in out:
        raise Failure(f"init.resume: --init-from was loaded although a checkpoint was resumed:\n{out}")
    expect_same(step_dir(ref, 12), step_dir(res, 12), "init.resume (--init-from of a missing file, resumed)")


def case_tokens(r, single_ref, ddp_ref):
    """Token files written here from the corpus's character ids (the tokenizer's ids: its
    distinct bytes in increasing order; the last 10% for validation), as nanoGPT's raw
    uint16 files and as llm.c shards (1024-byte header), train exactly as the text does:
    the 12-step checkpoints equal single.copy's and ddp.copy's references bitwise. Bad token
    data fails before training."""
    text = open(os.path.join(r.work, "corpus.txt"), "rb").read()
    vocab = sorted(set(text))
    ids = [vocab.index(c) for c in text]
    n_val = len(ids) // 10
    d = os.path.join(r.work, "tokens")
    os.makedirs(d)
    def raw(name, toks):
        with open(os.path.join(d, name), "wb") as f:
            f.write(struct.pack(f"<{len(toks)}H", *toks))
    def shard(name, toks, count=None):
        with open(os.path.join(d, name), "wb") as f:
            f.write(struct.pack("<256i", 20240520, 1, len(toks) if count is None else count, *([0] * 253)))
            f.write(struct.pack(f"<{len(toks)}H", *toks))
    raw("train.bin", ids[:-n_val])
    raw("val.bin", ids[-n_val:])
    shard("shard_train_000.bin", ids[:-n_val])
    shard("shard_val_000.bin", ids[-n_val:])
    runs = (("nanogpt", 1, single_ref, ["train.bin"], ["val.bin"]),
            ("llmc", 1, single_ref, ["shard_train_*.bin"], ["shard_val_000.bin"]),
            ("nanogpt.ddp", 2, ddp_ref, ["train.bin"], ["val.bin"]))
    for tag, ranks, ref, train, val in runs:
        res = os.path.join(r.work, f"tokens-{tag}")
        _, out, _ = r.run(ranks, ["--steps", "12", "--checkpoint-dir", res, "--checkpoint-every", "4",
                                  "--train-tokens"] + [os.path.join(d, t) for t in train] +
                          ["--val-tokens"] + [os.path.join(d, v) for v in val] + ["--vocab-size", str(len(vocab))],
                          f"tokens.{tag}")
        if "token files: train" not in out:
            raise Failure(f"tokens.{tag}: the run did not report its token files:\n{out}")
        expect_same(step_dir(ref, 12), step_dir(res, 12), f"tokens.{tag}")
    shard("truncated.bin", ids[:100], count=101)
    bad = ((["--train-tokens", "train.bin", "--val-tokens", "val.bin", "--vocab-size", str(len(vocab) - 1)],
            "[ptrain.data.tokens.range]"),
           (["--train-tokens", "truncated.bin", "--val-tokens", "val.bin", "--vocab-size", str(len(vocab))],
            "[ptrain.data.tokens.size]"),
           (["--train-tokens", "missing_*.bin", "--val-tokens", "val.bin", "--vocab-size", str(len(vocab))],
            "[ptrain.data.tokens.missing]"),
           (["--train-tokens", "train.bin", "--val-tokens", "val.bin"], "requires --vocab-size"))
    for args, want in bad:
        args = [os.path.join(d, a) if a.endswith(".bin") else a for a in args]
        rc, out, err = r.run(1, ["--steps", "12"] + args, f"tokens: {want}", expect=None)
        if rc == 0 or want not in err or "step " in out:
            raise Failure(f"tokens: {' '.join(args)}: exit code {rc}, expected != 0, '{want}' and no training\n"
                          f"stdout:\n{out}\nstderr:\n{err}")
        print(f"ok   tokens: {want} refused (exit {rc})")


def case_fsdp_sample(r, fsdp_ref, fsdp_out, tag="fsdp", flags=()):
    """1 process resumes fsdp's (or another mode's) final checkpoint at its last step: it
    trains no step, and its evaluation and greedy sample equal those the run printed (same
    parameters)."""
    res = copy_step(fsdp_ref, 12, os.path.join(r.work, f"{tag}-sample"))
    _, out, _ = r.run(1, ["--steps", "12", "--checkpoint-dir", res, "--resume"] + SAMPLE + list(flags),
                      f"1 process sampling from {tag}'s checkpoint")
    def tail(text):
        lines = text.splitlines()
        got = [ln for ln in lines if ln.startswith("step 12: val_loss")]
        if "--- sample ---" not in lines:
            raise Failure(f"{tag}.sample: no sample in\n{text}")
        i = lines.index("--- sample ---")
        return got + lines[i:i + 2]
    want, got = tail(fsdp_out), tail(out)
    if len(want) != 3 or want != got:
        raise Failure(f"{tag}.sample: {tag} printed {want}, 1 process from its checkpoint {got}")
    print(f"ok   {tag}.sample: evaluation and greedy sample as in the {tag} run ({want[0]!r})")


def case_pipeline(r, pipe_ref, pipe_out, export):
    """pipe_ref: case_copy's 2-stage pipeline run (dropout 0.1, --export, SAMPLE)."""
    names = sorted(os.listdir(step_dir(pipe_ref, 12)))
    if "model-00000-of-00002.safetensors" not in names or "model-00001-of-00002.safetensors" not in names:
        raise Failure(f"pipeline: step 12 is not a 2-rank stage checkpoint: {names}")
    model = read_checkpoint(step_dir(pipe_ref, 12))["model"]
    if "head.lm_head.weight" not in model:
        raise Failure(f"pipeline: no untied head weight among {sorted(model)}")
    if read_safetensors(export) != model:
        raise Failure(f"pipeline: --export {export} differs from the assembled step-12 checkpoint")
    print(f"ok   pipeline.export: {export} == the step-12 checkpoint's {len(model)} model tensors")
    case_fsdp_sample(r, pipe_ref, pipe_out, tag="pipeline", flags=["--untied"])

    # Without dropout: one --untied process, 2 stages, and ddp --untied on 2 ranks against 2 x 2.
    zero = ["--dropout", "0", "--steps", "12", "--checkpoint-every", "4", "--keep-checkpoints", "0"]
    runs = {}
    for tag, ranks, mode, extra in (("none", 1, "none", ["--untied"]), ("pp2", 2, "pipeline", []),
                                    ("ddp", 2, "ddp", ["--untied"]),
                                    ("pp2x2", 4, "pipeline", ["--stages", "2", "--schedule", "gpipe"])):
        runs[tag] = os.path.join(r.work, f"pipe0-{tag}")
        r.run(ranks, zero + extra + ["--checkpoint-dir", runs[tag]], f"pipeline reference run {tag}", mode=mode)
    expect_close(step_dir(runs["none"], 12), step_dir(runs["pp2"], 12), "pipeline.none (2 stages vs 1 process)")
    expect_close(step_dir(runs["ddp"], 12), step_dir(runs["pp2x2"], 12), "pipeline.ddp (2 x 2 vs ddp on 2 ranks)")
    # Across modes: pipeline -> 1 process, and ddp -> 2 x 2 pipeline (loads stage tensors by name).
    for src, ranks, mode, extra, what in ((runs["pp2"], 1, "none", ["--untied"], "2-stage pipeline -> 1 process"),
                                          (runs["ddp"], 4, "pipeline", ["--stages", "2", "--schedule", "gpipe"],
                                           "ddp -> 2 x 2 pipeline"),
                                          (runs["pp2"], 3, "pipeline", [], "2 stages -> 3 stages")):
        res = copy_step(src, 8, os.path.join(r.work, f"pipe0-cross-{mode}-{ranks}"))
        _, out, _ = r.run(ranks, zero + extra + ["--checkpoint-dir", res, "--resume"], f"pipeline.cross {what}",
                          mode=mode)
        if f"resumed from {step_dir(res, 8)}: step 8" not in out:  # a fresh start would end alike
            raise Failure(f"pipeline.cross ({what}): the run did not resume from step 8:\n{out}")
        expect_close(step_dir(src, 12), step_dir(res, 12), f"pipeline.cross ({what})")

    # A tied checkpoint (1 process) is refused by a pipeline, naming --untied.
    tied = os.path.join(r.work, "pipe-tied")
    r.run(1, ["--steps", "4", "--checkpoint-dir", tied], "tied run for pipeline.config")
    rc, out, err = r.run(2, ["--steps", "8", "--checkpoint-dir", tied, "--resume"], "pipeline resume of a tied "
                         "checkpoint", expect=None, mode="pipeline")
    want = "--untied false in the checkpoint, true now"
    if rc == 0 or "[ptrain.example.config]" not in err or want not in err or committed_steps(tied) != [4]:
        raise Failure(f"pipeline.config: exit code {rc}, expected != 0 and [ptrain.example.config] naming '{want}'"
                      f"\nstdout:\n{out}\nstderr:\n{err}")
    print(f"ok   pipeline.config: a tied checkpoint refused (exit {rc})")


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        return 2
    exe = os.path.abspath(sys.argv[1])
    ptrun = os.path.abspath(sys.argv[2]) if len(sys.argv) == 3 else None
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gpt_char_resume.") as work:
        write_corpus(os.path.join(work, "corpus.txt"))
        r = Runner(exe, ptrun, work)
        try:
            ref, ref_out = case_copy(r, 1, "single")
            case_init_from(r, ref, ref_out)
            case_control(r, 1, "single", ref)
            case_config(r, 1, "single", ref)
            case_bad_flags(r, ref)
            case_signal(r, 1, "single")
            case_bf16(r)
            if ptrun:
                ddp_ref, _ = case_copy(r, 2, "ddp")
                case_tokens(r, ref, ddp_ref)
                case_config(r, 2, "ddp", ddp_ref)
                case_signal(r, 2, "ddp")
                case_restart(r)
                case_restart_nodes(r)
                export = os.path.join(work, "fsdp-export.safetensors")
                fsdp_ref, fsdp_out = case_copy(r, 2, "fsdp", mode="fsdp", extra=["--export", export] + SAMPLE)
                case_fsdp_vs_ddp(r, fsdp_ref, ddp_ref, export)
                case_config(r, 2, "fsdp", fsdp_ref, mode="fsdp")
                case_fsdp_cross(r, fsdp_ref, ddp_ref)
                case_fsdp_reshape(r)
                case_grad_accum(r)
                case_copy(r, 2, "ddp-accum", flags=["--grad-accum", "2"])
                case_fsdp_sample(r, fsdp_ref, fsdp_out)
                case_signal(r, 2, "fsdp", mode="fsdp", long_steps=FSDP_LONG_STEPS)
                export = os.path.join(work, "pipeline-export.safetensors")
                pipe_ref, pipe_out = case_copy(r, 2, "pipeline", mode="pipeline", extra=["--export", export] + SAMPLE)
                case_pipeline(r, pipe_ref, pipe_out, export)
                case_signal(r, 2, "pipeline", mode="pipeline", long_steps=FSDP_LONG_STEPS)
            else:
                print("skip ddp, fsdp and pipeline cases: no ptrun given")
        except (Failure, ValueError) as e:  # ValueError: a safetensors file that does not fit the layout
            print(f"FAIL {e}")
            return 1
    print(f"all cases passed in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
