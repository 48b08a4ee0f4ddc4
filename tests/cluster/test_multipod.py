#!/usr/bin/python3
"""Pods on one machine: examples/k8s/indexed-job.yaml run for real in network namespaces.

Each "pod" is a network namespace with its own address (10.233.0.k/24) on a
bridge that lives in one more namespace, so nothing is added to the host's
network and no packet leaves this machine. Inside a pod the rank sees what
Kubernetes would give it: the container env of indexed-job.yaml (variables
from a Secret get a random token, as secret.yaml's command makes one),
JOB_COMPLETION_INDEX, the pod hostname <job>-<k> (own UTS namespace), and an
/etc/hosts in which <job>-<k>.<service> resolves to pod k (what the headless
Service's DNS does). No mpirun, no ptrun.

  1. reference: all pods train to the end, uninterrupted; meanwhile an
     intruder (the same pod with another token, as another tenant's pod would
     have) must be refused by the store with [ptrain.store.auth];
  2. crash: the same run again; once a checkpoint is committed, SIGKILL pod 1;
     every other pod must exit non-zero with a [ptrain.*] error within
     PTRAIN_COMM_TIMEOUT_S (+ slack). Then restart every pod with the
     manifest's --resume; the run must finish and its final checkpoint's model
     and optimizer tensors must equal the reference's bit for bit;
  3. freeze: SIGSTOP pod 1 (a node that vanishes: its sockets stay open), and
     the others must fail with a timeout error within PTRAIN_COMM_TIMEOUT_S;
  4. evict: SIGTERM pod 1 (what the kubelet sends); every pod must checkpoint
     at the same step and exit 0, and the resumed run must again equal the
     reference bit for bit;
  5. elastic: three pods run the program under `ptrun --nnodes 1:3` (c10d
     rendezvous at pod 0's name); pod 2 is killed mid-run, the job goes on with
     two pods, pod 2 comes back and the job grows to three; every pod ends with
     0, the rounds run on 3, 2 and 3 pods, and no round starts more than
     --checkpoint-every steps behind where the previous one got (the metrics).
     (tests/dist/runtime/test_launchers.py runs the same on loopback and also
     compares the end with a run resumed from the last round's checkpoint.)

Needs root (ip netns add, unshare --uts): exits 77 (skipped) without root or
where `ip netns add` is not permitted. Fails without iproute2 (tools/install-deps.sh
--test) or when the example has no --checkpoint-dir/--resume.

  /usr/bin/python3 tests/cluster/test_multipod.py PATH/TO/fashion_mnist [REPO_ROOT [PATH/TO/ptrun]]
"""

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_compare import committed_steps, compare_final, finish_work, run_main  # noqa: E402

SKIP = 77
PODS = 4                             # replaced by the manifest's completions
SUBNET = "10.233.0"                  # private test range, exists only inside the namespaces
COMM_TIMEOUT_S = 20                  # PTRAIN_COMM_TIMEOUT_S for the test (the manifest's is for clusters)
RDZV_TIMEOUT_S = 60                  # PTRAIN_RDZV_TIMEOUT_S likewise: the pods here start within seconds
SLACK_S = 25                         # process exit, store retries and loading data on 2 busy cores
RUN_LIMIT_S = 240                    # one whole training run must end within this
# A short run: a small model and 2 epochs so that SIGKILL lands mid-run after a checkpoint.
TRAIN_OVERRIDES = {"--epochs": "2", "--batch": "64", "--hidden": "64", "--checkpoint-every": "100",
                   "--log-every": "100"}

PROG = Path(sys.argv[1] if len(sys.argv) > 1 else "build/examples/fashion_mnist").resolve()
ROOT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parents[2]
PTRUN = Path(sys.argv[3]).resolve() if len(sys.argv) > 3 else None
PREFIX = f"ptc{os.getpid() % 100000}"   # namespace names carry our pid (stale ones are removed by pid)


def log(*a):
    print("[multipod]", *a, flush=True)


def skip(msg):
    print(f"SKIPPED: {msg}", flush=True)
    sys.exit(SKIP)


def run(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


# ---------------------------------------------------------------- the manifest

def load_pod_spec():
    import yaml
    docs = [d for d in yaml.safe_load_all((ROOT / "examples/k8s/indexed-job.yaml").read_text()) if d]
    job = next(d for d in docs if d["kind"] == "Job")
    tmpl = job["spec"]["template"]["spec"]
    c = tmpl["containers"][0]
    # Secrets of examples/k8s (secret.yaml): each key gets 32 random bytes as hex, as
    # the command in secret.yaml's header makes them; the kubelet puts the value in the env.
    secret_values = {(d["metadata"]["name"], key): secrets.token_hex(32)
                     for path in (ROOT / "examples/k8s").glob("*.yaml") for d in yaml.safe_load_all(path.read_text())
                     if d and d["kind"] == "Secret" for key in d.get("stringData", {})}
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            if (ref["name"], ref["key"]) not in secret_values:
                raise AssertionError(f"env {e['name']}: no Secret {ref['name']} with key {ref['key']} in examples/k8s")
            env[e["name"]] = secret_values[(ref["name"], ref["key"])]
    return {"job": job["metadata"]["name"], "subdomain": tmpl["subdomain"], "env": env,
            "command": [str(x) for x in c["command"]], "completions": job["spec"]["completions"]}


def pod_command(spec, ckpt_dir, metrics):
    """The manifest's command with this machine's paths and a short run."""
    args, seen = [str(PROG)], set()
    for arg in spec["command"][1:]:
        name, eq, value = arg.partition("=")
        if name == "--checkpoint-dir":
            value = str(ckpt_dir)
        elif name == "--metrics":
            value = str(metrics)
        elif name in TRAIN_OVERRIDES:
            value = TRAIN_OVERRIDES[name]
        seen.add(name)
        args.append(f"{name}={value}" if eq else arg)
    args += [f"{k}={v}" for k, v in TRAIN_OVERRIDES.items() if k not in seen]
    return args


# ---------------------------------------------------------------- namespaces

def ns_names():
    return [f"{PREFIX}-{k}" for k in range(PODS)], f"{PREFIX}-br"


def cleanup_namespaces(prefix):
    out = run("ip", "netns", "list", check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(prefix):
            continue
        for pid in run("ip", "netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        run("ip", "netns", "del", name, check=False)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def cleanup_stale():
    """Namespaces of earlier runs that were killed before their cleanup (their pid is gone)."""
    out = run("ip", "netns", "list", check=False).stdout
    for m in set(re.findall(r"^ptc(\d+)-", out, re.M)):
        if m != str(os.getpid() % 100000) and not Path(f"/proc/{m}").exists():
            cleanup_namespaces(f"ptc{m}-")


def setup_network(spec):
    pods, bridge = ns_names()
    run("ip", "netns", "add", bridge)
    run("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
    run("ip", "-n", bridge, "link", "set", "br0", "up")
    hosts = "127.0.0.1 localhost\n" + "".join(
        f"{SUBNET}.{k + 1} {spec['job']}-{k}.{spec['subdomain']} {spec['job']}-{k}\n" for k in range(PODS))
    for k, ns in enumerate(pods):
        run("ip", "netns", "add", ns)
        # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: the pod's DNS.
        Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
        Path(f"/etc/netns/{ns}/hosts").write_text(hosts)
        run("ip", "-n", bridge, "link", "add", f"v{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        run("ip", "-n", bridge, "link", "set", f"v{k}", "master", "br0", "up")
        run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{k + 1}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")
        run("ip", "-n", ns, "link", "set", "lo", "up")
    return pods


# ---------------------------------------------------------------- pods

class Pod:
    def __init__(self, k, ns, spec, args, logdir, tag):
        self.k = k
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
               # What the kubelet adds to every container of the pod:
               "HOSTNAME": f"{spec['job']}-{k}", "KUBERNETES_SERVICE_HOST": "10.96.0.1",
               "KUBERNETES_SERVICE_PORT": "443", "JOB_COMPLETION_INDEX": str(k)}
        env.update(spec["env"])
        env["PTRAIN_COMM_TIMEOUT_S"] = str(COMM_TIMEOUT_S)
        if "PTRAIN_RDZV_TIMEOUT_S" in env:
            env["PTRAIN_RDZV_TIMEOUT_S"] = str(RDZV_TIMEOUT_S)
        self.log_path = logdir / f"{tag}-pod{k}.log"
        self.log = open(self.log_path, "w")
        # ip netns exec -> new UTS namespace -> set the pod hostname -> exec the rank.
        cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
               env["HOSTNAME"], *args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, deadline):
        try:
            return self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.log.close()

    def text(self):
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")


def start_pods(pods_ns, spec, args, logdir, tag):
    return [Pod(k, ns, spec, args, logdir, tag) for k, ns in enumerate(pods_ns)]


def run_to_end(pods_ns, spec, args, logdir, tag):
    pods = start_pods(pods_ns, spec, args, logdir, tag)
    deadline = time.monotonic() + RUN_LIMIT_S
    codes = [p.wait(deadline) for p in pods]
    for p in pods:
        p.kill()
    for p, c in zip(pods, codes):
        if c != 0:
            fail(f"{tag}: pod {p.k} exited with {c} (None = still running after {RUN_LIMIT_S} s)", pods)
    return pods


def fail(msg, pods=()):
    for p in pods:
        print(f"---- {p.log_path.name} (last 15 lines)", flush=True)
        print("\n".join(p.text().splitlines()[-15:]), flush=True)
    raise AssertionError(msg)


# ---------------------------------------------------------------- interruptions

def preempt_code(args):
    """The exit status the manifest asks for after a signal-triggered checkpoint (default 0)."""
    for a in args:
        if a.startswith("--preempt-exit-code="):
            return int(a.split("=", 1)[1])
    return 0


def interrupt(pods_ns, spec, args, logdir, ckpt, total, tag, sig, expect_exit, timeout_error=False):
    """Starts all pods, sends `sig` to pod 1 after the first checkpoint, checks how the others end."""
    pods = start_pods(pods_ns, spec, args, logdir, tag)
    try:
        deadline = time.monotonic() + RUN_LIMIT_S
        while not committed_steps(ckpt):
            if time.monotonic() > deadline or any(p.proc.poll() is not None for p in pods):
                fail(f"{tag}: no checkpoint appeared while every pod was running", pods)
            time.sleep(0.02)
        victim = pods[1]
        at = committed_steps(ckpt)[-1]
        if at >= total or victim.proc.poll() is not None:
            fail(f"{tag}: the run reached its last step ({at} of {total}) before the signal; make it longer", pods)
        sent_wall = time.time()
        os.killpg(victim.proc.pid, sig)
        sent = time.monotonic()
        log(f"{tag}: {signal.Signals(sig).name} to pod 1 after checkpoint step {at} of {total}")
        limit = sent + COMM_TIMEOUT_S + SLACK_S
        for p in pods:
            if p is victim and sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            code = p.wait(limit)
            took = time.monotonic() - sent
            if code is None:
                fail(f"{tag}: pod {p.k} still running {took:.0f} s after pod 1 got {signal.Signals(sig).name} "
                     f"(PTRAIN_COMM_TIMEOUT_S={COMM_TIMEOUT_S})", pods)
            if expect_exit:
                if code != preempt_code(args):
                    fail(f"{tag}: pod {p.k} exited {code}; a preempted job must checkpoint and exit "
                         f"{preempt_code(args)} (--preempt-exit-code)", pods)
                continue
            if code == 0:
                fail(f"{tag}: pod {p.k} exited 0 although pod 1 died mid-run", pods)
            err = re.findall(r"\[ptrain\.[a-z_.]+\][^\n]*", p.text())
            if not err:
                fail(f"{tag}: pod {p.k} exited {code} without a [ptrain.*] error message", pods)
            if timeout_error and not re.search(r"time(d)? ?out", err[0] + p.text(), re.I):
                fail(f"{tag}: pod {p.k}'s error does not say that it timed out: {err[0]}", pods)
            log(f"{tag}: pod {p.k} exited {code} after {took:.1f} s: {err[0][:150]}")
        if expect_exit:
            # The preemption checkpoint is the step the ranks agreed on (it may be the
            # step just saved when the signal came at that boundary): committed after the signal.
            last = committed_steps(ckpt)[-1]
            marker = ckpt / f"step-{last:08d}" / "COMMITTED"
            if last < at or last >= total or marker.stat().st_mtime < sent_wall - 0.01:
                fail(f"{tag}: expected a checkpoint committed after the signal, at a step in [{at}, {total}); "
                     f"newest is step {last}", pods)
            log(f"{tag}: every pod exited {preempt_code(args)} after a checkpoint at step {last}")
    finally:
        for p in pods:
            p.kill()


def resume_and_compare(pods_ns, spec, args, logdir, ref_dir, ckpt, tag):
    """Restarts every pod with the manifest's --resume; the end must equal the reference."""
    newest = committed_steps(ckpt)[-1]
    log(f"{tag}: restarting all pods (newest checkpoint: step {newest})")
    pods = run_to_end(pods_ns, spec, args, logdir, f"{tag}-resumed")
    # Equal parameters alone would not show a resume: a run from step 0 ends the same.
    if not re.search(rf"resumed from .*step {newest}\b", pods[0].text()):
        fail(f"{tag}: rank 0 did not report resuming from step {newest}", pods)
    step, compared = compare_final(ref_dir, ckpt)
    log(f"{tag}: resumed run ended at step {step}; {compared} model/optimizer tensors equal the "
        f"reference's bit for bit")
    return pods


def elastic(pods_ns, spec, work):
    """Case 5: three pods under elastic ptrun; pod 2 is lost and comes back."""
    ckpt, metrics, every = work / "ckpt-elastic", work / "elastic.jsonl", 20
    args = [str(PTRUN), "--nnodes", "1:3", "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{spec['job']}-0.{spec['subdomain']}:29400", "--rdzv-conf",
            "last_call_timeout=2,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=5"]
    args += [a for a in pod_command(spec, ckpt, metrics)
             if not a.startswith(("--checkpoint-every=", "--log-every="))]
    args += [f"--checkpoint-every={every}", "--log-every=1"]
    log("elastic run:", " ".join(args))
    pods = [Pod(k, ns, spec, args, work, "elastic") for k, ns in enumerate(pods_ns)]
    try:
        def newest():
            s = committed_steps(ckpt)
            return s[-1] if s else 0
        deadline = time.monotonic() + RUN_LIMIT_S
        while newest() < 2 * every and time.monotonic() < deadline:
            time.sleep(0.05)
        lost_at = newest()
        pods[2].kill()                   # pod 2's node is gone: ptrun and its rank
        while newest() < lost_at + 3 * every // 2 and time.monotonic() < deadline:
            time.sleep(0.05)             # two pods go on
        if newest() < lost_at + 3 * every // 2:
            fail(f"elastic: no progress after pod 2 was lost (newest checkpoint {newest()})", pods)
        pods[2] = Pod(2, pods_ns[2], spec, args, work, "elastic-back")
        codes = [p.wait(time.monotonic() + RUN_LIMIT_S) for p in pods]
        if codes != [0, 0, 0]:
            fail(f"elastic: the pods exited with {codes} (None: still running)", pods)
        sizes = [int(n) for n in re.findall(r"ptrun: round \d+ on (\d+) node", pods[0].text())]
        if len(sizes) < 3 or sizes[0] != 3 or 2 not in sizes or sizes[-1] != 3:
            fail(f"elastic: the rounds ran on {sizes} pods, expected 3, then 2, then 3", pods)
        recs = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
        batch = int(TRAIN_OVERRIDES["--batch"])
        done = [r["step"] * batch * r["world_size"] for r in recs]
        lost = max([(prev - (cur - batch * r["world_size"])) / (batch * q["world_size"])
                    for prev, cur, r, q in zip(done, done[1:], recs[1:], recs) if cur <= prev], default=0)
        if lost > every:
            fail(f"elastic: a round started {lost} steps behind, more than --checkpoint-every {every}", pods)
        log(f"elastic: rounds on {sizes} pods, at most {lost:g} steps redone, final step {newest()}")
    finally:
        for p in pods:
            p.kill()


# ---------------------------------------------------------------- the test

def main():
    if os.geteuid() != 0:
        skip("needs root to create network namespaces (run ctest as root, e.g. in CI's container)")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        raise AssertionError("needs iproute2 (ip) and util-linux (unshare): run tools/install-deps.sh --test")
    if not PROG.exists():
        raise AssertionError(f"{PROG} is not built (cmake --build <build dir> --target fashion_mnist)")
    help_text = run(str(PROG), "--help", check=False).stdout
    if "--checkpoint-dir" not in help_text or "--resume" not in help_text:
        raise AssertionError(f"{PROG.name} --help lists no --checkpoint-dir/--resume, which the pods use")
    probe = f"{PREFIX}-probe"
    if run("ip", "netns", "add", probe, check=False).returncode != 0:
        skip("`ip netns add` is not permitted here (needs CAP_SYS_ADMIN and a writable /run/netns)")
    run("ip", "netns", "del", probe, check=False)

    global PODS
    spec = load_pod_spec()
    PODS = spec["completions"]          # as many pods as the Job has, with its WORLD_SIZE unchanged
    if not 2 <= PODS <= 16:
        raise AssertionError(f"the manifest's completions ({PODS}) is not a size this test can run")

    cleanup_stale()
    work = Path(tempfile.mkdtemp(prefix="ptrain-multipod-"))
    pods = []

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ok = False
    try:
        pods_ns = setup_network(spec)
        log(f"{PODS} pods in namespaces {pods_ns[0]}..{pods_ns[-1]}, {SUBNET}.1-{PODS}/24, "
            f"MASTER_ADDR={spec['env']['MASTER_ADDR']}")

        # 1. reference
        ref_dir = work / "ckpt-reference"
        args = pod_command(spec, ref_dir, work / "reference.jsonl")
        log("reference run:", " ".join(args))
        if "PTRAIN_STORE_TOKEN" not in spec["env"]:
            raise AssertionError("indexed-job.yaml sets no PTRAIN_STORE_TOKEN: any pod could join the job")
        # Another tenant's pod in the job's network, as rank 1, with a token of its own.
        intruder_spec = dict(spec, env=dict(spec["env"], PTRAIN_STORE_TOKEN=secrets.token_hex(32)))
        intruder = Pod(1, pods_ns[1], intruder_spec, pod_command(spec, work / "ckpt-intruder", work / "intruder.jsonl"),
                       work, "intruder")
        t0 = time.monotonic()
        pods = run_to_end(pods_ns, spec, args, work, "reference")
        ref_s = time.monotonic() - t0
        code = intruder.wait(time.monotonic() + COMM_TIMEOUT_S + SLACK_S)
        intruder.kill()
        if code in (0, None) or "[ptrain.store.auth]" not in intruder.text():
            fail(f"the intruder with another token exited {code} without [ptrain.store.auth]", [intruder])
        refusal = re.search(r"\[ptrain\.store\.auth\][^\n]*", intruder.text()).group(0)
        log(f"intruder with another token refused: exit {code}, {refusal[:120]}")
        total = committed_steps(ref_dir)[-1] if committed_steps(ref_dir) else 0
        log(f"reference finished in {ref_s:.1f} s, checkpoints at {committed_steps(ref_dir)}")
        if f"{PODS} rank(s) (gloo)" not in pods[0].text():
            fail(f"rank 0 did not report {PODS} ranks on the Gloo backend", pods)

        # 2. a pod crashes (SIGKILL: the kernel closes its sockets, peers see a reset)
        crash_dir = work / "ckpt-crash"
        args = pod_command(spec, crash_dir, work / "crash.jsonl")
        interrupt(pods_ns, spec, args, work, crash_dir, total, "crash", signal.SIGKILL, expect_exit=False)
        resume_and_compare(pods_ns, spec, args, work, ref_dir, crash_dir, "crash")

        # 3. a pod's node vanishes (SIGSTOP: its sockets stay open, nobody is told):
        # only the timeout can turn this into an error on the other pods.
        args = pod_command(spec, work / "ckpt-freeze", work / "freeze.jsonl")
        interrupt(pods_ns, spec, args, work, work / "ckpt-freeze", total, "freeze", signal.SIGSTOP,
                  expect_exit=False, timeout_error=True)

        # 4. a pod is evicted (SIGTERM, as the kubelet sends it): every pod saves a
        # checkpoint at the same step and exits 0, then all restart and resume.
        evict_dir = work / "ckpt-evict"
        args = pod_command(spec, evict_dir, work / "evict.jsonl")
        interrupt(pods_ns, spec, args, work, evict_dir, total, "evict", signal.SIGTERM, expect_exit=True)
        resume_and_compare(pods_ns, spec, args, work, ref_dir, evict_dir, "evict")

        # 5. elastic membership under ptrun
        if PTRUN is None:
            raise AssertionError("no ptrun given (third argument): the elastic case cannot run")
        elastic(pods_ns[:3], spec, work)
        ok = True
    finally:
        for p in pods:
            p.kill()
        cleanup_namespaces(PREFIX + "-")
        try:
            Path("/etc/netns").rmdir()      # only when no other namespace config is left
        except OSError:
            pass
        finish_work(work, ok, log)
    print("multipod: 1 passed, 0 failed", flush=True)


if __name__ == "__main__":
    run_main(main)
