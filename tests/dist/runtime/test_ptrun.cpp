// ptrun with real processes: the variables each rank sees, exit-status
// propagation, one failing rank stopping the others, signal forwarding (the
// signals that stop the job and those that only reach the ranks,
// --signals-to-handle), the SIGKILL escalation and restarts (--max-restarts).

#include <catch2/catch.hpp>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "process_util.hpp"

namespace test_ptrun {

using namespace std::chrono_literals;
using ptrain_test::Process;
using ptrain_test::TempDir;

namespace {

std::vector<std::string> ptrun(std::vector<std::string> args) {
  args.insert(args.begin(), PTRAIN_TEST_PTRUN);
  return args;
}

// Pids the workers wrote; waits until all `n` are there.
std::vector<pid_t> worker_pids(const TempDir& dir, int n) {
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    std::string f = dir.file("pid_" + std::to_string(r));
    REQUIRE(ptrain_test::wait_for_file(f, 20s));
    pids.push_back(std::stoi(ptrain_test::read_text(f)));
  }
  return pids;
}

}  // namespace

TEST_CASE("ptrun: every rank sees torchrun's variables", "[ptrun]") {
  TempDir dir;
  const int nproc = 3, nnodes = 2, node_rank = 1;
  // Node 1 of 2 with torchrun's underscore spellings and --no-python; the
  // program's own arguments (including ones that look like ptrun options) pass through.
  Process p(ptrun({"--nproc_per_node=3", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.9.8.7",
                   "--master_port", "4242", "--no-python", PTRAIN_TEST_WORKER, "env", dir.path(), "--nnodes", "x"}));
  auto st = p.wait(30s);
  REQUIRE(st.has_value());
  REQUIRE(ptrain_test::exit_code(*st) == 0);
  for (int local = 0; local < nproc; ++local) {
    int rank = node_rank * nproc + local;
    auto kv = ptrain_test::read_kv(dir.file("env_" + std::to_string(rank)));
    INFO("rank " << rank);
    CHECK(kv["RANK"] == std::to_string(rank));
    CHECK(kv["LOCAL_RANK"] == std::to_string(local));
    CHECK(kv["WORLD_SIZE"] == std::to_string(nproc * nnodes));
    CHECK(kv["LOCAL_WORLD_SIZE"] == std::to_string(nproc));
    CHECK(kv["GROUP_RANK"] == std::to_string(node_rank));
    CHECK(kv["GROUP_WORLD_SIZE"] == std::to_string(nnodes));
    CHECK(kv["MASTER_ADDR"] == "10.9.8.7");
    CHECK(kv["MASTER_PORT"] == "4242");
    CHECK(kv["TORCHELASTIC_USE_AGENT_STORE"] == "False");
    CHECK(kv["TORCHELASTIC_RUN_ID"] == "none");  // torchrun's default on several nodes: the same on each
    CHECK(kv["ARGS"] == "--nnodes x");
    CHECK(kv["PTRAIN_STORE_TOKEN"] == "<unset>");  // several nodes: the job's secret, not ptrun's
  }
  // Ranks of node 0 were not started here.
  CHECK_FALSE(ptrain_test::file_exists(dir.file("env_0")));
}

TEST_CASE("ptrun: ranks rendezvous through the store rank 0 serves", "[ptrun]") {
  TempDir dir;
  const int n = 4;
  Process p(ptrun({"--nproc-per-node", std::to_string(n), "--master-port", "0", PTRAIN_TEST_WORKER, "rendezvous",
                   dir.path()}));
  auto st = p.wait(60s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 0);
  for (int r = 0; r < n; ++r) {
    auto kv = ptrain_test::read_kv(dir.file("rank_" + std::to_string(r)));
    CHECK(kv["launcher"] == "torchrun");
    CHECK(kv["rank"] == std::to_string(r));
    CHECK(kv["local_rank"] == std::to_string(r));
    CHECK(kv["local_world_size"] == std::to_string(n));
    CHECK(kv["sum"] == std::to_string(n * (n + 1) / 2));
  }
}

TEST_CASE("ptrun: a failing rank stops the others and sets the exit status", "[ptrun]") {
  struct Case {
    std::string code;
    int expect;
  };
  for (auto c : {Case{"7", 7}, Case{"sig9", 128 + SIGKILL}}) {
    TempDir dir;
    const int n = 4;
    Process p(ptrun({"--nproc-per-node", std::to_string(n), "--master-port", "0", PTRAIN_TEST_WORKER, "fail", "2",
                     c.code, dir.path()}));
    auto st = p.wait(120s);
    REQUIRE(st.has_value());
    INFO("rank 2 ends with " << c.code);
    CHECK(ptrain_test::exit_code(*st) == c.expect);
    // The others sleep for 60 s unless stopped: each one's SIGTERM handler leaves term_<rank>.
    for (int r = 0; r < n; ++r)
      if (r != 2) CHECK(ptrain_test::file_exists(dir.file("term_" + std::to_string(r))));
    for (pid_t pid : worker_pids(dir, n)) CHECK(ptrain_test::process_gone(pid));
  }
}

TEST_CASE("ptrun: a program that cannot start is reported", "[ptrun]") {
  Process p(ptrun({"--nproc-per-node", "2", "/nonexistent/program"}));
  auto st = p.wait(20s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 127);
  Process bad(ptrun({"--nproc-per-node", "0", PTRAIN_TEST_WORKER}));
  auto st2 = bad.wait(20s);
  REQUIRE(st2.has_value());
  CHECK(ptrain_test::exit_code(*st2) != 0);
  // An unknown option is a usage error (2), not a program that cannot start (127);
  // "--" ends ptrun's options as in torchrun.
  Process unknown(ptrun({"--bogus-flag", "/bin/true"}));
  auto st3 = unknown.wait(20s);
  REQUIRE(st3.has_value());
  CHECK(ptrain_test::exit_code(*st3) == 2);
  Process dashes(ptrun({"--nproc-per-node", "2", "--", "/bin/true"}));
  auto st4 = dashes.wait(20s);
  REQUIRE(st4.has_value());
  CHECK(ptrain_test::exit_code(*st4) == 0);
}

TEST_CASE("ptrun: SIGTERM and SIGINT are forwarded to every rank", "[ptrun]") {
  for (int sig : {SIGTERM, SIGINT}) {
    TempDir dir;
    const int n = 3;
    Process p(ptrun({"--nproc-per-node", std::to_string(n), PTRAIN_TEST_WORKER, "sleep", dir.path()}));
    auto pids = worker_pids(dir, n);
    ::kill(p.pid(), sig);
    auto st = p.wait(20s);
    REQUIRE(st.has_value());
    // The program's own status: 75 from its SIGTERM handler; SIGINT's default action kills it.
    CHECK(ptrain_test::exit_code(*st) == (sig == SIGTERM ? 75 : 128 + sig));
    for (pid_t pid : pids) CHECK(ptrain_test::process_gone(pid));
    if (sig == SIGTERM)
      for (int r = 0; r < n; ++r) CHECK(ptrain_test::file_exists(dir.file("term_" + std::to_string(r))));
  }
}

TEST_CASE("ptrun: ranks that ignore SIGTERM get SIGKILL after the grace period", "[ptrun]") {
  TempDir dir;
  const int n = 2;
  Process p(ptrun({"--nproc-per-node", std::to_string(n), "--grace-period", "0.5", PTRAIN_TEST_WORKER, "sleep",
                   dir.path(), "ignore"}));
  auto pids = worker_pids(dir, n);
  auto t0 = std::chrono::steady_clock::now();
  ::kill(p.pid(), SIGTERM);
  // The ranks ignore SIGTERM and sleep for 60 s: a job that ends within 30 s was ended by SIGKILL.
  auto st = p.wait(30s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 128 + SIGTERM);
  CHECK(std::chrono::steady_clock::now() - t0 >= 400ms);  // it did wait for the grace period
  for (pid_t pid : pids) CHECK(ptrain_test::process_gone(pid));
}

namespace {
// ptrun with its stderr in `err` (exec through sh, so that the Process's pid is ptrun's).
Process ptrun_logged(const std::string& args, const std::string& err) {
  return Process({"/bin/sh", "-c", "exec " + std::string(PTRAIN_TEST_PTRUN) + " " + args + " 2>" + err});
}

// Waits until `path` contains `text`; false after `timeout`.
bool wait_for_text(const std::string& path, const std::string& text, std::chrono::milliseconds timeout) {
  auto until = std::chrono::steady_clock::now() + timeout;
  while (ptrain_test::read_text(path).find(text) == std::string::npos) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}
}  // namespace

TEST_CASE("ptrun: SIGUSR1 and SIGUSR2 reach every rank and ptrun exits with the ranks' status", "[ptrun]") {
  // Slurm's --signal=USR1@N and the flight recorder's SIGUSR2 sent to ptrun: it must not die
  // of them (their default action; PR_SET_PDEATHSIG would then SIGKILL every rank).
  for (int sig : {SIGUSR1, SIGUSR2}) {
    TempDir dir;
    const int n = 2;
    Process p(ptrun({"--nproc-per-node", std::to_string(n), PTRAIN_TEST_WORKER, "usr", dir.path(), "75"}));
    auto pids = worker_pids(dir, n);
    ::kill(p.pid(), sig);
    auto st = p.wait(60s);
    REQUIRE(st.has_value());
    INFO("signal " << sig);
    CHECK(ptrain_test::exit_code(*st) == 75);  // the ranks' own code, not 128 + sig
    const std::string got = sig == SIGUSR1 ? "usr1_" : "usr2_", other = sig == SIGUSR1 ? "usr2_" : "usr1_";
    for (int r = 0; r < n; ++r) {
      CHECK(ptrain_test::file_exists(dir.file(got + std::to_string(r))));
      CHECK_FALSE(ptrain_test::file_exists(dir.file(other + std::to_string(r))));
    }
    for (pid_t pid : pids) CHECK(ptrain_test::process_gone(pid));
  }
}

TEST_CASE("ptrun: SIGUSR1 does not stop the job, the ranks decide", "[ptrun]") {
  // The ranks note the signal and sleep on (a flight-recorder dump): ptrun forwards it, twice,
  // and keeps running; a later SIGTERM still stops the job as before.
  TempDir dir;
  const int n = 2;
  Process p(ptrun({"--nproc-per-node", std::to_string(n), PTRAIN_TEST_WORKER, "usr", dir.path(), "stay"}));
  auto pids = worker_pids(dir, n);
  ::kill(p.pid(), SIGUSR1);
  for (int r = 0; r < n; ++r) REQUIRE(ptrain_test::wait_for_file(dir.file("usr1_" + std::to_string(r)), 30s));
  ::kill(p.pid(), SIGUSR2);
  for (int r = 0; r < n; ++r) REQUIRE(ptrain_test::wait_for_file(dir.file("usr2_" + std::to_string(r)), 30s));
  CHECK_FALSE(p.wait(0ms).has_value());
  for (pid_t pid : pids) CHECK_FALSE(ptrain_test::process_gone(pid));
  ::kill(p.pid(), SIGTERM);
  auto st = p.wait(60s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 75);
  // Both ranks were still there to get the SIGTERM.
  for (int r = 0; r < n; ++r) CHECK(ptrain_test::file_exists(dir.file("term_" + std::to_string(r))));
  for (pid_t pid : pids) CHECK(ptrain_test::process_gone(pid));
}

TEST_CASE("ptrun: --signals-to-handle chooses the signals it forwards", "[ptrun]") {
  // Only SIGUSR1 listed: SIGUSR2 is not forwarded, and ptrun says so instead of dying of it.
  TempDir dir;
  const int n = 2;
  const std::string err = dir.file("stderr");
  Process p = ptrun_logged("--signals-to-handle SIGUSR1 --nproc-per-node 2 " + std::string(PTRAIN_TEST_WORKER) +
                               " usr " + dir.path() + " 75",
                           err);
  auto pids = worker_pids(dir, n);
  ::kill(p.pid(), SIGUSR2);
  REQUIRE(wait_for_text(err, "not in --signals-to-handle", 30s));
  CHECK_FALSE(p.wait(0ms).has_value());
  ::kill(p.pid(), SIGUSR1);
  auto st = p.wait(60s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 75);
  for (int r = 0; r < n; ++r) {
    CHECK(ptrain_test::file_exists(dir.file("usr1_" + std::to_string(r))));
    CHECK_FALSE(ptrain_test::file_exists(dir.file("usr2_" + std::to_string(r))));
  }
  for (pid_t pid : pids) CHECK(ptrain_test::process_gone(pid));

  // torchrun's underscore spelling; names without SIG, in lower case, with spaces, work too.
  TempDir dir2;
  Process q(ptrun({"--signals_to_handle=usr2, SIGTERM", "--nproc-per-node", "2", PTRAIN_TEST_WORKER, "usr",
                   dir2.path(), "76"}));
  worker_pids(dir2, n);
  ::kill(q.pid(), SIGUSR2);
  auto st2 = q.wait(60s);
  REQUIRE(st2.has_value());
  CHECK(ptrain_test::exit_code(*st2) == 76);
  for (int r = 0; r < n; ++r) CHECK(ptrain_test::file_exists(dir2.file("usr2_" + std::to_string(r))));
}

TEST_CASE("ptrun: --signals-to-handle refuses what it cannot forward, naming it", "[ptrun]") {
  for (std::string bad : {"SIGBOGUS", "SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV", "15"}) {
    TempDir dir;
    const std::string err = dir.file("stderr");
    Process p = ptrun_logged("--signals-to-handle SIGTERM," + bad + " --nproc-per-node 1 /bin/true", err);
    auto st = p.wait(20s);
    REQUIRE(st.has_value());
    INFO(bad << ": " << ptrain_test::read_text(err));
    CHECK(ptrain_test::exit_code(*st) == 2);
    CHECK(ptrain_test::read_text(err).find("'" + bad + "'") != std::string::npos);
  }
  TempDir dir;
  Process empty = ptrun_logged("--signals-to-handle SIGTERM,,SIGUSR1 /bin/true", dir.file("stderr"));
  auto st = empty.wait(20s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 2);
  // --help gives the default, with SIGUSR1 and SIGUSR2.
  Process help = ptrun_logged("--help >" + dir.file("help"), dir.file("stderr"));
  REQUIRE(help.wait(20s).has_value());
  CHECK(ptrain_test::read_text(dir.file("help")).find("SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2") !=
        std::string::npos);
}

TEST_CASE("ptrun: --max-restarts starts every rank again after a failure", "[ptrun]") {
  const int n = 3;
  for (bool fixed_port : {false, true}) {
    TempDir dir;
    // Rank 1 fails in rounds 0 and 1; the third round, restart 2, succeeds.
    const std::string port = fixed_port ? std::to_string(ptrain_test::free_port()) : "0";
    Process p(ptrun({"--nproc-per-node", std::to_string(n), "--master-port", port, "--max-restarts", "3",
                     PTRAIN_TEST_WORKER, "flaky", "1", "2", dir.path()}));
    auto st = p.wait(60s);
    REQUIRE(st.has_value());
    CHECK(ptrain_test::exit_code(*st) == 0);
    std::string run_id;
    for (int round = 0; round <= 2; ++round)
      for (int r = 0; r < n; ++r) {
        INFO("round " << round << ", rank " << r << ", fixed port " << fixed_port);
        std::string f = dir.file("round_" + std::to_string(round) + "_" + std::to_string(r));
        REQUIRE(ptrain_test::file_exists(f));
        auto kv = ptrain_test::read_kv(f);
        CHECK(kv["TORCHELASTIC_RESTART_COUNT"] == std::to_string(round));
        CHECK(kv["TORCHELASTIC_MAX_RESTARTS"] == "3");
        if (fixed_port) CHECK(kv["MASTER_PORT"] == port);
        if (run_id.empty()) run_id = kv["TORCHELASTIC_RUN_ID"];
        CHECK(kv["TORCHELASTIC_RUN_ID"] == run_id);  // one run, several rounds
      }
    CHECK_FALSE(ptrain_test::file_exists(dir.file("round_3_0")));
  }
}

TEST_CASE("ptrun: when the restarts are used up, the last failure sets the exit status", "[ptrun]") {
  TempDir dir;
  Process p(ptrun({"--standalone", "--nproc-per-node", "2", "--max-restarts", "1", PTRAIN_TEST_WORKER, "flaky", "0",
                   "5", dir.path()}));
  auto st = p.wait(60s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 3);
  CHECK(ptrain_test::file_exists(dir.file("round_1_1")));
  CHECK_FALSE(ptrain_test::file_exists(dir.file("round_2_0")));
}

TEST_CASE("ptrun: no restart after a signal or when the program cannot start", "[ptrun]") {
  TempDir dir;
  Process p(ptrun({"--nproc-per-node", "2", "--max-restarts", "3", PTRAIN_TEST_WORKER, "sleep", dir.path()}));
  auto pids = worker_pids(dir, 2);
  ::kill(p.pid(), SIGTERM);
  auto st = p.wait(20s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 75);
  for (pid_t pid : pids) CHECK(ptrain_test::process_gone(pid));

  // ptrun's stderr goes to a file (through sh): it must say it cannot execute, and not restart.
  const std::string err = dir.file("stderr");
  Process missing({"/bin/sh", "-c", std::string(PTRAIN_TEST_PTRUN) +
                                        " --nproc-per-node 2 --max-restarts 100 /nonexistent/program 2>" + err});
  auto st2 = missing.wait(20s);
  REQUIRE(st2.has_value());
  CHECK(ptrain_test::exit_code(*st2) == 127);
  const std::string said = ptrain_test::read_text(err);
  CHECK(said.find("cannot execute") != std::string::npos);
  CHECK(said.find("again") == std::string::npos);
}

namespace {
// Two ptrun "nodes" on this machine: --nnodes 2, --node-rank 0 and 1, 2 ranks each.
std::vector<Process> two_nodes(const std::string& port, std::vector<std::string> extra,
                               const std::vector<std::string>& program) {
  std::vector<Process> nodes;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> args{"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "2",
                                  "--master-addr", "127.0.0.1", "--master-port", port};
    args.insert(args.end(), extra.begin(), extra.end());
    args.insert(args.end(), program.begin(), program.end());
    nodes.emplace_back(ptrun(args));
  }
  return nodes;
}
}  // namespace

TEST_CASE("ptrun: --max-restarts on several nodes restarts every node together", "[ptrun]") {
  // Rank 3 (node 1) fails in rounds 0 and 1: node 0's ranks are stopped through the agent
  // store, and both nodes start round 1, then round 2, which succeeds.
  TempDir dir;
  const std::string port = std::to_string(ptrain_test::free_port());
  auto nodes = two_nodes(port, {"--max-restarts", "3", "--rdzv-id", "job-42"},
                         {PTRAIN_TEST_WORKER, "flaky", "3", "2", dir.path()});
  for (auto& n : nodes) {
    auto st = n.wait(90s);
    REQUIRE(st.has_value());
    CHECK(ptrain_test::exit_code(*st) == 0);
  }
  for (int round = 0; round <= 2; ++round)
    for (int r = 0; r < 4; ++r) {
      INFO("round " << round << ", rank " << r);
      auto kv = ptrain_test::read_kv(dir.file("round_" + std::to_string(round) + "_" + std::to_string(r)));
      CHECK(kv["TORCHELASTIC_RESTART_COUNT"] == std::to_string(round));
      CHECK(kv["MASTER_PORT"] == port);  // the programs' store is on MASTER_PORT + 1 (agent store)
      CHECK(kv["TORCHELASTIC_RUN_ID"] == "job-42");
    }
  CHECK_FALSE(ptrain_test::file_exists(dir.file("round_3_0")));

  // Restarts used up: the failing node exits with its rank's code, the other with 1.
  TempDir dir2;
  auto used_up = two_nodes(std::to_string(ptrain_test::free_port()), {"--max-restarts", "1"},
                           {PTRAIN_TEST_WORKER, "flaky", "3", "5", dir2.path()});
  auto st0 = used_up[0].wait(90s), st1 = used_up[1].wait(90s);
  REQUIRE((st0 && st1));
  CHECK(ptrain_test::exit_code(*st0) == 1);
  CHECK(ptrain_test::exit_code(*st1) == 3);
  CHECK(ptrain_test::file_exists(dir2.file("round_1_0")));
  CHECK_FALSE(ptrain_test::file_exists(dir2.file("round_2_0")));
}

TEST_CASE("ptrun: on several nodes a signal stops every node, and a missing node times out", "[ptrun]") {
  TempDir dir;
  auto nodes = two_nodes(std::to_string(ptrain_test::free_port()), {"--max-restarts", "3"},
                         {PTRAIN_TEST_WORKER, "sleep", dir.path()});
  auto pids = worker_pids(dir, 4);
  ::kill(nodes[0].pid(), SIGTERM);
  auto st0 = nodes[0].wait(30s), st1 = nodes[1].wait(30s);
  REQUIRE((st0 && st1));
  CHECK(ptrain_test::exit_code(*st0) == 75);
  CHECK(ptrain_test::exit_code(*st1) != 0);
  for (pid_t pid : pids) CHECK(ptrain_test::process_gone(pid));
  for (int r = 0; r < 4; ++r) CHECK(ptrain_test::file_exists(dir.file("term_" + std::to_string(r))));

  // Node 1 never starts: node 0 gives up after --rdzv-timeout, before starting any rank.
  TempDir dir2;
  Process alone(ptrun({"--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--master-port",
                       std::to_string(ptrain_test::free_port()), "--max-restarts", "1", "--rdzv-timeout", "2",
                       PTRAIN_TEST_WORKER, "sleep", dir2.path()}));
  auto st = alone.wait(120s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 1);
  CHECK_FALSE(ptrain_test::file_exists(dir2.file("pid_0")));
}

TEST_CASE("ptrun: on several nodes a node whose ranks are done does not wait past --rdzv-timeout", "[ptrun]") {
  // Rank 0 (node 0) works 30 s longer than the others: node 1 leaves after --rdzv-timeout 1
  // with its own status (0), as torchrun's exit barrier does, and node 0 still ends with 0.
  auto nodes = two_nodes(std::to_string(ptrain_test::free_port()), {"--max-restarts", "1", "--rdzv-timeout", "1"},
                         {PTRAIN_TEST_WORKER, "linger", "0", "30"});
  auto st1 = nodes[1].wait(120s);
  REQUIRE(st1.has_value());
  // It did not wait for rank 0: node 0 is still running when node 1 is done.
  CHECK_FALSE(nodes[0].wait(0ms).has_value());
  auto st0 = nodes[0].wait(120s);
  REQUIRE(st0.has_value());
  CHECK(ptrain_test::exit_code(*st1) == 0);
  CHECK(ptrain_test::exit_code(*st0) == 0);
}

TEST_CASE("ptrun: several nodes need --node-rank, each its own", "[ptrun]") {
  Process none(ptrun({"--nnodes", "2", "--nproc-per-node", "1", "/bin/true"}));
  auto st = none.wait(20s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 2);

  // With --max-restarts the agent store sees a second --node-rank 1 and refuses it (exit 1);
  // node 0 and the other node 1 run.
  const std::string port = std::to_string(ptrain_test::free_port());
  std::vector<Process> nodes;
  for (const char* node : {"0", "1", "1"})
    nodes.emplace_back(ptrun({"--nnodes", "2", "--node-rank", node, "--nproc-per-node", "1", "--master-port", port,
                              "--max-restarts", "1", "--rdzv-timeout", "20", PTRAIN_TEST_WORKER, "linger", "0", "2"}));
  std::vector<int> codes;
  for (auto& n : nodes) {
    auto s = n.wait(60s);
    REQUIRE(s.has_value());
    codes.push_back(ptrain_test::exit_code(*s));
  }
  CHECK(codes[0] == 0);
  CHECK(std::min(codes[1], codes[2]) == 0);
  CHECK(std::max(codes[1], codes[2]) == 1);
}

TEST_CASE("ptrun: a single node's ranks share a random store token, unless the job set one", "[ptrun]") {
  TempDir a, b;
  for (const TempDir* dir : {&a, &b}) {
    Process p(ptrun({"--nproc-per-node", "2", PTRAIN_TEST_WORKER, "env", dir->path()}));
    auto st = p.wait(30s);
    REQUIRE(st.has_value());
    REQUIRE(ptrain_test::exit_code(*st) == 0);
  }
  auto token = [](const TempDir& d, int r) { return ptrain_test::read_kv(d.file("env_" + std::to_string(r)))["PTRAIN_STORE_TOKEN"]; };
  CHECK(token(a, 0).size() == 64);
  CHECK(token(a, 0) == token(a, 1));
  CHECK(token(a, 0) != token(b, 0));
  CHECK(ptrain_test::read_kv(a.file("env_0"))["MASTER_ADDR"] == "127.0.0.1");

  TempDir c;
  Process p({"/usr/bin/env", "PTRAIN_STORE_TOKEN=mine", PTRAIN_TEST_PTRUN, "--nproc-per-node", "2", PTRAIN_TEST_WORKER,
             "env", c.path()});
  auto st = p.wait(30s);
  REQUIRE(st.has_value());
  CHECK(token(c, 1) == "mine");
}

namespace {

// Runs `ptrun args` through sh with stdout and stderr in files; returns the exit status.
// ptrun with `args`, its stdout and stderr in dir's out and err; `env`: "NAME=value ..."
// for ptrun's environment.
int run_captured(const TempDir& dir, const std::string& args, const std::string& env = "") {
  Process p({"/bin/sh", "-c", env + " " + std::string(PTRAIN_TEST_PTRUN) + " " + args + " >" + dir.file("out") +
                                  " 2>" + dir.file("err")});
  auto st = p.wait(30s);
  REQUIRE(st.has_value());
  return ptrain_test::exit_code(*st);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::size_t start = 0;
  for (std::size_t nl; (nl = text.find('\n', start)) != std::string::npos; start = nl + 1)
    lines.push_back(text.substr(start, nl - start));
  if (start < text.size()) lines.push_back(text.substr(start));
  return lines;
}

}  // namespace

TEST_CASE("ptrun: a failed job's last line names the failure and the restarts left", "[ptrun]") {
  // Issue 44: the cause, the node and whether a restart was left, not only the rank's exit.
  TempDir dir, out;
  CHECK(run_captured(out, "--nproc-per-node 2 --master-port 0 " + std::string(PTRAIN_TEST_WORKER) + " fail 1 7 " +
                              dir.path()) == 7);
  const auto lines = lines_of(ptrain_test::read_text(out.file("err")));
  REQUIRE_FALSE(lines.empty());
  CHECK_THAT(lines.back(), Catch::StartsWith("ptrun: the job failed after 0 restart(s): rank 1 (pid ") &&
                               Catch::Contains("exited with code 7 on node 0") &&
                               Catch::Contains("no restart was allowed (pass --max-restarts N"));
  TempDir flaky, out2;
  CHECK(run_captured(out2, "--standalone --nproc-per-node 2 --max-restarts 1 " + std::string(PTRAIN_TEST_WORKER) +
                               " flaky 0 5 " + flaky.path()) == 3);
  const auto lines2 = lines_of(ptrain_test::read_text(out2.file("err")));
  REQUIRE_FALSE(lines2.empty());
  CHECK_THAT(lines2.back(), Catch::StartsWith("ptrun: the job failed after 1 restart(s): rank 0") &&
                                Catch::Contains("all 1 restart(s) of --max-restarts are used up"));
}

namespace {
// The record in a torchrun error file; an empty object when there is none or it is no JSON.
nlohmann::json read_record(const std::string& path) {
  if (!ptrain_test::file_exists(path)) return nlohmann::json::object();
  nlohmann::json j = nlohmann::json::parse(ptrain_test::read_text(path), nullptr, false);
  return j.is_discarded() ? nlohmann::json::object() : j;
}

// Entries of a folder.
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) names.push_back(e.path().filename().string());
  return names;
}

long long now_s() { return static_cast<long long>(std::time(nullptr)); }
}  // namespace

TEST_CASE("ptrun: a failed rank without an error file: ptrun's TORCHELASTIC_ERROR_FILE names it", "[ptrun]") {
  // Kubeflow reads the launcher's TORCHELASTIC_ERROR_FILE; torchrun's record shape, with
  // the rank, its exit and its node when the rank wrote nothing itself.
  struct Case {
    std::string code;
    int status, error_code;
    std::string exit;
  };
  for (const auto& c : {Case{"7", 7, 7, "exited with code 7"}, Case{"sig9", 128 + SIGKILL, -SIGKILL, "was killed by "
                                                                                                      "signal 9"}}) {
    INFO("rank 1 ends with " << c.code);
    TempDir dir, out;
    const std::string tmp = out.file("tmp"), error = out.file("error.json");
    const long long t0 = now_s();
    CHECK(run_captured(out, "--nproc-per-node 2 --master-port 0 " + std::string(PTRAIN_TEST_WORKER) + " fail 1 " +
                                c.code + " " + dir.path(),
                       "TMPDIR=" + tmp + " TORCHELASTIC_ERROR_FILE=" + error) == c.status);
    const nlohmann::json j = read_record(error);
    REQUIRE(j.contains("message"));
    const std::string message = j["message"].value("message", "");
    CHECK_THAT(message, Catch::StartsWith("rank 1 (pid ") && Catch::Contains(c.exit) && Catch::Contains("on node 0 (host ") &&
                            Catch::Contains("it wrote no error file"));
    CHECK(j["message"].value("errorCode", 0) == c.error_code);
    const long long stamp = std::stoll(j["message"]["extraInfo"].value("timestamp", "0"));
    CHECK(stamp >= t0);
    CHECK(stamp <= now_s());
    CHECK(j["message"]["extraInfo"].contains("py_callstack"));
    // No rank wrote an error file: ptrun's temporary folder for them is gone.
    CHECK(entries(tmp).empty());
  }
  // A job that succeeds writes nothing there and leaves nothing behind.
  TempDir out;
  CHECK(run_captured(out, "--nproc-per-node 2 /bin/true",
                     "TMPDIR=" + out.file("tmp") + " TORCHELASTIC_ERROR_FILE=" + out.file("error.json")) == 0);
  CHECK_FALSE(ptrain_test::file_exists(out.file("error.json")));
  CHECK(entries(out.file("tmp")).empty());
}

TEST_CASE("ptrun: a rank's own error file is the one copied to ptrun's TORCHELASTIC_ERROR_FILE", "[ptrun]") {
  TempDir dir, out;
  const std::string tmp = out.file("tmp"), error = out.file("error.json");
  // Rank 1 throws; ptrain::dist::record_error writes the exception in torchrun's shape.
  CHECK(run_captured(out, "--nproc-per-node 3 --master-port 0 " + std::string(PTRAIN_TEST_WORKER) + " fail 1 throw " +
                              dir.path(),
                     "TMPDIR=" + tmp + " TORCHELASTIC_ERROR_FILE=" + error) == 1);
  const nlohmann::json j = read_record(error);
  REQUIRE(j.contains("message"));
  CHECK(j["message"].value("message", "") == "std::runtime_error: rank 1 failed on purpose");
  CHECK(j["message"].value("errorCode", 0) == 1);  // set by the launcher, as torchrun does
  // The folder holds an error file, so it is kept, and ptrun says where.
  const auto kept = entries(tmp);
  REQUIRE(kept.size() == 1);
  const std::string rank_file = tmp + "/" + kept[0] + "/attempt_0/1/error.json";
  CHECK(ptrain_test::read_text(out.file("err")).find("kept in " + tmp + "/" + kept[0]) != std::string::npos);
  nlohmann::json own = read_record(rank_file);
  REQUIRE(own.contains("message"));
  CHECK_FALSE(own["message"].contains("errorCode"));  // the rank's file as it wrote it
  own["message"]["errorCode"] = 1;
  CHECK(own == j);  // the same timestamp and call stack: a copy, not ptrun's own record
  CHECK_FALSE(ptrain_test::file_exists(tmp + "/" + kept[0] + "/attempt_0/0/error.json"));

  // A file that is not a torchrun record is not copied: ptrun's own names the rank and the file.
  TempDir dir2, out2;
  CHECK(run_captured(out2, "--nproc-per-node 2 --master-port 0 " + std::string(PTRAIN_TEST_WORKER) + " fail 0 corrupt " +
                               dir2.path(),
                     "TMPDIR=" + out2.file("tmp") + " TORCHELASTIC_ERROR_FILE=" + out2.file("error.json")) == 5);
  const nlohmann::json j2 = read_record(out2.file("error.json"));
  REQUIRE(j2.contains("message"));
  CHECK_THAT(j2["message"].value("message", ""), Catch::StartsWith("rank 0 (pid ") &&
                                                     Catch::Contains("exited with code 5 on node 0") &&
                                                     Catch::Contains("is not a torchrun error record"));
  CHECK(j2["message"].value("errorCode", 0) == 5);
}

TEST_CASE("ptrun: each rank's TORCHELASTIC_ERROR_FILE is in the log folder, as torchrun lays it out", "[ptrun]") {
  TempDir dir, env;
  const std::string logs = dir.file("logs");
  REQUIRE(run_captured(dir, "--nproc-per-node 2 --rdzv-id job9 --log-dir " + logs + " " PTRAIN_TEST_WORKER " env " +
                                env.path()) == 0);
  const auto runs = entries(logs);
  REQUIRE(runs.size() == 1);  // --log-dir's job folder is kept
  CHECK(runs[0].rfind("job9_", 0) == 0);
  for (int r = 0; r < 2; ++r) {
    auto kv = ptrain_test::read_kv(env.file("env_" + std::to_string(r)));
    CHECK(kv["TORCHELASTIC_ERROR_FILE"] == logs + "/" + runs[0] + "/attempt_0/" + std::to_string(r) + "/error.json");
    CHECK(ptrain_test::file_exists(logs + "/" + runs[0] + "/attempt_0/" + std::to_string(r)));  // its folder exists
  }
  // A job that ptrun stopped on a signal and that ended with a failure leaves that cause.
  TempDir d2;
  Process p({"/bin/sh", "-c", "TORCHELASTIC_ERROR_FILE=" + d2.file("error.json") + " exec " +
                                  std::string(PTRAIN_TEST_PTRUN) + " --nproc-per-node 2 " + PTRAIN_TEST_WORKER +
                                  " sleep " + d2.path() + " 2>" + d2.file("err")});
  worker_pids(d2, 2);
  ::kill(p.pid(), SIGTERM);
  auto st = p.wait(30s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 75);
  const nlohmann::json j = read_record(d2.file("error.json"));
  REQUIRE(j.contains("message"));
  CHECK_THAT(j["message"].value("message", ""), Catch::Contains("got signal 15") &&
                                                    Catch::Contains("ended with status 75"));
  // A usage error writes nothing, as under torchrun.
  CHECK(run_captured(d2, "--nproc-per-node 2 --tee 9 /bin/true", "TORCHELASTIC_ERROR_FILE=" + d2.file("usage.json")) ==
        2);
  CHECK_FALSE(ptrain_test::file_exists(d2.file("usage.json")));
}

TEST_CASE("ptrun: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE sets the line prefix as under torchrun", "[ptrun]") {
  TempDir dir;
  const std::string prog = " /bin/sh -c 'echo hi'";
  auto sorted_out = [&] {
    auto out = lines_of(ptrain_test::read_text(dir.file("out")));
    std::sort(out.begin(), out.end());
    return out;
  };
  REQUIRE(run_captured(dir, "--nproc-per-node 2" + prog, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]: '") == 0);
  CHECK(sorted_out() == std::vector<std::string>{"[rank0]: hi", "[rank1]: hi"});
  // Python's string.Template: $name without braces, $$ for a dollar, unknown names kept.
  REQUIRE(run_captured(dir, "--nproc-per-node 2 --role w" + prog,
                       "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='$role_name-$local_rank $$ ${foo} $rankx|'") == 0);
  CHECK(sorted_out() == std::vector<std::string>{"w-0 $ ${foo} $rankx|hi", "w-1 $ ${foo} $rankx|hi"});
  // One rank gets the template too (the default there is no prefix).
  REQUIRE(run_captured(dir, "--nproc-per-node 1" + prog, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='<${local_rank}>'") == 0);
  CHECK(sorted_out() == std::vector<std::string>{"<0>hi"});
  // --log-line-prefix-template wins over the variable; an empty variable is torchrun's "unset".
  REQUIRE(run_captured(dir, "--nproc-per-node 2 --log-line-prefix-template 'r${rank}:'" + prog,
                       "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]: '") == 0);
  CHECK(sorted_out() == std::vector<std::string>{"r0:hi", "r1:hi"});
  REQUIRE(run_captured(dir, "--nproc-per-node 2" + prog, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=") == 0);
  CHECK(sorted_out() == std::vector<std::string>{"[default0]:hi", "[default1]:hi"});
}

TEST_CASE("ptrun: torchrun's PET_ variables give every option ptrun shares with it a default", "[ptrun]") {
  TempDir dir, env;
  const std::string worker = std::string(" ") + PTRAIN_TEST_WORKER + " env " + env.path();
  // PET_ROLE: the ranks' ROLE_NAME; the flag wins over the variable.
  REQUIRE(run_captured(dir, "--nproc-per-node 1" + worker, "PET_ROLE=trainer") == 0);
  CHECK(ptrain_test::read_kv(env.file("env_0"))["ROLE_NAME"] == "trainer");
  REQUIRE(run_captured(dir, "--nproc-per-node 1 --role critic" + worker, "PET_ROLE=trainer") == 0);
  CHECK(ptrain_test::read_kv(env.file("env_0"))["ROLE_NAME"] == "critic");
  // PET_STANDALONE=1: a free port on localhost instead of 29500; 0 (torchrun's check_env) is off.
  REQUIRE(run_captured(dir, "--nproc-per-node 1" + worker, "PET_STANDALONE=1") == 0);
  auto kv = ptrain_test::read_kv(env.file("env_0"));
  CHECK(kv["MASTER_ADDR"] == "127.0.0.1");
  CHECK(kv["MASTER_PORT"] != "29500");
  REQUIRE(run_captured(dir, "--nproc-per-node 1" + worker, "PET_STANDALONE=0") == 0);
  CHECK(ptrain_test::read_kv(env.file("env_0"))["MASTER_PORT"] == "29500");
  CHECK(run_captured(dir, "/bin/true", "PET_NO_PYTHON=1") == 0);
  // PET_MONITOR_INTERVAL and PET_SHUTDOWN_TIMEOUT are read: a bad value is a usage error (2, as a bad
  // flag is, and as under torchrun's argparse).
  CHECK(run_captured(dir, "/bin/true", "PET_MONITOR_INTERVAL=often") == 2);
  CHECK(run_captured(dir, "/bin/true", "PET_SHUTDOWN_TIMEOUT=soon") == 2);
  CHECK(run_captured(dir, "--grace-period soon /bin/true") == 2);
  CHECK(run_captured(dir, "--help") == 0);
  // PET_SHUTDOWN_TIMEOUT is the grace period (ptrun's default is 5 s): ranks that ignore
  // SIGTERM are killed after 0.5 s.
  TempDir d2;
  Process p({"/bin/sh", "-c", "PET_SHUTDOWN_TIMEOUT=0.5 exec " + std::string(PTRAIN_TEST_PTRUN) +
                                  " --nproc-per-node 2 " + PTRAIN_TEST_WORKER + " sleep " + d2.path() + " ignore"});
  worker_pids(d2, 2);
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(p.pid(), SIGTERM);
  auto st = p.wait(30s);
  REQUIRE(st.has_value());
  CHECK(ptrain_test::exit_code(*st) == 128 + SIGTERM);
  CHECK(std::chrono::steady_clock::now() - t0 < 4s);
  // torchrun's --shutdown-timeout spelling of --grace-period.
  CHECK(run_captured(dir, "--shutdown-timeout 1 --nproc-per-node 1 /bin/true") == 0);
}

TEST_CASE("ptrun: every line a rank writes carries its rank", "[ptrun]") {
  TempDir dir;
  // Many lines from each of 3 ranks at once, the last one without a newline.
  const std::string prog = "'for i in $(seq 200); do echo line $RANK $i; done; echo oops $RANK >&2; printf tail$RANK'";
  REQUIRE(run_captured(dir, "--nproc-per-node 3 /bin/sh -c " + prog) == 0);
  std::map<std::string, int> per_prefix;
  for (const auto& line : lines_of(ptrain_test::read_text(dir.file("out")))) {
    INFO(line);
    REQUIRE(line.rfind("[default", 0) == 0);
    const std::string rank = line.substr(8, line.find(']') - 8);
    const std::string body = line.substr(line.find("]:") + 2);
    CHECK((body.rfind("line " + rank + " ", 0) == 0 || body == "tail" + rank));
    ++per_prefix[rank];
  }
  CHECK(per_prefix == std::map<std::string, int>{{"0", 201}, {"1", 201}, {"2", 201}});
  const std::string err = ptrain_test::read_text(dir.file("err"));
  for (int r = 0; r < 3; ++r) CHECK(err.find("[default" + std::to_string(r) + "]:oops " + std::to_string(r)) != std::string::npos);

  // A template of one's own, and none.
  REQUIRE(run_captured(dir, "--nproc-per-node 2 --role trainer --log-line-prefix-template '${role_name}/${local_rank}| ' "
                            "/bin/sh -c 'echo hi'") == 0);
  auto out = lines_of(ptrain_test::read_text(dir.file("out")));
  std::sort(out.begin(), out.end());
  CHECK(out == std::vector<std::string>{"trainer/0| hi", "trainer/1| hi"});
  REQUIRE(run_captured(dir, "--nproc-per-node 2 --log-line-prefix-template '' /bin/sh -c 'echo hi'") == 0);
  CHECK(ptrain_test::read_text(dir.file("out")) == "hi\nhi\n");
}

TEST_CASE("ptrun: --log-dir with --redirects and --tee writes each rank's streams to its files", "[ptrun]") {
  TempDir dir;
  const std::string logs = dir.file("logs");
  // stdout: to the files and the console (tee); stderr: to the files only (redirect).
  REQUIRE(run_captured(dir, "--nproc-per-node 2 --rdzv-id job7 --log-dir " + logs + " --redirects 2 --tee 1 "
                            "/bin/sh -c 'echo out $RANK; echo err $RANK >&2; exit 0'") == 0);
  const std::string err = ptrain_test::read_text(dir.file("err"));
  const std::size_t at = err.find(logs + "/job7_");
  REQUIRE(at != std::string::npos);
  const std::string run_dir = err.substr(at, err.find('\n', at) - at);
  for (int r = 0; r < 2; ++r) {
    const std::string d = run_dir + "/attempt_0/" + std::to_string(r);
    CHECK(ptrain_test::read_text(d + "/stdout.log") == "out " + std::to_string(r) + "\n");
    CHECK(ptrain_test::read_text(d + "/stderr.log") == "err " + std::to_string(r) + "\n");
    CHECK(err.find("err " + std::to_string(r)) == std::string::npos);
  }
  auto out = lines_of(ptrain_test::read_text(dir.file("out")));
  std::sort(out.begin(), out.end());
  CHECK(out == std::vector<std::string>{"[default0]:out 0", "[default1]:out 1"});
  // By local rank: rank 1's stdout only.
  TempDir d2;
  REQUIRE(run_captured(d2, "--nproc-per-node 2 --log-dir " + d2.file("logs") + " -r 0:0,1:1 /bin/sh -c 'echo o $RANK'") == 0);
  CHECK(ptrain_test::read_text(d2.file("out")) == "[default0]:o 0\n");
  CHECK(run_captured(d2, "--nproc-per-node 2 --tee 4 /bin/true") == 2);
  CHECK(ptrain_test::read_text(d2.file("err")).find("--tee '4'") != std::string::npos);
}

TEST_CASE("ptrun: torchrun's --nproc-per-node words and rendezvous flags", "[ptrun]") {
  TempDir dir;
  REQUIRE(run_captured(dir, "--nproc-per-node cpu /bin/sh -c 'echo $WORLD_SIZE'") == 0);
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  CHECK(lines_of(ptrain_test::read_text(dir.file("out"))).size() == static_cast<std::size_t>(cpus));
  if (!ptrain_test::file_exists("/dev/nvidia0")) {
    REQUIRE(run_captured(dir, "--nproc-per-node gpu /bin/true") == 2);
    CHECK(ptrain_test::read_text(dir.file("err")).find("no visible GPU") != std::string::npos);
  }
  CHECK(run_captured(dir, "--nproc-per-node two /bin/true") == 2);
  CHECK(ptrain_test::read_text(dir.file("err")).find("'two'") != std::string::npos);

  // c10d with an endpoint: the store's host and port.
  TempDir env;
  REQUIRE(run_captured(dir, "--nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:4711 --rdzv-conf "
                            "join_timeout=30 " PTRAIN_TEST_WORKER " env " + env.path()) == 0);
  auto kv = ptrain_test::read_kv(env.file("env_0"));
  CHECK(kv["MASTER_ADDR"] == "127.0.0.1");
  CHECK(kv["MASTER_PORT"] == "4711");
  CHECK(run_captured(dir, "--rdzv-backend etcd --rdzv-endpoint h:1 /bin/true") == 2);
  CHECK(ptrain_test::read_text(dir.file("err")).find("etcd is not supported") != std::string::npos);
  CHECK(run_captured(dir, "--rdzv-backend c10d /bin/true") == 2);
  CHECK(run_captured(dir, "--rdzv-conf bogus /bin/true") == 2);
  CHECK(ptrain_test::read_text(dir.file("err")).find("key=value") != std::string::npos);
}

TEST_CASE("ptrun: --rdzv-conf keys ptrun does not read are named in a warning and the job runs", "[ptrun]") {
  TempDir dir;
  REQUIRE(run_captured(dir, "--nproc-per-node 2 --rdzv-conf read_timeout=5,use_libuv=1,timeout=30 "
                            "/bin/sh -c 'echo ran $RANK'") == 0);
  auto out = lines_of(ptrain_test::read_text(dir.file("out")));
  std::sort(out.begin(), out.end());
  CHECK(out == std::vector<std::string>{"[default0]:ran 0", "[default1]:ran 1"});
  const auto warnings = lines_of(ptrain_test::read_text(dir.file("err")));
  REQUIRE(warnings.size() == 1);  // once, for every key it ignores
  CHECK(warnings[0].find("warning") != std::string::npos);
  CHECK(warnings[0].find("'read_timeout', 'use_libuv'") != std::string::npos);
  CHECK(warnings[0].find("'timeout'") == std::string::npos);  // read, as --rdzv-timeout
  CHECK(run_captured(dir, "--rdzv-conf timeout=soon /bin/true") == 2);
  CHECK(ptrain_test::read_text(dir.file("err")).find("timeout=soon") != std::string::npos);
}

TEST_CASE("ptrun: --local-ranks-filter shows only the listed local ranks' output", "[ptrun]") {
  TempDir dir;
  const std::string prog = " /bin/sh -c 'echo out $RANK; echo err $RANK >&2'";
  REQUIRE(run_captured(dir, "--nproc-per-node 3 --local-ranks-filter 1" + prog) == 0);
  CHECK(ptrain_test::read_text(dir.file("out")) == "[default1]:out 1\n");
  CHECK(ptrain_test::read_text(dir.file("err")) == "[default1]:err 1\n");
  REQUIRE(run_captured(dir, "--nproc-per-node 3 --local_ranks_filter 0,2" + prog) == 0);
  auto out = lines_of(ptrain_test::read_text(dir.file("out")));
  std::sort(out.begin(), out.end());
  CHECK(out == std::vector<std::string>{"[default0]:out 0", "[default2]:out 2"});
  // Without a prefix the shown rank keeps ptrun's streams; the others write nowhere.
  REQUIRE(run_captured(dir, "--nproc-per-node 2 --local-ranks-filter 0 --log-line-prefix-template ''" + prog) == 0);
  CHECK(ptrain_test::read_text(dir.file("out")) == "out 0\n");
  CHECK(ptrain_test::read_text(dir.file("err")) == "err 0\n");

  // With --tee a filtered-out rank's streams still go to its log files, as under torchrun.
  TempDir d2;
  REQUIRE(run_captured(d2, "--nproc-per-node 2 --rdzv-id job8 --log-dir " + d2.file("logs") +
                           " --tee 3 --local-ranks-filter 0" + prog) == 0);
  CHECK(ptrain_test::read_text(d2.file("out")) == "[default0]:out 0\n");
  const std::string err = ptrain_test::read_text(d2.file("err"));
  CHECK(err.find("err 1") == std::string::npos);
  const std::size_t at = err.find(d2.file("logs") + "/job8_");
  REQUIRE(at != std::string::npos);
  const std::string rank1 = err.substr(at, err.find('\n', at) - at) + "/attempt_0/1";
  CHECK(ptrain_test::read_text(rank1 + "/stdout.log") == "out 1\n");
  CHECK(ptrain_test::read_text(rank1 + "/stderr.log") == "err 1\n");

  for (const char* bad : {"2", "x", "-1", "0,"}) {
    INFO(bad);
    CHECK(run_captured(dir, std::string("--nproc-per-node 2 --local-ranks-filter '") + bad + "' /bin/true") == 2);
    const std::string e = ptrain_test::read_text(dir.file("err"));
    CHECK(e.find("--local-ranks-filter") != std::string::npos);
    CHECK(e.find(std::string("'") + (std::string(bad) == "0," ? "" : bad) + "'") != std::string::npos);
  }
}

TEST_CASE("ptrun: torchrun's --start-method, --local-addr and --logs-specs are accepted", "[ptrun]") {
  TempDir dir;
  for (const char* flags : {"--start-method fork", "--start_method spawn --local-addr 10.1.2.3",
                            "--start-method forkserver --local_addr node0"}) {
    INFO(flags);
    REQUIRE(run_captured(dir, std::string("--nproc-per-node 2 ") + flags + " /bin/sh -c 'echo ok $RANK'") == 0);
    auto out = lines_of(ptrain_test::read_text(dir.file("out")));
    std::sort(out.begin(), out.end());
    CHECK(out == std::vector<std::string>{"[default0]:ok 0", "[default1]:ok 1"});
    CHECK(ptrain_test::read_text(dir.file("err")).empty());
  }
  // A log-specs plugin does not apply: a warning, and the job runs.
  REQUIRE(run_captured(dir, "--nproc-per-node 2 --logs-specs mylogs /bin/sh -c 'echo ok $RANK'") == 0);
  CHECK(lines_of(ptrain_test::read_text(dir.file("out"))).size() == 2);
  CHECK(ptrain_test::read_text(dir.file("err")).find("warning: --logs-specs mylogs") != std::string::npos);
  CHECK(run_captured(dir, "--nproc-per-node 2 --start-method thread /bin/true") == 2);
  CHECK(ptrain_test::read_text(dir.file("err")).find("'thread'") != std::string::npos);
}

namespace {
// One elastic ptrun "node" on this machine: --nnodes MIN:MAX, one rank, the worker's elastic mode.
// Every node but the first is told not to serve the store (on one machine each could).
// A lost node counts against --max-restarts, as under torchrun.
Process elastic_node(const std::string& nnodes, int port, const TempDir& dir, double seconds, bool first = false) {
  std::vector<std::string> args{"--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d",
                                "--rdzv-endpoint", "127.0.0.1:" + std::to_string(port), "--monitor-interval",
                                "0.05", "--rdzv-conf", std::string("last_call_timeout=1,join_timeout=20,") +
                                "keep_alive_interval=0.5,keep_alive_max_attempt=4,is_host=" + (first ? "1" : "0"),
                                // a node the test ends with SIGKILL cannot remove its log folder: keep it in `dir`
                                "--log-dir", dir.file("logs")};
  for (std::string a : {std::string(PTRAIN_TEST_WORKER), std::string("elastic"), dir.path(), std::to_string(seconds)})
    args.push_back(a);
  return Process(ptrun(args));
}
}  // namespace

TEST_CASE("ptrun: an elastic job grows when a node comes", "[ptrun][elastic]") {
  TempDir dir;
  const int port = ptrain_test::free_port();
  Process a = elastic_node("1:2", port, dir, 6, true);
  REQUIRE(ptrain_test::wait_for_file(dir.file("world_1_0"), 20s));  // round 0: node a alone
  Process b = elastic_node("1:2", port, dir, 1);
  auto sb = b.wait(60s), sa = a.wait(60s);
  REQUIRE((sa && sb));
  CHECK(ptrain_test::exit_code(*sa) == 0);
  CHECK(ptrain_test::exit_code(*sb) == 0);
  CHECK(ptrain_test::file_exists(dir.file("term_0")));  // round 0's rank was stopped to re-form
  // Round 1: both nodes, node a (the store's host) is node 0.
  CHECK(ptrain_test::read_text(dir.file("world_2_0")) == "0 2\n");
  CHECK(ptrain_test::read_text(dir.file("world_2_1")) == "1 2\n");
}

TEST_CASE("ptrun: an elastic job goes on without a node that leaves", "[ptrun][elastic]") {
  TempDir dir;
  const int port = ptrain_test::free_port();
  Process a = elastic_node("1:2", port, dir, 4, true);
  Process b = elastic_node("1:2", port, dir, 30);
  REQUIRE(ptrain_test::wait_for_file(dir.file("world_2_1"), 20s));
  ::kill(b.pid(), SIGTERM);  // node b is reclaimed: its rank exits 75 (a checkpoint), so does ptrun
  auto sb = b.wait(30s);
  REQUIRE(sb.has_value());
  CHECK(ptrain_test::exit_code(*sb) == 75);
  auto sa = a.wait(60s);
  REQUIRE(sa.has_value());
  CHECK(ptrain_test::exit_code(*sa) == 0);
  CHECK(ptrain_test::read_text(dir.file("world_1_0")) == "0 1\n");  // the next round on node a alone

  // A node that comes while the job runs on its most nodes is refused.
  TempDir d2;
  const int port2 = ptrain_test::free_port();
  Process c = elastic_node("1:2", port2, d2, 8, true), d = elastic_node("1:2", port2, d2, 8);
  REQUIRE(ptrain_test::wait_for_file(d2.file("world_2_1"), 20s));
  TempDir d3;
  Process e = elastic_node("1:2", port2, d3, 1);
  auto se = e.wait(30s);
  REQUIRE(se.has_value());
  CHECK(ptrain_test::exit_code(*se) == 1);
  CHECK_FALSE(ptrain_test::file_exists(d3.file("world_3_2")));
}

TEST_CASE("ptrun: when an elastic job's store host is lost, the other nodes end with an error", "[ptrun][elastic]") {
  TempDir dir;
  const int port = ptrain_test::free_port();
  Process a = elastic_node("1:2", port, dir, 60, true);
  Process b = elastic_node("1:2", port, dir, 60);
  REQUIRE(ptrain_test::wait_for_file(dir.file("world_2_1"), 20s));
  ::kill(a.pid(), SIGKILL);
  // Its rank sleeps 60 s and would end with 0; the lost store host ends the node with 1.
  auto sb = b.wait(120s);
  REQUIRE(sb.has_value());
  CHECK(ptrain_test::exit_code(*sb) == 1);
}

TEST_CASE("ptrun: an elastic job notices a lost node by its heartbeat and goes on without it", "[ptrun][elastic]") {
  TempDir dir;
  const int port = ptrain_test::free_port();
  Process a = elastic_node("1:2", port, dir, 20, true);
  Process b = elastic_node("1:2", port, dir, 60);
  REQUIRE(ptrain_test::wait_for_file(dir.file("world_2_1"), 20s));
  // Node b's ptrun stops without a word (SIGSTOP: as a machine cut off); its rank runs on,
  // silent, so only the missing heartbeat (2 s here) tells node 0.
  ::kill(b.pid(), SIGSTOP);
  REQUIRE(ptrain_test::wait_for_file(dir.file("world_1_0"), 30s));  // the next round: node a alone
  ::kill(b.pid(), SIGKILL);
  b.wait(10s);
  ::kill(a.pid(), SIGTERM);
  auto sa = a.wait(30s);
  REQUIRE(sa.has_value());
  CHECK(ptrain_test::exit_code(*sa) == 75);
}

TEST_CASE("ptrun: an elastic job's failures count against --max-restarts", "[ptrun][elastic]") {
  TempDir dir;
  const int port = ptrain_test::free_port();
  // Rank 0 fails in every round: one restart, then both nodes stop with its status.
  std::vector<Process> nodes;
  for (int i = 0; i < 2; ++i)
    nodes.emplace_back(ptrun({"--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                              "127.0.0.1:" + std::to_string(port), "--max-restarts", "1", "--monitor-interval", "0.05",
                              "--rdzv-conf", "last_call_timeout=1", PTRAIN_TEST_WORKER, "flaky", "0", "5",
                              dir.path()}));
  for (auto& n : nodes) {
    auto st = n.wait(60s);
    REQUIRE(st.has_value());
    CHECK(ptrain_test::exit_code(*st) != 0);
  }
  // c10d without --node-rank: node ranks by arrival; rounds 0 and 1 ran, round 2 did not.
  for (int r = 0; r < 2; ++r) {
    CHECK(ptrain_test::file_exists(dir.file("round_1_" + std::to_string(r))));
    CHECK_FALSE(ptrain_test::file_exists(dir.file("round_2_" + std::to_string(r))));
  }
}

}  // namespace test_ptrun
