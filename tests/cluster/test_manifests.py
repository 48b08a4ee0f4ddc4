#!/usr/bin/python3
"""Checks the cluster examples against what ptrain's runtime relies on.

Parses every manifest in examples/k8s/ (python3-yaml) and the Slurm script in
examples/slurm/, and checks each container's command, the variables it sets,
GPU limits, the /dev/shm volume, the grace period and the checkpoint volume.
Variable names are checked against the names ptrain's C++ sources read
(launch_env.hpp and friends are grepped, so renaming a variable there breaks
this test), and command-line flags against the example's sources.

  /usr/bin/python3 tests/cluster/test_manifests.py [REPO_ROOT]
"""

import re
import shlex
import sys
import unittest
from pathlib import Path

try:
    import yaml
except ImportError:
    print("SKIPPED: python3-yaml is not installed (apt-get install python3-yaml)")
    sys.exit(77)

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]
K8S = ROOT / "examples" / "k8s"
SLURM = ROOT / "examples" / "slurm"
DIST = ROOT / "include" / "ptrain" / "dist"

# Minimum grace period: one training step plus one checkpoint write on a network volume.
MIN_GRACE_S = 60
# A manifest command's program -> the sources that define its flags (the
# examples share their checkpoint flags through examples/checkpoint_flags.hpp).
CHECKPOINT_FLAGS = ROOT / "examples" / "checkpoint_flags.hpp"
PROGRAM_SOURCES = {"fashion_mnist": [ROOT / "examples" / "fashion_mnist.cpp", CHECKPOINT_FLAGS],
                   "gpt_char": [ROOT / "examples" / "gpt_char.cpp", CHECKPOINT_FLAGS],
                   "ptrun": [ROOT / "launcher" / "ptrun.cpp"]}


def program_source(program):
    return "".join(path.read_text() for path in PROGRAM_SOURCES[program])


def quoted_env_names(path):
    """Every "UPPER_CASE" string literal in a C++ source: the variables it can read."""
    return set(re.findall(r'"([A-Z][A-Z0-9]*_[A-Z0-9_]+|RANK|HOSTNAME)"', path.read_text()))


def read_env_names():
    names = set()
    for header in ["launch_env.hpp", "process_group.hpp", "communicator.hpp", "store.hpp", "gloo.hpp"]:
        names |= quoted_env_names(DIST / header)
    return names


LAUNCH_ENV = (DIST / "launch_env.hpp").read_text()
ENV_NAMES = read_env_names()
# Variables that are not ptrain's but that the manifests set for other programs.
FOREIGN_ENV = {"OMP_NUM_THREADS", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}


def load_all(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def flags_of(command):
    """{"--flag": value or None} from an exec-form command (both --f=v and --f v)."""
    flags, i = {}, 1
    while i < len(command):
        arg = str(command[i])
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if eq:
                flags[name] = value
            elif i + 1 < len(command) and not str(command[i + 1]).startswith("-"):
                flags[name] = str(command[i + 1])
                i += 1
            else:
                flags[name] = None
        i += 1
    return flags


def env_map(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


class Manifests(unittest.TestCase):
    """Shared checks on one pod template."""

    def check_env_names(self, container, where):
        for name in env_map(container):
            if name in FOREIGN_ENV:
                continue
            self.assertTrue(name in ENV_NAMES, f"{where}: env {name} is not read by ptrain "
                          f"(not a string in include/ptrain/dist/*.hpp); renamed?")

    def check_flags(self, command, where):
        program = Path(str(command[0])).name
        self.assertIn(program, PROGRAM_SOURCES, f"{where}: unknown program {command[0]}")
        source = program_source(program)
        for flag in flags_of(command):
            self.assertTrue(f'"{flag}' in source, f"{where}: {program} has no option {flag} "
                          f"(not in {', '.join(str(p.relative_to(ROOT)) for p in PROGRAM_SOURCES[program])})")

    def check_training_command(self, command, mounts, where):
        self.check_flags(command, where)
        flags = flags_of(command)
        self.assertEqual(flags.get("--parallel"), "ddp", f"{where}: must train with --parallel ddp")
        self.assertIn("--resume", flags, f"{where}: a restarted pod must resume (--resume)")
        ckpt = flags.get("--checkpoint-dir")
        self.assertTrue(ckpt, f"{where}: needs --checkpoint-dir")
        self.assertTrue(any(ckpt.startswith(m.rstrip("/") + "/") for m in mounts),
                        f"{where}: --checkpoint-dir {ckpt} is not on a mounted volume {sorted(mounts)}")
        self.assertTrue(flags.get("--checkpoint-every", "").isdigit(), f"{where}: needs --checkpoint-every N")

    def check_pod(self, spec, container, where, claims, gpus=1):
        """GPU limits, node selection, /dev/shm, grace period, checkpoint PVC."""
        limits = container.get("resources", {}).get("limits", {})
        self.assertEqual(int(limits.get("nvidia.com/gpu", 0)), gpus, f"{where}: nvidia.com/gpu limit")
        self.assertEqual(spec.get("nodeSelector", {}).get("nvidia.com/gpu.present"), "true",
                         f"{where}: GPU node selector")
        self.assertTrue(any(t.get("key") == "nvidia.com/gpu" and t.get("effect") == "NoSchedule"
                            for t in spec.get("tolerations", [])), f"{where}: toleration for nvidia.com/gpu")
        self.assertGreaterEqual(spec.get("terminationGracePeriodSeconds", 30), MIN_GRACE_S,
                                f"{where}: grace period too short for a checkpoint")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        self.assertIn("/dev/shm", mounts, f"{where}: /dev/shm must be mounted (NCCL)")
        self.assertEqual(volumes[mounts["/dev/shm"]].get("emptyDir", {}).get("medium"), "Memory",
                         f"{where}: /dev/shm must be a memory-backed emptyDir")
        pvc_mounts = {path for path, name in mounts.items() if "persistentVolumeClaim" in volumes[name]}
        self.assertTrue(pvc_mounts, f"{where}: no PersistentVolumeClaim mounted for checkpoints")
        for path in pvc_mounts:
            claim = volumes[mounts[path]]["persistentVolumeClaim"]["claimName"]
            self.assertIn(claim, claims, f"{where}: claim {claim} is not defined in examples/k8s/")
        return pvc_mounts


def all_claims():
    claims = {}
    for path in K8S.glob("*.yaml"):
        for d in load_all(path):
            if d.get("kind") == "PersistentVolumeClaim":
                claims[d["metadata"]["name"]] = d
    return claims


class TestParse(unittest.TestCase):
    def test_every_manifest_parses_with_kind_and_name(self):
        files = sorted(K8S.glob("*.yaml"))
        self.assertGreaterEqual(len(files), 4, "examples/k8s/ must hold the manifests")
        for path in files:
            docs = load_all(path)
            self.assertTrue(docs, f"{path.name} is empty")
            for d in docs:
                self.assertIn("apiVersion", d, path.name)
                self.assertIn("kind", d, path.name)
                self.assertIn("name", d.get("metadata", {}), path.name)

    def test_header_names_found(self):
        # If the grep finds nothing the other tests would pass vacuously.
        for name in ["JOB_COMPLETION_INDEX", "PTRAIN_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                     "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PTRAIN_COMM_TIMEOUT_S"]:
            self.assertTrue(name in ENV_NAMES, f"{name} is no longer read by include/ptrain/dist/*.hpp")


class TestIndexedJob(Manifests):
    def setUp(self):
        docs = load_all(K8S / "indexed-job.yaml")
        self.job = next(d for d in docs if d["kind"] == "Job")
        self.services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        self.spec = self.job["spec"]["template"]["spec"]
        self.container = self.spec["containers"][0]
        self.env = env_map(self.container)

    def test_rank_and_world_size(self):
        spec = self.job["spec"]
        self.assertEqual(spec["completionMode"], "Indexed")
        self.assertEqual(spec["completions"], spec["parallelism"], "every rank must run at once")
        # ptrain's Indexed Job branch reads the index and a world size from the manifest.
        self.assertTrue('r.has("JOB_COMPLETION_INDEX")' in LAUNCH_ENV,
                        "launch_env.hpp no longer detects an Indexed Job by JOB_COMPLETION_INDEX")
        branch = LAUNCH_ENV[LAUNCH_ENV.index('r.has("JOB_COMPLETION_INDEX")'):]
        branch = branch[:branch.index("} else if")]
        self.assertIn('"JOB_COMPLETION_INDEX"', branch)
        self.assertIn("manifest_world", branch)
        world_vars = re.search(r'first_set\(\{"PTRAIN_WORLD_SIZE", "WORLD_SIZE"\}\)', LAUNCH_ENV)
        self.assertIsNotNone(world_vars, "launch_env.hpp no longer reads PTRAIN_WORLD_SIZE/WORLD_SIZE")
        world = [n for n in ("PTRAIN_WORLD_SIZE", "WORLD_SIZE") if n in self.env]
        self.assertTrue(world, "the pod env must set PTRAIN_WORLD_SIZE or WORLD_SIZE")
        self.assertEqual(int(self.env[world[0]]), spec["completions"], f"{world[0]} != completions")
        self.assertNotIn("RANK", self.env, "RANK would take precedence over JOB_COMPLETION_INDEX")

    def test_master_is_pod0_through_headless_service(self):
        sub = self.spec["subdomain"]
        self.assertIn(sub, self.services, "subdomain must name the headless Service in this file")
        svc = self.services[sub]["spec"]
        self.assertEqual(svc["clusterIP"], "None", "the Service must be headless")
        self.assertTrue(svc.get("publishNotReadyAddresses"), "ranks must resolve pod 0 before it is Ready")
        self.assertEqual(svc["selector"], {"job-name": self.job["metadata"]["name"]})
        self.assertEqual(self.env["MASTER_ADDR"], f"{self.job['metadata']['name']}-0.{sub}")
        port = int(self.env["MASTER_PORT"])
        self.assertIn(port, [p["port"] for p in svc["ports"]])
        self.assertIn(port, [p["containerPort"] for p in self.container.get("ports", [])])
        self.assertTrue(0 < int(self.env["PTRAIN_COMM_TIMEOUT_S"]) < self.spec["terminationGracePeriodSeconds"] * 10)

    def test_env_names_are_read_by_ptrain(self):
        self.check_env_names(self.container, "indexed-job")

    def test_pod(self):
        mounts = self.check_pod(self.spec, self.container, "indexed-job", all_claims())
        self.check_training_command(self.container["command"], mounts, "indexed-job")
        self.assertEqual(self.spec["restartPolicy"], "Never", "podFailurePolicy needs restartPolicy Never")

    def test_failure_policy_restarts_preempted_pods(self):
        spec = self.job["spec"]
        rules = spec["podFailurePolicy"]["rules"]
        self.assertTrue(any(r["action"] == "Ignore" and any(c["type"] == "DisruptionTarget"
                                                            for c in r.get("onPodConditions", []))
                            for r in rules), "preemption (DisruptionTarget) must not count as a failure")
        for r in rules:
            if "onExitCodes" in r:
                self.assertEqual(r["onExitCodes"]["containerName"], self.container["name"])
                if r["action"] == "FailJob":
                    # A lost peer exits 1: that must stay retryable.
                    self.assertNotIn(1, r["onExitCodes"]["values"])
        # One lost rank makes every other rank fail too.
        self.assertGreaterEqual(spec["backoffLimit"], spec["completions"] - 1)
        self.assertEqual(spec.get("podReplacementPolicy"), "Failed")


class TestPyTorchJob(Manifests):
    def test_replicas(self):
        job = load_all(K8S / "pytorchjob.yaml")[0]
        self.assertEqual(job["kind"], "PyTorchJob")
        replicas = job["spec"]["pytorchReplicaSpecs"]
        self.assertEqual(replicas["Master"]["replicas"], 1)
        # The operator sets RANK/WORLD_SIZE/MASTER_*; ptrain's first launcher row reads them.
        for name in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]:
            self.assertTrue(name in ENV_NAMES, f"{name} (set by the Training Operator) is no longer read by ptrain")
        for role, rs in replicas.items():
            spec = rs["template"]["spec"]
            container = spec["containers"][0]
            where = f"pytorchjob {role}"
            self.assertEqual(container["name"], "pytorch", f"{where}: the operator needs container 'pytorch'")
            self.assertEqual(rs["restartPolicy"], "OnFailure", where)
            self.check_env_names(container, where)
            mounts = self.check_pod(spec, container, where, all_claims())
            self.check_training_command(container["command"], mounts, where)
        ports = replicas["Master"]["template"]["spec"]["containers"][0]["ports"]
        self.assertIn("pytorchjob-port", [p["name"] for p in ports])


class TestMPIJob(Manifests):
    def test_launcher_and_workers(self):
        job = load_all(K8S / "mpijob.yaml")[0]
        self.assertEqual(job["kind"], "MPIJob")
        self.assertEqual(job["spec"]["mpiImplementation"], "OpenMPI")
        self.assertIn('"OMPI_COMM_WORLD_RANK"', LAUNCH_ENV)
        slots = job["spec"]["slotsPerWorker"]
        specs = job["spec"]["mpiReplicaSpecs"]
        launcher = specs["Launcher"]["template"]["spec"]["containers"][0]
        cmd = [str(c) for c in launcher["command"]]
        self.assertEqual(cmd[0], "mpirun")
        np_ = int(cmd[cmd.index("-np") + 1])
        self.assertEqual(np_, specs["Worker"]["replicas"] * slots, "-np must be workers x slotsPerWorker")
        # Variables forwarded with -x must be set in the launcher and read by ptrain.
        for i, c in enumerate(cmd):
            if c == "-x":
                self.assertIn(cmd[i + 1], env_map(launcher))
                self.assertTrue(cmd[i + 1] in ENV_NAMES, f"mpirun -x {cmd[i + 1]}: not read by ptrain")
        program = next(i for i, c in enumerate(cmd) if Path(c).name in PROGRAM_SOURCES)
        wspec = specs["Worker"]["template"]["spec"]
        worker = wspec["containers"][0]
        mounts = self.check_pod(wspec, worker, "mpijob Worker", all_claims(), gpus=slots)
        self.check_training_command(cmd[program:], mounts, "mpijob launcher")
        self.assertEqual(worker["command"][0], "/usr/sbin/sshd", "workers run sshd for mpirun")


class TestGpuSharing(unittest.TestCase):
    def test_mig_and_time_slicing(self):
        docs = load_all(K8S / "gpu-sharing.yaml")
        cm = next(d for d in docs if d["kind"] == "ConfigMap")
        config = yaml.safe_load(next(iter(cm["data"].values())))
        ts = config["sharing"]["timeSlicing"]["resources"][0]
        self.assertEqual(ts["name"], "nvidia.com/gpu")
        self.assertGreater(ts["replicas"], 1)
        pod = next(d for d in docs if d["kind"] == "Pod")
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        mig = [k for k in limits if k.startswith("nvidia.com/mig-")]
        self.assertEqual(len(mig), 1)
        self.assertRegex(mig[0], r"^nvidia\.com/mig-\d+g\.\d+gb$")


class TestDockerfile(unittest.TestCase):
    def test_builds_what_manifests_run(self):
        text = (K8S / "Dockerfile").read_text()
        self.assertRegex(text, r"(?m)^ARG CUDA_IMAGE=nvidia/cuda:[0-9.]+-devel-(ubuntu|debian)")
        self.assertIn("tools/install-deps.sh", text, "the image must install what developers install")
        self.assertTrue((ROOT / "tools" / "install-deps.sh").exists())
        installed = re.search(r"install -m 0755 (.*?)/usr/local/bin/", text, re.S).group(1).split()
        names = {Path(p).name for p in installed}
        for path in K8S.glob("*.yaml"):
            for d in load_all(path):
                for container in containers_of(d):
                    prog = Path(str(container["command"][0])).name
                    if prog in ("mpirun", "sshd"):
                        continue
                    self.assertIn(prog, names, f"{path.name}: {prog} is not installed in the image")


def containers_of(doc):
    """Every container of a Job, Pod, PyTorchJob or MPIJob."""
    spec = doc.get("spec", {})
    if doc["kind"] == "Pod":
        return spec["containers"]
    if doc["kind"] == "Job":
        return spec["template"]["spec"]["containers"]
    for key in ("pytorchReplicaSpecs", "mpiReplicaSpecs"):
        if key in spec:
            return [c for rs in spec[key].values() for c in rs["template"]["spec"]["containers"]]
    return []


class TestSlurm(unittest.TestCase):
    def test_batch_script(self):
        text = (SLURM / "fashion_mnist.sbatch").read_text()
        sbatch = dict(re.findall(r"(?m)^#SBATCH (--[a-z-]+)=(\S+)", text))
        sig = re.fullmatch(r"B:USR1@(\d+)", sbatch.get("--signal", ""))
        self.assertIsNotNone(sig, "needs #SBATCH --signal=B:USR1@<seconds>")
        self.assertGreaterEqual(int(sig.group(1)), MIN_GRACE_S)
        self.assertIn("--requeue", text)
        self.assertRegex(text, r"trap \w+ USR1")
        self.assertIn("scontrol requeue", text)
        # srun's signal reaches the ranks as SIGTERM, which ptrain's preemption handler catches.
        self.assertIn("--signal=TERM", text)
        preempt = (ROOT / "include" / "ptrain" / "ckpt" / "preemption.hpp").read_text()
        self.assertRegex(preempt, r"PreemptionHandler\(std::vector<int> signals = \{SIGTERM")
        # The srun line's program flags exist.
        srun = re.search(r'(?ms)^srun .*?"\$PROG" (.*?)&$', text).group(1)
        command = ["fashion_mnist"] + shlex.split(srun.replace("\\\n", " "))
        flags = flags_of(command)
        source = program_source("fashion_mnist")
        for flag in flags:
            self.assertTrue(f'"{flag}' in source, f"fashion_mnist has no option {flag}")
        self.assertIn("--resume", flags)
        # Slurm variables ptrain reads for rank, size, local rank.
        for name in ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID"]:
            self.assertTrue(name in ENV_NAMES, f"{name} is no longer read by ptrain")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
