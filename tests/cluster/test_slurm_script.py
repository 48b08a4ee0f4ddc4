#!/usr/bin/python3
"""examples/slurm/fashion_mnist.sbatch run for real, with Slurm's commands faked.

No Slurm here, so srun, scancel and scontrol are small shell scripts on PATH:
srun starts SLURM_NTASKS local tasks with the variables srun gives a one-node
step (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS_PER_NODE, ...); scancel
--signal=SIG JOB.0 sends SIG to those tasks; scontrol records its arguments.
The batch script itself, its trap and its srun line run unchanged.

  1. reference: the script runs to the end (exit 0, no requeue);
  2. SIGUSR1 to the batch shell after the first checkpoint (what
     `#SBATCH --signal=B:USR1@120` does): the ranks must checkpoint and exit,
     the script must call `scontrol requeue <job id>` and exit 0;
  3. the requeued run (same job id, SLURM_RESTART_COUNT=1) must resume, finish,
     not requeue, and end with the reference's parameters bit for bit.

  /usr/bin/python3 tests/cluster/test_slurm_script.py PATH/TO/fashion_mnist [REPO_ROOT]
"""

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_compare import committed_steps, compare_final, finish_work, run_main  # noqa: E402

RANKS = 2
RUN_LIMIT_S = 240
PROG = Path(sys.argv[1] if len(sys.argv) > 1 else "build/examples/fashion_mnist").resolve()
ROOT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "fashion_mnist.sbatch"

FAKE_SRUN = r'''#!/bin/bash
# srun for one node: SLURM_NTASKS local tasks; options before the program are ignored.
while [[ "$1" == -* ]]; do shift; done
n=$SLURM_NTASKS
pids=()
for ((i = 0; i < n; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 SLURM_NTASKS_PER_NODE=$n SLURM_TASKS_PER_NODE=$n \
  SLURM_STEP_ID=0 SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST SLURM_STEP_NUM_TASKS=$n "$@" &
  pids+=($!)
done
printf '%s\n' "${pids[@]}" > "$FAKE_SLURM_DIR/step0.pids"
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
'''
FAKE_SCANCEL = r'''#!/bin/bash
# scancel --signal=SIG JOB.STEP: signal the step's tasks, kill nothing else.
echo "scancel $*" >> "$FAKE_SLURM_DIR/calls.log"
sig=${1#--signal=}
kill -s "$sig" $(cat "$FAKE_SLURM_DIR/step0.pids")
'''
FAKE_SCONTROL = r'''#!/bin/bash
echo "scontrol $*" >> "$FAKE_SLURM_DIR/calls.log"
'''


def log(*a):
    print("[slurm]", *a, flush=True)


class Run:
    def __init__(self, work, tag, ckpt, job_id, restart):
        self.out = work / f"{tag}.out"
        env = dict(os.environ)
        for k in list(env):
            if k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_")) or k in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                          "MASTER_PORT", "JOB_COMPLETION_INDEX"):
                del env[k]
        env.update({"PATH": f"{work / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}", "FAKE_SLURM_DIR": str(work),
                    "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS": str(RANKS),
                    "SLURM_NNODES": "1", "SLURM_RESTART_COUNT": str(restart), "PROG": str(PROG),
                    "CKPT_DIR": str(ckpt), "EPOCHS": "2", "CKPT_EVERY": "100", "PTRAIN_COMM_TIMEOUT_S": "30"})
        self.f = open(self.out, "w")
        self.proc = subprocess.Popen(["bash", str(SCRIPT), "--hidden", "64", "--batch", "64"], env=env,
                                     stdout=self.f, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self):
        try:
            return self.proc.wait(timeout=RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            return None

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.f.close()

    def fail(self, msg):
        self.stop()
        print(f"---- {self.out.name}\n" + "\n".join(self.out.read_text().splitlines()[-20:]), flush=True)
        raise AssertionError(msg)


def main():
    if shutil.which("bash") is None:
        raise AssertionError("bash is not on PATH (the batch script is a bash script)")
    if not PROG.exists():
        raise AssertionError(f"{PROG} is not built")
    help_text = subprocess.run([str(PROG), "--help"], capture_output=True, text=True).stdout
    if "--checkpoint-dir" not in help_text or "--resume" not in help_text:
        raise AssertionError(f"{PROG.name} --help lists no --checkpoint-dir/--resume, which the batch script uses")

    work = Path(tempfile.mkdtemp(prefix="ptrain-slurm-"))
    (work / "bin").mkdir()
    for name, text in [("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL)]:
        (work / "bin" / name).write_text(text)
        (work / "bin" / name).chmod(0o755)
    # The store port is 20000 + job id mod 10000: a random id keeps parallel runs apart.
    job_id = random.randrange(100000, 999999)
    runs, ok = [], False
    try:
        ref = Run(work, "reference", work / "ckpt-ref", job_id, 0)
        runs.append(ref)
        code = ref.wait()
        if code != 0:
            ref.fail(f"reference: batch script exited {code}")
        total = committed_steps(work / "ckpt-ref")[-1]
        if "training finished with exit 0" not in ref.out.read_text():
            ref.fail("reference: the script did not report a finished run")
        log(f"reference finished at step {total}")

        ckpt = work / "ckpt"
        (work / "calls.log").unlink(missing_ok=True)
        first = Run(work, "first", ckpt, job_id + 1, 0)
        runs.append(first)
        deadline = time.monotonic() + RUN_LIMIT_S
        while not committed_steps(ckpt):
            if time.monotonic() > deadline or first.proc.poll() is not None:
                first.fail("no checkpoint appeared while the job ran")
            time.sleep(0.02)
        at = committed_steps(ckpt)[-1]
        sent_wall = time.time()
        os.kill(first.proc.pid, signal.SIGUSR1)      # Slurm's B:USR1 goes to the batch shell only
        log(f"SIGUSR1 to the batch shell after checkpoint step {at}")
        code = first.wait()
        calls = (work / "calls.log").read_text() if (work / "calls.log").exists() else ""
        if code != 0:
            first.fail(f"signalled run: batch script exited {code}")
        if f"scancel --signal=TERM {job_id + 1}.0" not in calls:
            first.fail(f"the script did not signal the step: {calls!r}")
        if f"scontrol requeue {job_id + 1}" not in calls:
            first.fail(f"the script did not requeue the job: {calls!r}")
        saved = committed_steps(ckpt)[-1]
        marker = ckpt / f"step-{saved:08d}" / "COMMITTED"
        if not at <= saved < total or marker.stat().st_mtime < sent_wall - 0.01:
            first.fail(f"expected a checkpoint committed after the signal at a step in [{at}, {total}); "
                       f"newest is step {saved}")
        log(f"ranks checkpointed step {saved}, script requeued job {job_id + 1} and exited 0")

        (work / "calls.log").unlink()
        second = Run(work, "requeued", ckpt, job_id + 1, 1)
        runs.append(second)
        code = second.wait()
        if code != 0:
            second.fail(f"requeued run: batch script exited {code}")
        # Equal parameters alone would not show a resume: a run from step 0 ends the same.
        if not re.search(rf"resumed from .*step {saved}\b", second.out.read_text()):
            second.fail(f"the requeued run did not report resuming from step {saved}")
        if (work / "calls.log").exists():
            second.fail(f"the finished run called Slurm again: {(work / 'calls.log').read_text()!r}")
        step, compared = compare_final(work / "ckpt-ref", ckpt)
        log(f"requeued run ended at step {step}; {compared} tensors equal the reference's bit for bit")
        ok = True
    finally:
        for r in runs:
            r.stop()
        finish_work(work, ok, log)
    print("slurm_script: 1 passed, 0 failed", flush=True)


if __name__ == "__main__":
    run_main(main)
