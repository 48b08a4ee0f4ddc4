// The flight recorder end to end ("[.flight_recorder]", run by CTest as one
// process): this test spawns three Gloo ranks of itself with
// PTRAIN_FLIGHT_RECORDER_DIR set. They run four labelled all-reduces; then
//  - hang: rank 2 sleeps instead of calling the fifth; ranks 0 and 1 time out in
//    it and dump on their own; rank 2 dumps on SIGUSR2 from this test while it
//    sleeps (the watcher thread, Note [Flight recorder]);
//  - mismatch: rank 1 calls broadcast where the others call all_reduce; the
//    fingerprint check fails it on every rank and each dumps.
// tools/flight_recorder.py must then name the rank and the operation.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <memory>
#include <thread>

#include "comm_util.hpp"
#include "dist/spawn_util.hpp"
#include "ptrain/dist/flight_recorder.hpp"

namespace test_flight_recorder {

using namespace comm_test;

namespace {

constexpr std::size_t kCount = 1000;

bool file_exists(const std::string& p) { return ::access(p.c_str(), F_OK) == 0; }

// Runs `cmd` and returns its standard output.
std::string run_output(const std::string& cmd) {
  std::string out;
  std::unique_ptr<FILE, int (*)(FILE*)> p(::popen(cmd.c_str(), "r"), ::pclose);
  REQUIRE(p != nullptr);
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), static_cast<int>(buf.size()), p.get()) != nullptr) out += buf.data();
  return out;
}

// Spawns three ranks of scenario `scenario` with culprit rank `culprit`; returns the analyser's output.
std::string run_scenario(const std::string& scenario, int culprit) {
  const int world = 3, timeout_s = 3;
  const std::string dir = "/tmp/ptrain_flight_" + scenario + "_" + std::to_string(::getpid());
  REQUIRE(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()) == 0);
  const std::string exe = ptrain::testing::self_exe(), port = std::to_string(ptrain::testing::free_port());
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ptrain::testing::set_gloo_rank_env(r, world, port, timeout_s, dir);
      ::setenv("PTRAIN_FLIGHT_RECORDER_DIR", dir.c_str(), 1);
      ::setenv("PTRAIN_FLIGHT_RECORDER_SIZE", "3", 1);  // small: the ring must wrap
      ::setenv("PTRAIN_FR_SCENARIO", scenario.c_str(), 1);
      ::setenv("PTRAIN_FR_CULPRIT", std::to_string(culprit).c_str(), 1);
      ::execl(exe.c_str(), exe.c_str(), "[.flight_child]", "--reporter", "compact", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  auto dump_of = [&](int r) { return dir + "/rank" + std::to_string(r) + ".json"; };
  auto wait_for = [&](auto done, int seconds) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
    for (;;) {
      if (done()) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  };
  // Every rank but the sleeping culprit ends by itself, after dumping.
  std::vector<int> status(world, -1);
  for (int r = 0; r < world; ++r) {
    if (scenario == "hang" && r == culprit) continue;
    INFO("rank " << r);
    CHECK(wait_for([&] { return ::waitpid(pids[r], &status[r], WNOHANG) == pids[r]; }, 30));
    CHECK(file_exists(dump_of(r)));
  }
  if (scenario == "hang") {
    CHECK_FALSE(file_exists(dump_of(culprit)));  // it sleeps outside any collective: no error, no dump yet
    ::kill(pids[culprit], SIGUSR2);
    CHECK(wait_for([&] { return file_exists(dump_of(culprit)); }, 10));
    ::kill(pids[culprit], SIGKILL);
  }
  for (int r = 0; r < world; ++r) {
    if (status[r] != -1) continue;
    ::kill(pids[r], SIGKILL);
    ::waitpid(pids[r], &status[r], 0);
  }
  std::string out = run_output("python3 " PTRAIN_TOOLS_DIR "/flight_recorder.py " + dir + " 2>&1");
  if (std::getenv("PTRAIN_FR_KEEP") == nullptr) std::system(("rm -rf " + dir).c_str());
  return out;
}

}  // namespace

TEST_CASE("flight recorder child (spawned by [.flight_recorder])", "[.flight_child]") {
  auto c = init_process_group();
  REQUIRE(c->backend() == "gloo");
  const std::string scenario = std::getenv("PTRAIN_FR_SCENARIO");
  const int culprit = std::atoi(std::getenv("PTRAIN_FR_CULPRIT"));
  std::vector<float> buf(kCount, 1.0f);
  {
    ptrain::dist::CollectiveLabel label("warmup");
    for (int i = 0; i < 4; ++i) c->all_reduce(buf.data(), kCount, DType::F32, ReduceOp::Sum);
  }
  ptrain::dist::CollectiveLabel label("step");
  try {
    if (scenario == "hang" && c->rank() == culprit) {
      std::this_thread::sleep_for(std::chrono::seconds(60));  // the test kills this rank long before
    } else if (scenario == "mismatch" && c->rank() == culprit) {
      c->broadcast(buf.data(), kCount, DType::F32, 0);
    } else {
      c->all_reduce(buf.data(), kCount, DType::F32, ReduceOp::Sum);
    }
  } catch (const CommError&) {
    std::_Exit(0);  // dumped already; skip the teardown barrier of a broken group
  }
  std::_Exit(1);
}

TEST_CASE("flight recorder: the analyser names the rank that never arrived", "[.flight_recorder]") {
  std::string out = run_scenario("hang", 2);
  INFO(out);
  CHECK(out.find("VERDICT: group world: rank 2 never arrived at collective #5 all_reduce(F32 x 1000, sum) "
                 "[label step]; ranks 0,1 issued it (failed)") != std::string::npos);
  CHECK(out.find("rank 2's last collective: #4 all_reduce(F32 x 1000, sum) (completed)") != std::string::npos);
  CHECK(out.find("VERDICT") == out.rfind("VERDICT"));  // one verdict only
}

TEST_CASE("flight recorder: the analyser names the rank that called another collective", "[.flight_recorder]") {
  std::string out = run_scenario("mismatch", 1);
  INFO(out);
  CHECK(out.find("VERDICT: group world: collective #5 differs across ranks: ranks 0,2 called all_reduce(F32 x "
                 "1000, sum); rank 1 called broadcast(F32 x 1000, root 0)") != std::string::npos);
}

}  // namespace test_flight_recorder
