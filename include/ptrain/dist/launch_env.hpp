#pragma once
// Rank discovery: which launcher started this process, and what rank, world
// size, local rank and master address it gave us.
//
// Note [Launcher precedence]
// A process can see the variables of several launchers at once: `srun torchrun`
// gives it SLURM_PROCID (the node) and RANK (the process); `mpirun` inside an
// sbatch script leaves the batch step's SLURM_* in place; a Kubernetes pod that
// runs torchrun still has JOB_COMPLETION_INDEX. The launcher closest to the
// process is the one whose numbers are right, so detection goes from the
// innermost launcher outwards:
//   1. torchrun / ptrun / PyTorchJob  RANK + WORLD_SIZE (PET_NODE_RANK + PET_NNODES)
//   2. Open MPI                       OMPI_COMM_WORLD_RANK + OMPI_COMM_WORLD_SIZE
//   3. MPICH / Hydra / Intel MPI      PMI_RANK + PMI_SIZE
//   4. Slurm                          SLURM_PROCID + SLURM_NTASKS
//   5. Volcano                        VC_TASK_INDEX + a world size from the manifest
//   6. Kubernetes Indexed Job         JOB_COMPLETION_INDEX + a world size from the manifest
//   7. Kubernetes StatefulSet         HOSTNAME "name-<ordinal>" + a world size, in a pod
// The first launcher whose rank variable is set wins; its other variables must
// then be present and consistent, or LaunchError names the variable to fix.
// docs/launching.md is the user-facing version of this list.

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ptrain/core/error.hpp"

namespace ptrain::dist {

/// The launcher whose variables gave this process its rank.
enum class Launcher { None, OpenMPI, MPICH, Slurm, Torchrun, IndexedJob, StatefulSet, Volcano };

/// Looks up one environment variable; std::nullopt when it is not set.
using GetEnv = std::function<std::optional<std::string>(const std::string&)>;

/// Where this process sits in the job, and where the rendezvous store lives.
struct LaunchEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr;  ///< empty when unknown
  int master_port = 0;      ///< 0 when unknown
  Launcher launcher = Launcher::None;
  /// TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent serves its own store at master_addr:master_port.
  bool agent_store = false;
  /// TORCHELASTIC_RESTART_COUNT: how often torchrun restarted the workers (0 otherwise).
  int restart_count = 0;
  /// Field name ("rank", "world_size", "master_addr", ...) -> the variable it came from.
  std::map<std::string, std::string> source;

  /// Human-readable launcher name ("Open MPI", "torchrun", ...).
  std::string launcher_name() const;
  /// Throws LaunchError naming the variables to set when master_addr or master_port is unknown.
  void require_master() const;
};

/// Name of a launcher as docs and error messages spell it.
inline std::string launcher_name(Launcher l) {
  switch (l) {
    case Launcher::None: return "none (single process)";
    case Launcher::OpenMPI: return "Open MPI";
    case Launcher::MPICH: return "MPICH/Hydra";
    case Launcher::Slurm: return "Slurm";
    case Launcher::Torchrun: return "torchrun";
    case Launcher::IndexedJob: return "Kubernetes Indexed Job";
    case Launcher::StatefulSet: return "Kubernetes StatefulSet";
    case Launcher::Volcano: return "Volcano";
  }
  return "unknown";
}

inline std::string LaunchEnv::launcher_name() const { return dist::launcher_name(launcher); }

namespace detail {

// Strict decimal parse of a whole variable: "3" yes; "", "3x", " 3", "0x3" no.
inline std::optional<long long> parse_int(std::string_view s) {
  if (s.empty()) return std::nullopt;
  long long v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

// Reads integer variables and records where each field came from, so that
// every error can name the variable the user has to fix.
class EnvReader {
 public:
  EnvReader(const GetEnv& getenv, LaunchEnv& out) : getenv_(getenv), out_(out) {}

  std::optional<std::string> str(const std::string& name) const {
    auto v = getenv_(name);
    if (v && v->empty()) return std::nullopt;  // an empty variable counts as unset
    return v;
  }
  bool has(const std::string& name) const { return str(name).has_value(); }

  // First of `names` that is set, or nullopt.
  std::optional<std::string> first_set(std::initializer_list<const char*> names) const {
    for (const char* n : names)
      if (has(n)) return std::string(n);
    return std::nullopt;
  }

  // Parses variable `name` into field `field`; `min` is the smallest legal value.
  int read_int(const std::string& field, const std::string& name, long long min, const char* what) {
    std::string raw = *str(name);
    auto v = parse_int(raw);
    PTRAIN_CHECK(v.has_value(), LaunchError, "[ptrain.launch.not_a_number] ", name, "='", raw,
                 "' is not a whole number; ", name, " must hold ", what);
    PTRAIN_CHECK(*v >= min && *v <= 0x7fffffffLL, LaunchError, "[ptrain.launch.out_of_range] ", name, "=",
                 *v, " is out of range; ", name, " must hold ", what, " (>= ", min, ")");
    out_.source[field] = name;
    return static_cast<int>(*v);
  }

  // Like read_int, but the variable must be set; `hint` says how to set it.
  int require_int(const std::string& field, const std::string& name, long long min, const char* what,
                  const std::string& hint) {
    PTRAIN_CHECK(has(name), LaunchError, "[ptrain.launch.missing] ", out_.launcher_name(),
                 " launch detected (", out_.source["rank"], " is set) but ", name, " is not set; ", hint);
    return read_int(field, name, min, what);
  }

 private:
  const GetEnv& getenv_;
  LaunchEnv& out_;
};

// First host of a Slurm host list: "gpu[03-05,9],cpu1" -> "gpu03",
// "node-a,node-b" -> "node-a", "rack[1-2]-n[4-5]" -> "rack1-n4".
inline std::string slurm_first_host(std::string_view list) {
  std::string host;
  int depth = 0;
  bool first_in_bracket = false;
  for (char c : list) {
    if (depth == 0 && c == ',') break;
    if (c == '[') {
      ++depth;
      first_in_bracket = true;
      continue;
    }
    if (c == ']') {
      --depth;
      continue;
    }
    if (depth > 0) {
      // Inside brackets keep only the first number of the first range.
      if (c == ',' || c == '-') first_in_bracket = false;
      if (first_in_bracket) host += c;
      continue;
    }
    host += c;
  }
  return host;
}

// Tasks on node `node` from SLURM_TASKS_PER_NODE ("2(x3),1": nodes 0-2 run 2, node 3 runs 1).
inline std::optional<int> slurm_tasks_on_node(std::string_view spec, int node) {
  int seen = 0;
  std::size_t pos = 0;
  while (pos < spec.size()) {
    std::size_t end = spec.find(',', pos);
    if (end == std::string_view::npos) end = spec.size();
    std::string_view item = spec.substr(pos, end - pos);
    long long count = 0, repeat = 1;
    std::size_t paren = item.find("(x");
    auto c = parse_int(item.substr(0, paren));
    if (!c) return std::nullopt;
    count = *c;
    if (paren != std::string_view::npos) {
      if (item.back() != ')') return std::nullopt;
      auto r = parse_int(item.substr(paren + 2, item.size() - paren - 3));
      if (!r) return std::nullopt;
      repeat = *r;
    }
    if (node < seen + repeat) return static_cast<int>(count);
    seen += static_cast<int>(repeat);
    pos = end + 1;
  }
  return std::nullopt;
}

// A port every rank derives alike from a job id, for launchers that share an id
// but no port: 20000 + id mod 10000, away from torchrun's 29500 default.
inline int port_from_job_id(std::string_view id) {
  std::uint64_t h = 0;
  for (char c : id) h = h * 31 + static_cast<unsigned char>(c);
  if (auto v = parse_int(id); v && *v >= 0) h = static_cast<std::uint64_t>(*v);
  return 20000 + static_cast<int>(h % 10000);
}

// "name-3" -> 3; nullopt without a trailing "-<digits>".
inline std::optional<int> hostname_ordinal(std::string_view host) {
  auto dash = host.rfind('-');
  if (dash == std::string_view::npos || dash + 1 >= host.size()) return std::nullopt;
  auto v = parse_int(host.substr(dash + 1));
  if (!v || *v < 0 || *v > 0x7fffffffLL || host[dash + 1] == '-' || host[dash + 1] == '+') return std::nullopt;
  return static_cast<int>(*v);
}

}  // namespace detail

/// Reads the launch environment through `getenv` (a fake one in tests).
/// Throws LaunchError naming the variable when values are missing or inconsistent.
inline LaunchEnv detect_launch_env(const GetEnv& getenv) {
  LaunchEnv e;
  detail::EnvReader r(getenv, e);
  const char* rank_what = "this process's rank, 0 <= rank < world size";
  const char* size_what = "the number of processes in the job";
  const char* lrank_what = "this process's index on its node, 0 <= local rank < local world size";
  const char* lsize_what = "the number of processes on this node";
  // Kubernetes launchers have no world-size variable of their own; the manifest passes one.
  auto manifest_world = [&](const char* hint) {
    auto name = r.first_set({"PTRAIN_WORLD_SIZE", "WORLD_SIZE"});
    PTRAIN_CHECK(name.has_value(), LaunchError, "[ptrain.launch.missing] ", e.launcher_name(),
                 " launch detected (", e.source["rank"], " is set) but no world size is set; ", hint);
    e.world_size = r.read_int("world_size", *name, 1, size_what);
  };

  if (r.has("RANK") || (r.has("PET_NODE_RANK") && r.has("PET_NNODES"))) {
    e.launcher = Launcher::Torchrun;
    if (r.has("RANK")) {
      e.rank = r.read_int("rank", "RANK", 0, rank_what);
      e.world_size = r.require_int("world_size", "WORLD_SIZE", 1, size_what,
                                   "launch with torchrun/ptrun, or set WORLD_SIZE to the number of processes");
      if (r.has("LOCAL_RANK")) e.local_rank = r.read_int("local_rank", "LOCAL_RANK", 0, lrank_what);
      if (r.has("LOCAL_WORLD_SIZE"))
        e.local_world_size = r.read_int("local_world_size", "LOCAL_WORLD_SIZE", 1, lsize_what);
    } else {
      // A PyTorchJob pod started without torchrun: one process per pod is the
      // only layout the PET_* variables describe without a launcher in the pod.
      if (r.has("PET_NPROC_PER_NODE")) {
        int n = r.read_int("local_world_size", "PET_NPROC_PER_NODE", 1, lsize_what);
        PTRAIN_CHECK(n == 1, LaunchError, "[ptrain.launch.needs_launcher] PET_NPROC_PER_NODE=", n,
                     " asks for ", n, " processes per pod but this process was started directly; start the "
                     "program with `ptrun --no-python prog` or `torchrun --no-python prog` in the pod command");
      }
      e.rank = r.read_int("rank", "PET_NODE_RANK", 0, rank_what);
      e.world_size = r.read_int("world_size", "PET_NNODES", 1, size_what);
    }
    if (auto v = r.str("TORCHELASTIC_USE_AGENT_STORE")) e.agent_store = (*v == "True" || *v == "true" || *v == "1");
    if (r.has("TORCHELASTIC_RESTART_COUNT"))
      e.restart_count = r.read_int("restart_count", "TORCHELASTIC_RESTART_COUNT", 0, "a restart count");
  } else if (r.has("OMPI_COMM_WORLD_RANK")) {
    e.launcher = Launcher::OpenMPI;
    e.rank = r.read_int("rank", "OMPI_COMM_WORLD_RANK", 0, rank_what);
    e.world_size = r.require_int("world_size", "OMPI_COMM_WORLD_SIZE", 1, size_what, "start the job with mpirun");
    if (r.has("OMPI_COMM_WORLD_LOCAL_RANK"))
      e.local_rank = r.read_int("local_rank", "OMPI_COMM_WORLD_LOCAL_RANK", 0, lrank_what);
    if (r.has("OMPI_COMM_WORLD_LOCAL_SIZE"))
      e.local_world_size = r.read_int("local_world_size", "OMPI_COMM_WORLD_LOCAL_SIZE", 1, lsize_what);
  } else if (r.has("PMI_RANK")) {
    e.launcher = Launcher::MPICH;
    e.rank = r.read_int("rank", "PMI_RANK", 0, rank_what);
    e.world_size = r.require_int("world_size", "PMI_SIZE", 1, size_what, "start the job with mpiexec");
    if (r.has("MPI_LOCALRANKID")) e.local_rank = r.read_int("local_rank", "MPI_LOCALRANKID", 0, lrank_what);
    if (r.has("MPI_LOCALNRANKS"))
      e.local_world_size = r.read_int("local_world_size", "MPI_LOCALNRANKS", 1, lsize_what);
  } else if (r.has("SLURM_PROCID")) {
    e.launcher = Launcher::Slurm;
    e.rank = r.read_int("rank", "SLURM_PROCID", 0, rank_what);
    e.world_size = r.require_int("world_size", "SLURM_NTASKS", 1, size_what,
                                 "start the job with srun (or sbatch --ntasks=N) so that Slurm sets it");
    if (r.has("SLURM_LOCALID")) e.local_rank = r.read_int("local_rank", "SLURM_LOCALID", 0, lrank_what);
    if (r.has("SLURM_NTASKS_PER_NODE") && detail::parse_int(*r.str("SLURM_NTASKS_PER_NODE"))) {
      e.local_world_size = r.read_int("local_world_size", "SLURM_NTASKS_PER_NODE", 1, lsize_what);
    } else if (auto spec = r.str("SLURM_TASKS_PER_NODE")) {
      int node = r.has("SLURM_NODEID") ? r.read_int("node_rank", "SLURM_NODEID", 0, "this node's index") : 0;
      auto n = detail::slurm_tasks_on_node(*spec, node);
      PTRAIN_CHECK(n.has_value() && *n >= 1, LaunchError, "[ptrain.launch.not_a_number] SLURM_TASKS_PER_NODE='",
                   *spec, "' does not give a task count for node ", node,
                   "; expected a list like 2(x3),1 (Slurm sets it; do not override it)");
      e.local_world_size = *n;
      e.source["local_world_size"] = "SLURM_TASKS_PER_NODE";
    }
  } else if (r.has("VC_TASK_INDEX")) {
    e.launcher = Launcher::Volcano;
    e.rank = r.read_int("rank", "VC_TASK_INDEX", 0, rank_what);
    manifest_world("set PTRAIN_WORLD_SIZE (or WORLD_SIZE) to the task's replicas in the Volcano Job's env");
  } else if (r.has("JOB_COMPLETION_INDEX")) {
    e.launcher = Launcher::IndexedJob;
    e.rank = r.read_int("rank", "JOB_COMPLETION_INDEX", 0, rank_what);
    manifest_world("set PTRAIN_WORLD_SIZE (or WORLD_SIZE) to spec.completions in the Job's pod template env");
  } else if (r.has("KUBERNETES_SERVICE_HOST") && r.has("HOSTNAME") && r.first_set({"PTRAIN_WORLD_SIZE", "WORLD_SIZE"}) &&
             detail::hostname_ordinal(*r.str("HOSTNAME"))) {
    // Only in a pod and only with a world size: plenty of ordinary hosts are
    // called "ip-10-0-0-1", and those must not turn into rank 1.
    e.launcher = Launcher::StatefulSet;
    e.rank = *detail::hostname_ordinal(*r.str("HOSTNAME"));
    e.source["rank"] = "HOSTNAME";
    manifest_world("set PTRAIN_WORLD_SIZE to the StatefulSet's replicas");
  } else {
    // No launcher. A world size > 1 without any rank variable is a broken
    // manifest, not a single-process run: say so rather than run N rank-0s.
    if (auto name = r.first_set({"PTRAIN_WORLD_SIZE", "WORLD_SIZE"})) {
      int ws = r.read_int("world_size", *name, 1, size_what);
      PTRAIN_CHECK(ws == 1, LaunchError, "[ptrain.launch.no_rank] ", *name, "=", ws,
                   " but no rank variable is set; set RANK (torchrun style), or use a launcher that sets one "
                   "(mpirun, srun, ptrun, an Indexed Job's JOB_COMPLETION_INDEX); see docs/launching.md");
    }
    e.world_size = 1;
  }

  // Consistency: a rank outside the world or a node larger than the job means
  // the variables come from two different launches.
  PTRAIN_CHECK(e.rank < e.world_size, LaunchError, "[ptrain.launch.rank_out_of_range] ", e.source["rank"], "=", e.rank,
               " but ", e.source["world_size"], "=", e.world_size, "; the rank must be smaller than the world size: "
               "set both from the same launch (", e.launcher_name(), ")");
  if (e.source.count("local_world_size")) {
    PTRAIN_CHECK(e.local_world_size <= e.world_size, LaunchError, "[ptrain.launch.local_size] ",
                 e.source["local_world_size"], "=", e.local_world_size, " is larger than ", e.source["world_size"],
                 "=", e.world_size, "; set them from the same launch");
  } else if (e.launcher != Launcher::None && !e.source.count("local_rank")) {
    // Pod-per-rank launchers (Kubernetes, Volcano, PyTorchJob without torchrun) run one process per node.
    e.local_world_size = 1;
  }
  if (e.source.count("local_rank")) {
    PTRAIN_CHECK(e.local_rank < e.local_world_size, LaunchError, "[ptrain.launch.local_rank_out_of_range] ",
                 e.source["local_rank"], "=", e.local_rank, " but the local world size (",
                 e.source.count("local_world_size") ? e.source["local_world_size"] : std::string("not set, so 1"),
                 ") is ", e.local_world_size, "; set both from the same launch");
  }

  // Master address: an explicit MASTER_ADDR always wins; otherwise derive one
  // where the launcher's world says where rank 0 is.
  bool single_node = e.local_world_size == e.world_size && e.source.count("local_world_size");
  if (auto name = r.first_set({"MASTER_ADDR", "PET_MASTER_ADDR"})) {
    e.master_addr = *r.str(*name);
    e.source["master_addr"] = *name;
  } else if (auto nodes = r.first_set({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
             nodes && (e.launcher == Launcher::Slurm || e.launcher == Launcher::OpenMPI ||
                       e.launcher == Launcher::MPICH) && !single_node) {
    // srun places task 0 on the first node of the step; mpirun inside an
    // allocation starts rank 0 on the first node of the job by default.
    e.master_addr = detail::slurm_first_host(*r.str(*nodes));
    e.source["master_addr"] = *nodes;
  } else if (single_node && e.launcher != Launcher::None) {
    e.master_addr = "127.0.0.1";
    e.source["master_addr"] = "(all ranks on one node)";
  }
  if (auto name = r.first_set({"MASTER_PORT", "PET_MASTER_PORT"})) {
    e.master_port = r.read_int("master_port", *name, 1, "a TCP port, 1..65535");
    PTRAIN_CHECK(e.master_port <= 65535, LaunchError, "[ptrain.launch.out_of_range] ", *name, "=", e.master_port,
                 " is not a TCP port; set it to a free port in 1..65535");
  } else if (auto id = r.str("SLURM_JOB_ID"); id && e.launcher == Launcher::Slurm) {
    e.master_port = detail::port_from_job_id(*id);
    e.source["master_port"] = "SLURM_JOB_ID";
  } else if (auto jid = r.str("OMPI_MCA_ess_base_jobid"); jid && e.launcher == Launcher::OpenMPI) {
    e.master_port = detail::port_from_job_id(*jid);
    e.source["master_port"] = "OMPI_MCA_ess_base_jobid";
  }
  return e;
}

/// Reads the launch environment of this process.
inline LaunchEnv detect_launch_env() {
  return detect_launch_env([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  });
}

inline void LaunchEnv::require_master() const {
  std::string hint;
  switch (launcher) {
    case Launcher::Slurm:
      hint = "Slurm gives it from SLURM_JOB_NODELIST/SLURM_JOB_ID when they are set; otherwise export MASTER_ADDR="
             "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) and MASTER_PORT=<free port>";
      break;
    case Launcher::OpenMPI:
    case Launcher::MPICH:
      hint = "mpirun does not say where rank 0 runs across nodes; pass -x MASTER_ADDR=<rank 0's host> "
             "-x MASTER_PORT=<free port> (Open MPI) or -genv MASTER_ADDR ... (MPICH)";
      break;
    case Launcher::IndexedJob:
    case Launcher::StatefulSet:
    case Launcher::Volcano:
      hint = "add MASTER_ADDR=<pod 0's DNS name, e.g. name-0.service> and MASTER_PORT=<port> to the pod template env";
      break;
    default:
      hint = "set MASTER_ADDR to rank 0's host and MASTER_PORT to a free TCP port (ptrun and torchrun set both)";
  }
  PTRAIN_CHECK(!master_addr.empty(), LaunchError, "[ptrain.launch.no_master] the rendezvous store needs rank 0's "
               "address but MASTER_ADDR is not set (launcher: ", launcher_name(), "); ", hint);
  PTRAIN_CHECK(master_port > 0 && master_port <= 65535, LaunchError, "[ptrain.launch.no_master] the rendezvous "
               "store needs a port but MASTER_PORT is not set (launcher: ", launcher_name(), "); ", hint);
}

}  // namespace ptrain::dist
