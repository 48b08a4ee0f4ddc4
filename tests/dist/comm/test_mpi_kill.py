#!/usr/bin/python3
"""SIGKILL of one MPI rank mid all-reduce: the job must end, naming the dead rank.

Runs `mpirun -np 3 ptrain_comm "[.mpi_kill_child]"` (test_failure.cpp): every
rank writes pid<r>.txt into PTRAIN_KILL_OUT, then all ranks run all-reduces;
rank 1 writes victim1.txt and SIGKILLs itself while one is in flight. Checks:

  - the kill happened where the test puts it (victim1.txt, every rank started);
  - mpirun ends the job by itself within LIMIT_S (no hang), with a non-zero
    status, and says that process rank 1 exited on signal 9;
  - no rank is left running afterwards;
  - a survivor that saw the failure itself (rank<r>.txt, as under Gloo) reports
    a ptrain CommError ([ptrain.mpi] ...); one that mpirun stopped first reports
    nothing (Open MPI ends the job when a process dies).

  /usr/bin/python3 tests/dist/comm/test_mpi_kill.py MPIEXEC PTRAIN_COMM
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

RANKS = 3
VICTIM = 1
LIMIT_S = 90


def fail(msg, output=""):
    print(f"FAIL: {msg}")
    if output:
        print("---- mpirun output (last 60 lines)\n" + "\n".join(output.splitlines()[-60:]))
    sys.exit(1)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is gone for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    mpiexec, exe = sys.argv[1], sys.argv[2]
    out = tempfile.mkdtemp(prefix="ptrain-mpi-kill-")
    env = dict(os.environ, PTRAIN_KILL_OUT=out, PTRAIN_BACKEND="mpi")
    cmd = [mpiexec, "--oversubscribe", "-np", str(RANKS), exe, "[.mpi_kill_child]", "--reporter", "compact"]
    print("running:", " ".join(cmd), flush=True)
    try:
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=LIMIT_S)
    except subprocess.TimeoutExpired as e:
        text = e.output.decode(errors="replace") if isinstance(e.output, bytes) else (e.output or "")
        fail(f"mpirun did not end the job within {LIMIT_S} s after rank {VICTIM} was killed", text)
    text = r.stdout
    print(text[-4000:], flush=True)

    pids = {}
    for rank in range(RANKS):
        try:
            pids[rank] = int(open(os.path.join(out, f"pid{rank}.txt")).read())
        except (OSError, ValueError):
            fail(f"rank {rank} did not start the child test (no pid{rank}.txt)", text)
    if not os.path.exists(os.path.join(out, f"victim{VICTIM}.txt")):
        fail(f"rank {VICTIM} did not reach its SIGKILL mid all-reduce (no victim{VICTIM}.txt): the job failed "
             "some other way", text)
    if r.returncode == 0:
        fail("mpirun exited 0 although a rank was killed", text)
    if not re.search(rf"process rank {VICTIM} with PID \d+ on node \S+ exited on signal 9\b", text):
        fail(f"mpirun's output does not say that process rank {VICTIM} exited on signal 9", text)
    # mpirun has returned: every rank must be gone (a moment for the kernel to reap them).
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [rank for rank, p in pids.items() if alive(p)]
    if left:
        for rank in left:
            os.kill(pids[rank], 9)
        fail(f"rank(s) {left} still running after mpirun returned", text)
    for rank in range(RANKS):
        if rank == VICTIM:
            continue
        report = os.path.join(out, f"rank{rank}.txt")
        if os.path.exists(report):
            msg = open(report).read()
            if "[ptrain." not in msg:
                fail(f"rank {rank} reported an error that is not a ptrain CommError: {msg}", text)
            print(f"rank {rank} reported: {msg.strip()}")
        else:
            print(f"rank {rank} was stopped by mpirun before it saw the failure")
    shutil.rmtree(out, ignore_errors=True)
    print(f"ok: mpirun ended the job (status {r.returncode}), naming rank {VICTIM} killed by signal 9; "
          "no rank left running")


if __name__ == "__main__":
    main()
