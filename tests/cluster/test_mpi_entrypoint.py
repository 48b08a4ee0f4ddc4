#!/usr/bin/python3
"""examples/k8s/mpi-entrypoint.sh as PID 1 of a "pod": an eviction checkpoints the MPI ranks.

Each case runs a pod's processes in a PID namespace of their own (unshare
--pid --fork --mount-proc: the first process is PID 1 and /proc shows only the
pod, as in a container) and sends SIGTERM to PID 1 from outside, as the
kubelet does on eviction, once the ranks have committed a checkpoint:

  worker    PID 1 is `mpi-entrypoint.sh worker sh -c '...'`; the shell stands
            in for sshd and hosts the ranks (mpirun -np 2 fashion_mnist, as
            orted would under sshd). The ranks must get SIGTERM, commit a
            checkpoint after the signal and exit with --preempt-exit-code (75),
            and PID 1 must exit afterwards.
  control   the same pod with PID 1 a shell that exits on SIGTERM, as sshd
            does: the kernel kills the ranks with the namespace, and no
            checkpoint follows the signal. This is the failure the entrypoint
            exists for, and it shows that the worker case can fail.
  launcher  PID 1 is `mpi-entrypoint.sh launcher mpirun -np 2 fashion_mnist ...`;
            SIGTERM becomes SIGUSR1 for mpirun, which forwards it to the ranks:
            checkpoint after the signal, and PID 1 exits 75, mpirun's status.

Needs root (PID and mount namespaces): exits 77 (skipped) without it. Fails
without util-linux's unshare or Open MPI's mpirun (tools/install-deps.sh --test).

  /usr/bin/python3 tests/cluster/test_mpi_entrypoint.py PATH/TO/fashion_mnist [REPO_ROOT]
"""

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_compare import committed_steps, finish_work, run_main  # noqa: E402

SKIP = 77
PROG = Path(sys.argv[1] if len(sys.argv) > 1 else "build/examples/fashion_mnist").resolve()
ROOT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "examples" / "k8s" / "mpi-entrypoint.sh"
PREEMPT_CODE = 75
LIMIT_S = 120
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", PTRAIN_COMM_TIMEOUT_S="60")


def log(*a):
    print("[mpi-entrypoint]", *a, flush=True)


def mpirun(ckpt):
    return ["mpirun", "-np", "2", "--bind-to", "none", str(PROG), "--parallel=ddp", "--epochs=3", "--batch=64",
            "--hidden=64", "--checkpoint-dir=" + str(ckpt), "--checkpoint-every=50", "--log-every=50",
            f"--preempt-exit-code={PREEMPT_CODE}"]


def pid1(unshare):
    """The host pid of the namespace's PID 1: the child of `unshare --fork`."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise AssertionError("unshare started no PID 1")


def evict(tag, pod_command, work, ckpt, log_path):
    """Starts a pod, SIGTERMs its PID 1 after the first checkpoint; returns (PID 1's status, the step then)."""
    with open(log_path, "w") as out:
        pod = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", *pod_command], env=ENV, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + LIMIT_S
        while not committed_steps(ckpt):
            if time.monotonic() > deadline or pod.poll() is not None:
                raise AssertionError(f"{tag}: no checkpoint while the pod ran:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.02)
        at = committed_steps(ckpt)[-1]
        sent = time.time()
        os.kill(pid1(pod), signal.SIGTERM)
        log(f"{tag}: SIGTERM to PID 1 after checkpoint step {at}")
        try:
            code = pod.wait(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{tag}: PID 1 still running {LIMIT_S} s after SIGTERM:\n"
                                 f"{log_path.read_text()[-3000:]}")
        return code, at, sent
    finally:
        if pod.poll() is None:
            os.killpg(pod.pid, signal.SIGKILL)
            pod.wait()


def checkpointed_after(ckpt, at, sent):
    """Whether a checkpoint was committed after the signal (at the step reached then or later)."""
    last = committed_steps(ckpt)[-1]
    marker = ckpt / f"step-{last:08d}" / "COMMITTED"
    return last >= at and marker.stat().st_mtime >= sent - 0.01, last


def case_worker(work, control=False):
    tag = "control" if control else "worker"
    ckpt = work / f"ckpt-{tag}"
    rc_file = work / f"{tag}.mpirun-rc"
    # The stand-in for sshd: runs the ranks' launch, records its status (also when
    # SIGTERM comes first: the entrypoint stops sshd once the ranks have exited), then idles.
    inner = (f"{shlex.join(mpirun(ckpt))} > {work}/{tag}.mpirun.log 2>&1 & m=$!; "
             f"trap 'wait $m; echo $? > {rc_file}; exit 0' TERM; wait $m; echo $? > {rc_file}; exec sleep 300")
    if control:
        pod = ["sh", "-c", f'trap "exit 143" TERM; sh -c {shlex.quote(inner)} & wait']
    else:
        pod = ["sh", str(ENTRYPOINT), "worker", "sh", "-c", inner]
    code, at, sent = evict(tag, pod, work, ckpt, work / f"{tag}.log")
    after, last = checkpointed_after(ckpt, at, sent)
    ranks_log = (work / f"{tag}.mpirun.log").read_text()
    if control:
        if "signal 15: checkpoint of step" in ranks_log or rc_file.exists():
            raise AssertionError(f"control: the ranks saw SIGTERM and ended by themselves although PID 1 exited "
                                 f"on it; the worker case proves nothing\n{ranks_log[-2000:]}")
        log(f"control: PID 1 exited {code}; the ranks died with the namespace, newest checkpoint still step {last}")
        return
    rc = rc_file.read_text().strip() if rc_file.exists() else "none"
    if not after or rc != str(PREEMPT_CODE) or "signal 15: checkpoint of step" not in ranks_log:
        raise AssertionError(f"worker: expected a checkpoint after SIGTERM and mpirun exit {PREEMPT_CODE}; "
                             f"newest step {last} (signal at {at}), mpirun exit {rc}\n{ranks_log[-3000:]}\n"
                             f"{(work / 'worker.log').read_text()[-2000:]}")
    log(f"worker: ranks checkpointed step {last} after SIGTERM, mpirun exited {rc}, PID 1 exited {code}")


def case_launcher(work):
    ckpt = work / "ckpt-launcher"
    pod = ["sh", str(ENTRYPOINT), "launcher", *mpirun(ckpt)]
    code, at, sent = evict("launcher", pod, work, ckpt, work / "launcher.log")
    after, last = checkpointed_after(ckpt, at, sent)
    text = (work / "launcher.log").read_text()
    if not after or code != PREEMPT_CODE or "signal 10: checkpoint of step" not in text:
        raise AssertionError(f"launcher: expected SIGUSR1 to reach the ranks, a checkpoint after it and exit "
                             f"{PREEMPT_CODE}; newest step {last} (signal at {at}), PID 1 exited {code}\n"
                             f"{text[-3000:]}")
    log(f"launcher: ranks checkpointed step {last} after SIGUSR1, PID 1 exited {code} (mpirun's status)")


def main():
    if os.geteuid() != 0:
        print("SKIPPED: needs root for PID namespaces (unshare --pid)", flush=True)
        sys.exit(SKIP)
    for tool in ("unshare", "mpirun"):
        if shutil.which(tool) is None:
            raise AssertionError(f"{tool} is not installed: run tools/install-deps.sh --test")
    if not PROG.exists():
        raise AssertionError(f"{PROG} is not built")
    work = Path(tempfile.mkdtemp(prefix="ptrain-mpi-entrypoint-"))
    ok = False
    try:
        case_worker(work)
        case_worker(work, control=True)
        case_launcher(work)
        ok = True
    finally:
        finish_work(work, ok, log)
    print("mpi-entrypoint: 3 passed, 0 failed", flush=True)


if __name__ == "__main__":
    run_main(main)
