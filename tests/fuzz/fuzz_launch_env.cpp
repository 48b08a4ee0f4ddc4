// libFuzzer target: the launch-environment parsers (dist/launch_env.hpp). The
// input is split at NUL bytes into values for the variables a launcher sets
// (Slurm's host list and tasks per node, hostnames with an ordinal, ports, ranks),
// then detect_launch_env() reads them. Invariants: a LaunchError, or a result
// whose rank, local rank and sizes are consistent; the helpers never read out of
// bounds (ASan) and agree with their definitions.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <ptrain/dist/launch_env.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ptrain::dist;
  std::vector<std::string> parts(1);
  for (std::size_t i = 0; i < size; ++i) {
    if (data[i] == 0) parts.emplace_back();
    else parts.back() += static_cast<char>(data[i]);
  }
  const std::string& first = parts[0];

  const std::string host = detail::slurm_first_host(first);
  if (host.size() > first.size()) std::abort();
  if (auto ord = detail::hostname_ordinal(first); ord && *ord < 0) std::abort();
  for (int node : {0, 1, 7}) {
    if (auto t = detail::slurm_tasks_on_node(first, node); t && first.empty()) std::abort();
  }
  const int port = detail::port_from_job_id(first);
  if (port < 20000 || port >= 30000) std::abort();

  // The same strings as a whole environment, variable by variable.
  static const char* const kVars[] = {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_NODELIST",
                                      "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_JOB_ID", "HOSTNAME",
                                      "PTRAIN_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                      "MASTER_ADDR", "MASTER_PORT", "JOB_COMPLETION_INDEX", "KUBERNETES_SERVICE_HOST",
                                      "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                                      "SLURM_JOB_NODELIST", "SLURM_NTASKS_PER_NODE", "VC_TASK_INDEX", "PET_NNODES",
                                      "PET_NODE_RANK", "PET_NPROC_PER_NODE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};
  constexpr std::size_t kNumVars = sizeof kVars / sizeof kVars[0];
  std::map<std::string, std::string> env;
  // Part k sets variable (first byte of part k) mod kNumVars; the rest of the part is its value.
  for (std::size_t k = 1; k < parts.size(); ++k)
    if (!parts[k].empty())
      env[kVars[static_cast<unsigned char>(parts[k][0]) % kNumVars]] = parts[k].substr(1);
  const GetEnv getenv = [&](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  try {
    const LaunchEnv e = detect_launch_env(getenv);
    if (e.world_size < 1 || e.rank < 0 || e.rank >= e.world_size) std::abort();
    if (e.local_world_size < 1 || e.local_rank < 0 || e.local_rank >= e.local_world_size) std::abort();
  } catch (const ptrain::LaunchError&) {
  }
  return 0;
}
