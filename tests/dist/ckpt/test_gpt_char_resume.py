#!/usr/bin/python3
"""examples/gpt_char resumes exactly from its checkpoints.

usage: test_gpt_char_resume.py GPT_CHAR [PTRUN]

A tiny GPT (1 layer, width 32, dropout 0.1, so the dropout streams matter) trains
on a corpus written here. Each case compares the tensors of a resumed run's final
checkpoint byte for byte with those of an uninterrupted run (model.safetensors and
optimizer.safetensors, read by the parser below, not by ptrain), and trainer.json's
step, data position, dropout offsets and optimizer step count:
  single.copy    resume from the step-8 checkpoint of a 12-step run, to step 12
  single.signal  SIGTERM a longer run once a checkpoint exists: exit code
                 --preempt-exit-code, a committed checkpoint of the step it stopped at,
                 then --resume to the end
  single.control resume with another --seed must NOT match (the comparison can fail)
  config         --resume with --layers 2 / --heads 4 fails with [ptrain.example.config]
                 naming the flag, exit code != 0, within a timeout
  ddp.*          the same with 2 ranks under ptrun (--parallel ddp); the signal goes to
                 rank 1 only, and every rank must stop at the same step
Exit 0 on success, 1 on failure.
"""

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

TIMEOUT_S = 120
PREEMPT_CODE = 75
TINY = ["--layers", "1", "--heads", "2", "--embd", "32", "--block", "32", "--batch", "4", "--dropout", "0.1",
        "--warmup", "3", "--eval-every", "1000000", "--sample-tokens", "0", "--log-every", "0", "--threads", "1"]
LONG_STEPS = 1000  # the signal cases: long enough that the run is still going when the signal comes
LONG_EVERY = 50


class Failure(Exception):
    pass


def write_corpus(path):
    rng = random.Random(6)
    words = ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog.", "A", "cat", "sat", "on",
             "a", "mat,", "and", "then", "it", "slept."]
    with open(path, "w") as f:
        f.write(" ".join(rng.choice(words) for _ in range(4000)) + "\n")


def read_safetensors(path):
    """name -> (dtype, shape, raw bytes), checking the layout independently of ptrain."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise Failure(f"{path}: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise Failure(f"{path}: header length {n} runs past the file ({len(blob)} bytes)")
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    out, end = {}, 0
    sizes = {"F32": 4, "F64": 8, "I32": 4, "I64": 8, "BF16": 2, "F16": 2, "U8": 1}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        lo, hi = e["data_offsets"]
        count = 1
        for d in e["shape"]:
            count *= d
        if hi - lo != count * sizes[e["dtype"]] or hi > len(data):
            raise Failure(f"{path}: tensor {name} has offsets {lo}..{hi} for shape {e['shape']} {e['dtype']}")
        out[name] = (e["dtype"], tuple(e["shape"]), data[lo:hi])
        end = max(end, hi)
    if end != len(data):
        raise Failure(f"{path}: tensors end at {end}, data is {len(data)} bytes")
    return out


def step_dir(ckpt, step):
    return os.path.join(ckpt, f"step-{step:08d}")


def committed_steps(ckpt):
    if not os.path.isdir(ckpt):
        return []
    return sorted(int(d[5:]) for d in os.listdir(ckpt)
                  if d.startswith("step-") and os.path.exists(os.path.join(ckpt, d, "COMMITTED")))


def diff_checkpoints(a, b):
    """First difference between two checkpoint directories, or None when they are identical."""
    for fname in ("model.safetensors", "optimizer.safetensors"):
        ta, tb = read_safetensors(os.path.join(a, fname)), read_safetensors(os.path.join(b, fname))
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
                    n = len(ta[name][2]) // 4
                    xa, xb = struct.unpack(f"<{n}f", ta[name][2]), struct.unpack(f"<{n}f", tb[name][2])
                    worst = max(abs(x - y) for x, y in zip(xa, xb))
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

    def argv(self, ranks, args):
        base = [self.exe, "--data", os.path.join(self.work, "corpus.txt")] + TINY + args
        if ranks == 1:
            return base
        # --standalone: a free store port, so that concurrent tests do not collide on 29500.
        return [self.ptrun, "--standalone", "--nproc-per-node", str(ranks)] + base + ["--parallel", "ddp"]

    def start(self, ranks, args):
        return subprocess.Popen(self.argv(ranks, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=self.env, start_new_session=True)

    def finish(self, proc, what):
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise Failure(f"{what}: no exit within {TIMEOUT_S} s (hang)\n{out}\n{err}")
        return proc.returncode, out, err

    def run(self, ranks, args, what, expect=0):
        rc, out, err = self.finish(self.start(ranks, args), what)
        if expect is not None and rc != expect:
            raise Failure(f"{what}: exit code {rc}, expected {expect}\nstdout:\n{out}\nstderr:\n{err}")
        return rc, out, err


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


def case_copy(r, ranks, tag):
    """Uninterrupted 12 steps (checkpoints 4, 8, 12), then resume from a copy of step 8."""
    ref = os.path.join(r.work, f"{tag}-ref")
    r.run(ranks, ["--steps", "12", "--checkpoint-dir", ref, "--checkpoint-every", "4", "--keep-checkpoints", "0"],
          f"{tag} uninterrupted run")
    if committed_steps(ref) != [4, 8, 12]:
        raise Failure(f"{tag}: expected committed checkpoints 4, 8, 12 in {ref}, found {committed_steps(ref)}")
    if diff_checkpoints(step_dir(ref, 8), step_dir(ref, 12)) is None:
        raise Failure(f"{tag}: steps 8 and 12 are identical: the model does not train")
    for start in (4, 8):
        res = os.path.join(r.work, f"{tag}-from{start}")
        os.makedirs(res)
        shutil.copytree(step_dir(ref, start), step_dir(res, start))
        _, out, _ = r.run(ranks, ["--steps", "12", "--checkpoint-dir", res, "--checkpoint-every", "4", "--resume"],
                          f"{tag} resume from step {start}")
        if f"step {start}" not in out or "resumed from" not in out:
            raise Failure(f"{tag}: the resumed run did not report resuming from step {start}:\n{out}")
        expect_same(step_dir(ref, 12), step_dir(res, 12), f"{tag}.copy (from step {start})")
    return ref


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


def case_signal(r, ranks, tag):
    """SIGTERM (to the only rank, or to rank 1 of 2) once a checkpoint exists; resume; compare."""
    ref = os.path.join(r.work, f"{tag}-long-ref")
    long = ["--steps", str(LONG_STEPS)]
    r.run(ranks, long + ["--checkpoint-dir", ref], f"{tag} uninterrupted {LONG_STEPS}-step run")
    ckpt = os.path.join(r.work, f"{tag}-signal")
    args = long + ["--checkpoint-dir", ckpt, "--checkpoint-every", str(LONG_EVERY), "--preempt-exit-code",
                   str(PREEMPT_CODE), "--resume"]
    proc = r.start(ranks, args)
    target = proc.pid if ranks == 1 else rank_pid(proc.pid, 1)
    deadline = time.time() + TIMEOUT_S
    while not committed_steps(ckpt):
        if proc.poll() is not None or time.time() > deadline:
            _, out, err = r.finish(proc, tag)
            raise Failure(f"{tag}: the run ended (or stalled) before its first checkpoint\n{out}\n{err}")
        time.sleep(0.002)
    os.kill(target, signal.SIGTERM)
    rc, out, err = r.finish(proc, f"{tag} signalled run")
    if rc == 0 and f"step {LONG_STEPS}:" in out:
        raise Failure(f"{tag}: the run finished before SIGTERM arrived; raise LONG_STEPS")
    if rc != PREEMPT_CODE:
        raise Failure(f"{tag}: exit code {rc} after SIGTERM, expected --preempt-exit-code {PREEMPT_CODE}\n"
                      f"{out}\n{err}")
    marker = "signal 15: checkpoint of step "
    if marker not in out:
        raise Failure(f"{tag}: rank 0 did not report the signal checkpoint:\n{out}\n{err}")
    stopped = int(out.split(marker, 1)[1].split()[0])
    if not (LONG_EVERY <= stopped < LONG_STEPS) or committed_steps(ckpt)[-1] != stopped:
        raise Failure(f"{tag}: stopped at step {stopped}, committed {committed_steps(ckpt)}")
    print(f"ok   {tag}.signal: SIGTERM to {'rank 1 of 2' if ranks > 1 else 'the process'} -> exit {rc}, "
          f"checkpoint of step {stopped} committed")
    _, out, _ = r.run(ranks, args, f"{tag} resume after the signal")
    if f"resumed from {step_dir(ckpt, stopped)}: step {stopped}" not in out:
        raise Failure(f"{tag}: the resumed run did not start at step {stopped}:\n{out}")
    expect_same(step_dir(ref, LONG_STEPS), step_dir(ckpt, LONG_STEPS), f"{tag}.signal (stopped at {stopped})")


def case_config(r, ranks, tag, ref):
    """--resume with another model shape, or another --heads (same tensor shapes), is refused."""
    before = committed_steps(ref)
    for flag, value, saved in (("--layers", "2", "1"), ("--heads", "4", "2")):
        args = ["--steps", "12", "--checkpoint-dir", ref, "--resume"]
        argv = r.argv(ranks, args)
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
            ref = case_copy(r, 1, "single")
            case_control(r, 1, "single", ref)
            case_config(r, 1, "single", ref)
            case_signal(r, 1, "single")
            if ptrun:
                ref = case_copy(r, 2, "ddp")
                case_config(r, 2, "ddp", ref)
                case_signal(r, 2, "ddp")
            else:
                print("skip ddp cases: no ptrun given")
        except Failure as e:
            print(f"FAIL {e}")
            return 1
    print(f"all cases passed in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
