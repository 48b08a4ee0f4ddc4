// Rank discovery: each launcher's variable set (as a fake environment, the
// values hand-written from what that launcher sets), the precedence between
// launchers, and the errors for missing or inconsistent values. Real
// processes: a Kubernetes Indexed Job / StatefulSet / Slurm / MPICH / Volcano
// pod environment built from scratch, Open MPI through mpirun.

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <string>

#include "process_util.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/launch_env.hpp"

namespace test_launch_env {

using namespace ptrain::dist;
using Env = std::map<std::string, std::string>;

namespace {

LaunchEnv detect(const Env& env) {
  return detect_launch_env([&](const std::string& k) -> std::optional<std::string> {
    auto it = env.find(k);
    if (it == env.end()) return std::nullopt;
    return it->second;
  });
}

// The LaunchError message for env, or "" when detection succeeds.
std::string error_of(const Env& env) {
  try {
    detect(env);
  } catch (const ptrain::LaunchError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("launch_env: no launcher is a single process", "[launch_env]") {
  auto e = detect({{"HOME", "/root"}, {"HOSTNAME", "ip-10-0-0-1"}});
  CHECK(e.launcher == Launcher::None);
  CHECK(e.rank == 0);
  CHECK(e.world_size == 1);
  CHECK(e.master_addr.empty());
  CHECK(e.master_port == 0);
  CHECK_THROWS_AS(e.require_master(), ptrain::LaunchError);
}

TEST_CASE("launch_env: torchrun variables", "[launch_env]") {
  Env env{{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
          {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
          {"TORCHELASTIC_RESTART_COUNT", "2"}, {"GROUP_RANK", "1"}};
  auto e = detect(env);
  CHECK(e.launcher == Launcher::Torchrun);
  CHECK(e.launcher_name() == "torchrun");
  CHECK(e.rank == 5);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 4);
  CHECK(e.master_addr == "node0");
  CHECK(e.master_port == 29500);
  CHECK(e.agent_store);
  CHECK(e.restart_count == 2);
  CHECK(e.source.at("rank") == "RANK");
  CHECK(e.source.at("world_size") == "WORLD_SIZE");
  CHECK(e.source.at("master_addr") == "MASTER_ADDR");
  CHECK_NOTHROW(e.require_master());
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  CHECK_FALSE(detect(env).agent_store);
}

TEST_CASE("launch_env: Kubeflow PyTorchJob pod", "[launch_env]") {
  // A PyTorchJob sets RANK/WORLD_SIZE/MASTER_* per pod, and PET_* for torchrun.
  auto e = detect({{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "job-master-0"}, {"MASTER_PORT", "23456"},
                   {"PET_NNODES", "3"}, {"PET_NODE_RANK", "2"}, {"PET_NPROC_PER_NODE", "1"}});
  CHECK(e.launcher == Launcher::Torchrun);
  CHECK(e.rank == 2);
  CHECK(e.world_size == 3);
  CHECK(e.local_rank == 0);
  CHECK(e.local_world_size == 1);
  // Only PET_* (no RANK): one process per pod, the node rank is the rank.
  auto p = detect({{"PET_NNODES", "4"}, {"PET_NODE_RANK", "3"}, {"PET_MASTER_ADDR", "m"}, {"PET_MASTER_PORT", "1234"}});
  CHECK(p.launcher == Launcher::Torchrun);
  CHECK(p.rank == 3);
  CHECK(p.world_size == 4);
  CHECK(p.master_addr == "m");
  CHECK(p.master_port == 1234);
  CHECK(p.source.at("rank") == "PET_NODE_RANK");
  auto msg = error_of({{"PET_NNODES", "2"}, {"PET_NODE_RANK", "0"}, {"PET_NPROC_PER_NODE", "4"}});
  CHECK_THAT(msg, Catch::Contains("PET_NPROC_PER_NODE=4") && Catch::Contains("torchrun --no-python"));
}

TEST_CASE("launch_env: Open MPI variables", "[launch_env]") {
  auto e = detect({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}, {"OMPI_MCA_ess_base_jobid", "1941176321"}});
  CHECK(e.launcher == Launcher::OpenMPI);
  CHECK(e.rank == 3);
  CHECK(e.world_size == 4);
  CHECK(e.local_rank == 3);
  CHECK(e.local_world_size == 4);
  // One node: rank 0 is on this host; the port comes from the job id, alike on every rank.
  CHECK(e.master_addr == "127.0.0.1");
  CHECK(e.master_port == 20000 + 1941176321 % 10000);
  CHECK(e.source.at("master_port") == "OMPI_MCA_ess_base_jobid");
  // Two nodes, no Slurm: nobody says where rank 0 is.
  auto two = detect({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  CHECK(two.master_addr.empty());
  try {
    two.require_master();
    FAIL("require_master accepted an empty master address");
  } catch (const ptrain::LaunchError& err) {
    CHECK_THAT(err.what(), Catch::Contains("MASTER_ADDR") && Catch::Contains("-x MASTER_ADDR") &&
                               Catch::Contains("[ptrain.launch.no_master]"));
  }
}

TEST_CASE("launch_env: MPICH/Hydra variables", "[launch_env]") {
  auto e = detect({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
  CHECK(e.launcher == Launcher::MPICH);
  CHECK(e.rank == 1);
  CHECK(e.world_size == 2);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 2);
  CHECK(e.source.at("world_size") == "PMI_SIZE");
  CHECK_THAT(error_of({{"PMI_RANK", "1"}}), Catch::Contains("PMI_SIZE is not set"));
}

TEST_CASE("launch_env: Slurm variables, node list and port", "[launch_env]") {
  Env env{{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "2"},
          {"SLURM_TASKS_PER_NODE", "2(x3),1"}, {"SLURM_JOB_NODELIST", "gpu[07-09,12],cpu1"},
          {"SLURM_JOB_ID", "123456"}};
  auto e = detect(env);
  CHECK(e.launcher == Launcher::Slurm);
  CHECK(e.rank == 5);
  CHECK(e.world_size == 7);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 2);  // node 2 of "2(x3),1"
  CHECK(e.master_addr == "gpu07");
  CHECK(e.master_port == 20000 + 123456 % 10000);
  CHECK(e.source.at("master_addr") == "SLURM_JOB_NODELIST");
  // The last node runs one task.
  env["SLURM_NODEID"] = "3";
  env["SLURM_PROCID"] = "6";
  env["SLURM_LOCALID"] = "0";
  CHECK(detect(env).local_world_size == 1);
  // An explicit MASTER_ADDR/PORT wins over what Slurm implies.
  env["MASTER_ADDR"] = "10.1.1.1";
  env["MASTER_PORT"] = "4000";
  CHECK(detect(env).master_addr == "10.1.1.1");
  CHECK(detect(env).master_port == 4000);
  // Host-list parsing, checked against hand-expanded first hosts.
  CHECK(detail::slurm_first_host("node-a,node-b") == "node-a");
  CHECK(detail::slurm_first_host("rack[1-2]-n[04-05]") == "rack1-n04");
  CHECK(detail::slurm_first_host("x[3,1-2]") == "x3");
  CHECK(detail::slurm_tasks_on_node("4", 0) == 4);
  CHECK_FALSE(detail::slurm_tasks_on_node("4", 1).has_value());
  CHECK(detail::slurm_tasks_on_node("1,3(x2)", 2) == 3);
}

TEST_CASE("launch_env: Kubernetes launchers need a world size from the manifest", "[launch_env]") {
  auto ij = detect({{"JOB_COMPLETION_INDEX", "3"}, {"PTRAIN_WORLD_SIZE", "4"}, {"KUBERNETES_SERVICE_HOST", "10.0.0.1"},
                    {"HOSTNAME", "train-3"}, {"MASTER_ADDR", "train-0.train"}, {"MASTER_PORT", "29500"}});
  CHECK(ij.launcher == Launcher::IndexedJob);
  CHECK(ij.rank == 3);
  CHECK(ij.world_size == 4);
  CHECK(ij.local_rank == 0);
  CHECK(ij.local_world_size == 1);
  CHECK(ij.source.at("rank") == "JOB_COMPLETION_INDEX");
  CHECK(ij.source.at("world_size") == "PTRAIN_WORLD_SIZE");
  CHECK_THAT(error_of({{"JOB_COMPLETION_INDEX", "3"}}),
             Catch::Contains("PTRAIN_WORLD_SIZE") && Catch::Contains("spec.completions"));

  auto ss = detect({{"KUBERNETES_SERVICE_HOST", "10.0.0.1"}, {"HOSTNAME", "trainer-12"}, {"WORLD_SIZE", "16"}});
  CHECK(ss.launcher == Launcher::StatefulSet);
  CHECK(ss.rank == 12);
  CHECK(ss.world_size == 16);
  CHECK(ss.source.at("rank") == "HOSTNAME");
  // Outside a pod, a hostname ending in a number is just a hostname.
  CHECK(detect({{"HOSTNAME", "ip-10-0-0-1"}}).launcher == Launcher::None);
  CHECK(detect({{"KUBERNETES_SERVICE_HOST", "10.0.0.1"}, {"HOSTNAME", "web-1"}}).launcher == Launcher::None);

  auto vc = detect({{"VC_TASK_INDEX", "1"}, {"PTRAIN_WORLD_SIZE", "2"}});
  CHECK(vc.launcher == Launcher::Volcano);
  CHECK(vc.rank == 1);
  CHECK(vc.world_size == 2);
  CHECK_THAT(error_of({{"VC_TASK_INDEX", "1"}}), Catch::Contains("Volcano") && Catch::Contains("PTRAIN_WORLD_SIZE"));
  CHECK_THAT(detect({{"JOB_COMPLETION_INDEX", "1"}, {"PTRAIN_WORLD_SIZE", "2"}}).launcher_name(),
             Catch::Contains("Indexed Job"));
}

TEST_CASE("launch_env: precedence goes from the innermost launcher outwards", "[launch_env]") {
  // srun torchrun: SLURM_PROCID is the node, RANK the process.
  Env srun_torchrun{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"RANK", "5"}, {"WORLD_SIZE", "8"},
                    {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}};
  CHECK(detect(srun_torchrun).launcher == Launcher::Torchrun);
  CHECK(detect(srun_torchrun).rank == 5);
  // mpirun inside sbatch: the batch step's SLURM_PROCID=0 must not win.
  auto m = detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"OMPI_COMM_WORLD_RANK", "3"},
                   {"OMPI_COMM_WORLD_SIZE", "4"}, {"SLURM_JOB_NODELIST", "n[1-2]"}});
  CHECK(m.launcher == Launcher::OpenMPI);
  CHECK(m.rank == 3);
  CHECK(m.master_addr == "n1");  // multi-node MPI inside Slurm: rank 0 starts on the first node
  CHECK(detect({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}).launcher ==
        Launcher::MPICH);
  CHECK(detect({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"PMI_RANK", "0"}, {"PMI_SIZE", "1"}})
            .launcher == Launcher::OpenMPI);
  // torchrun inside an Indexed Job pod: the pod index is the node, not the rank.
  CHECK(detect({{"JOB_COMPLETION_INDEX", "1"}, {"PTRAIN_WORLD_SIZE", "2"}, {"RANK", "6"}, {"WORLD_SIZE", "8"}}).rank ==
        6);
  CHECK(detect({{"VC_TASK_INDEX", "1"}, {"JOB_COMPLETION_INDEX", "0"}, {"WORLD_SIZE", "2"}}).launcher ==
        Launcher::Volcano);
}

TEST_CASE("launch_env: bad values name the variable", "[launch_env]") {
  CHECK_THAT(error_of({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}),
             Catch::Contains("RANK='abc'") && Catch::Contains("[ptrain.launch.not_a_number]"));
  CHECK_THAT(error_of({{"RANK", "1"}, {"WORLD_SIZE", "2x"}}), Catch::Contains("WORLD_SIZE='2x'"));
  CHECK_THAT(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}),
             Catch::Contains("RANK=-1") && Catch::Contains("[ptrain.launch.out_of_range]"));
  CHECK_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), Catch::Contains("WORLD_SIZE=0"));
  CHECK_THAT(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}),
             Catch::Contains("RANK=4") && Catch::Contains("WORLD_SIZE=4") &&
                 Catch::Contains("[ptrain.launch.rank_out_of_range]"));
  CHECK_THAT(error_of({{"RANK", "1"}}), Catch::Contains("WORLD_SIZE is not set"));
  CHECK_THAT(error_of({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "2"}}),
             Catch::Contains("OMPI_COMM_WORLD_RANK=5") && Catch::Contains("OMPI_COMM_WORLD_SIZE=2"));
  CHECK_THAT(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "2"},
                       {"SLURM_NTASKS_PER_NODE", "2"}}),
             Catch::Contains("SLURM_LOCALID=2") && Catch::Contains("SLURM_NTASKS_PER_NODE"));
  CHECK_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}}),
             Catch::Contains("LOCAL_WORLD_SIZE=3"));
  CHECK_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}),
             Catch::Contains("MASTER_PORT=70000"));
  CHECK_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}}),
             Catch::Contains("MASTER_PORT='http'"));
  // A world size with no rank variable is a broken manifest, not N copies of rank 0.
  CHECK_THAT(error_of({{"WORLD_SIZE", "4"}}),
             Catch::Contains("[ptrain.launch.no_rank]") && Catch::Contains("WORLD_SIZE=4"));
  CHECK(error_of({{"WORLD_SIZE", "1"}}).empty());
  // torchrun without a master: the error says what to set.
  auto e = detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  CHECK_THROWS_WITH(e.require_master(), Catch::Contains("MASTER_ADDR") && Catch::Contains("ptrun"));
}

namespace {

struct RankReport {
  std::map<std::string, std::string> kv;
};

// Starts `n` workers in rendezvous mode, worker i with env_of(i) as its whole
// environment, and checks that they met through one store as ranks 0..n-1.
void check_rendezvous(int n, const std::function<Env(int)>& env_of, const std::string& launcher) {
  ptrain_test::TempDir dir;
  std::vector<ptrain_test::Process> procs;
  for (int i = 0; i < n; ++i)
    procs.emplace_back(std::vector<std::string>{PTRAIN_TEST_WORKER, "rendezvous", dir.path()}, env_of(i));
  for (auto& p : procs) {
    auto st = p.wait(std::chrono::seconds(30));
    REQUIRE(st.has_value());
    INFO(ptrain_test::read_text(dir.path() + "/error_" + std::to_string(p.pid())));
    CHECK(ptrain_test::exit_code(*st) == 0);
  }
  for (int r = 0; r < n; ++r) {
    auto kv = ptrain_test::read_kv(dir.file("rank_" + std::to_string(r)));
    INFO("rank " << r);
    CHECK(kv["launcher"] == launcher);
    CHECK(kv["rank"] == std::to_string(r));
    CHECK(kv["world_size"] == std::to_string(n));
    CHECK(kv["sum"] == std::to_string(n * (n + 1) / 2));  // every rank added rank + 1
    CHECK(kv["seen"] == std::to_string(n));
  }
}

}  // namespace

TEST_CASE("PTRAIN_COMM_TIMEOUT_S: seconds from 0.001 to 1e7, else an error", "[launch_env]") {
  const char* old = std::getenv("PTRAIN_COMM_TIMEOUT_S");
  const std::string saved = old ? old : "";
  ::setenv("PTRAIN_COMM_TIMEOUT_S", "2.5", 1);
  CHECK(default_comm_timeout() == std::chrono::milliseconds(2500));
  for (const char* bad : {"0.0001", "0", "-3", "abc", "1e9"}) {
    ::setenv("PTRAIN_COMM_TIMEOUT_S", bad, 1);
    CHECK_THROWS_WITH(default_comm_timeout(), Catch::Contains("[ptrain.comm.timeout_env]"));
  }
  if (old) ::setenv("PTRAIN_COMM_TIMEOUT_S", saved.c_str(), 1);
  else ::unsetenv("PTRAIN_COMM_TIMEOUT_S");
}

TEST_CASE("launch_env: processes with only what a Kubernetes Indexed Job pod gets", "[launch_env][process]") {
  const int n = 4, port = ptrain_test::free_port();
  // The pod's environment in full: Kubernetes' service variables, the pod
  // hostname, the completion index, and what the manifest adds. Nothing else
  // of this process leaks in.
  check_rendezvous(n, [&](int i) {
    return Env{{"PATH", "/usr/bin:/bin"},
               {"HOSTNAME", "train-" + std::to_string(i)},
               {"KUBERNETES_SERVICE_HOST", "10.96.0.1"},
               {"KUBERNETES_SERVICE_PORT", "443"},
               {"JOB_COMPLETION_INDEX", std::to_string(i)},
               {"PTRAIN_WORLD_SIZE", std::to_string(n)},
               {"MASTER_ADDR", "127.0.0.1"},
               {"MASTER_PORT", std::to_string(port)}};
  }, "Kubernetes Indexed Job");
}

TEST_CASE("launch_env: processes with a StatefulSet, Volcano, Slurm or MPICH environment", "[launch_env][process]") {
  const int n = 3;
  SECTION("StatefulSet") {
    int port = ptrain_test::free_port();
    check_rendezvous(n, [&](int i) {
      return Env{{"HOSTNAME", "trainer-" + std::to_string(i)}, {"KUBERNETES_SERVICE_HOST", "10.96.0.1"},
                 {"PTRAIN_WORLD_SIZE", std::to_string(n)}, {"MASTER_ADDR", "127.0.0.1"},
                 {"MASTER_PORT", std::to_string(port)}};
    }, "Kubernetes StatefulSet");
  }
  SECTION("Volcano") {
    int port = ptrain_test::free_port();
    check_rendezvous(n, [&](int i) {
      return Env{{"VC_TASK_INDEX", std::to_string(i)}, {"WORLD_SIZE", std::to_string(n)},
                 {"MASTER_ADDR", "localhost"}, {"MASTER_PORT", std::to_string(port)}};
    }, "Volcano");
  }
  SECTION("Slurm, one node: master on this host, port from the job id") {
    // The derived port is 20000 + job id mod 10000; the pid spreads parallel test runs.
    std::string job_id = std::to_string(7000000 + ::getpid() % 10000);
    check_rendezvous(n, [&](int i) {
      return Env{{"SLURM_PROCID", std::to_string(i)}, {"SLURM_NTASKS", std::to_string(n)},
                 {"SLURM_LOCALID", std::to_string(i)}, {"SLURM_NODEID", "0"},
                 {"SLURM_TASKS_PER_NODE", std::to_string(n)}, {"SLURM_JOB_NODELIST", "localhost"},
                 {"SLURM_JOB_ID", job_id}};
    }, "Slurm");
  }
  SECTION("MPICH/Hydra") {
    int port = ptrain_test::free_port();
    check_rendezvous(n, [&](int i) {
      return Env{{"PMI_RANK", std::to_string(i)}, {"PMI_SIZE", std::to_string(n)},
                 {"MPI_LOCALRANKID", std::to_string(i)}, {"MPI_LOCALNRANKS", std::to_string(n)},
                 {"MASTER_PORT", std::to_string(port)}};
    }, "MPICH/Hydra");
  }
}

TEST_CASE("launch_env: real mpirun processes are found as Open MPI", "[launch_env][process]") {
  std::string mpirun = PTRAIN_TEST_MPIRUN;
  if (mpirun.empty())
    FAIL("mpirun was not found when the tests were configured: run tools/install-deps.sh --test (it installs "
         "openmpi-bin) and configure again");
  ptrain_test::TempDir dir;
  std::vector<std::string> argv{mpirun, "-np", "3", "--oversubscribe"};
  if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
  for (auto a : {PTRAIN_TEST_WORKER, "rendezvous"}) argv.push_back(a);
  argv.push_back(dir.path());
  ptrain_test::Process p(argv);
  auto st = p.wait(std::chrono::seconds(60));
  REQUIRE(st.has_value());
  REQUIRE(ptrain_test::exit_code(*st) == 0);
  for (int r = 0; r < 3; ++r) {
    auto kv = ptrain_test::read_kv(dir.file("rank_" + std::to_string(r)));
    CHECK(kv["launcher"] == "Open MPI");
    CHECK(kv["rank"] == std::to_string(r));
    CHECK(kv["local_world_size"] == "3");
    CHECK(kv["sum"] == "6");
  }
}

}  // namespace test_launch_env
