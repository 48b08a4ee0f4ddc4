#!/usr/bin/python3
"""A checkpoint save that rank 0 refuses is explained in the log under ptrun.

usage: test_refused_save.py GPT_CHAR PTRUN

Two ranks of examples/gpt_char (--parallel ddp) write checkpoints 20 and 40; step 20 is
deleted and the same command runs again without --resume (the forgotten flag), 5 times.
Rank 0 refuses the first save (step 20, older than every committed checkpoint) with
[ptrain.ckpt.newer]; rank 1 fails with "rank 0 failed to save its part of the checkpoint
(its log has the reason)" and exits, and ptrun sends rank 0 SIGTERM while its exception
unwinds. Every time the job must exit non-zero, leave step 40 as it was, and the log must
hold rank 0's [ptrain.ckpt.newer] reason (found in a chaos run: the SIGTERM used to end
rank 0 before it printed, in most runs). Exit 0 on success, 1 on failure.
"""

import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dist", "ckpt"))
from test_gpt_char_resume import TINY, committed_steps, step_dir, write_corpus  # noqa: E402

RUNS = 5


def main():
    gpt_char, ptrun = sys.argv[1], sys.argv[2]
    work = tempfile.mkdtemp(prefix="ptrain-refused-save-")
    try:
        corpus, ckpt = os.path.join(work, "corpus.txt"), os.path.join(work, "ckpt")
        write_corpus(corpus)
        argv = [ptrun, "--standalone", "--nproc-per-node", "2", gpt_char, "--data", corpus] + TINY + [
            "--steps", "40", "--checkpoint-dir", ckpt, "--checkpoint-every", "20", "--parallel", "ddp"]
        env = dict(os.environ, PTRAIN_COMM_TIMEOUT_S="60")
        first = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        if first.returncode != 0 or committed_steps(ckpt) != [20, 40]:
            print(f"FAIL first run: exit {first.returncode}, checkpoints {committed_steps(ckpt)}\n{first.stderr}")
            return 1
        shutil.rmtree(step_dir(ckpt, 20))
        with open(os.path.join(step_dir(ckpt, 40), "model.safetensors"), "rb") as f:
            kept = f.read()
        for i in range(RUNS):
            r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
            with open(os.path.join(step_dir(ckpt, 40), "model.safetensors"), "rb") as f:
                same = f.read() == kept
            if r.returncode == 0 or "[ptrain.ckpt.newer]" not in r.stderr or not same:
                print(f"FAIL run {i + 1} without --resume: exit {r.returncode}, step 40 "
                      f"{'unchanged' if same else 'CHANGED'}, checkpoints {committed_steps(ckpt)}; "
                      f"expected a non-zero exit with rank 0's [ptrain.ckpt.newer] reason in the log:\n{r.stderr}")
                return 1
        print(f"ok   {RUNS} runs without --resume: refused, rank 0's [ptrain.ckpt.newer] reason in the log")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
