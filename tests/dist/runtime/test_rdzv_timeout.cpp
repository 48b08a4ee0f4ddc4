// PTRAIN_RDZV_TIMEOUT_S: the first rendezvous (reaching the store, every rank joining it)
// may take longer than the communicator's timeout, and after it the store waits only as
// long as the communicator's timeout. Two ranks as two threads of this process, each
// with its own TCPStore client (rank 0 serves), on loopback; one of them starts late.

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "process_util.hpp"
#include "ptrain/dist/process_group.hpp"

namespace test_rdzv_timeout {

using namespace ptrain::dist;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

LaunchEnv rank_env(int rank, int port) {
  LaunchEnv e;
  e.rank = rank;
  e.world_size = 2;
  e.master_addr = "127.0.0.1";
  e.master_port = port;
  e.launcher = Launcher::IndexedJob;
  return e;
}

// One rank's rendezvous, started after `delay`; the store, or the error's message.
struct Joined {
  std::shared_ptr<Store> store;
  std::string error;
  std::chrono::milliseconds took{0};
};

Joined join(int rank, int port, std::chrono::milliseconds delay, std::chrono::milliseconds timeout,
            std::optional<std::chrono::milliseconds> rdzv) {
  std::this_thread::sleep_for(delay);
  Joined j;
  const auto t0 = Clock::now();
  try {
    j.store = detail::rendezvous_store(rank_env(rank, port), timeout, rdzv);
  } catch (const ptrain::CommError& e) {
    j.error = e.what();
  }
  j.took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  return j;
}

// Runs rank 0 and rank 1 at once, each after its delay.
std::pair<Joined, Joined> run_pair(std::chrono::milliseconds delay0, std::chrono::milliseconds delay1,
                                   std::chrono::milliseconds timeout, std::optional<std::chrono::milliseconds> rdzv) {
  const int port = ptrain_test::free_port();
  Joined j0, j1;
  std::thread t0([&] { j0 = join(0, port, delay0, timeout, rdzv); });
  std::thread t1([&] { j1 = join(1, port, delay1, timeout, rdzv); });
  t0.join();
  t1.join();
  return {std::move(j0), std::move(j1)};
}

// Restores one variable at scope exit.
struct EnvGuard {
  explicit EnvGuard(const char* n) : name(n) {
    if (const char* v = std::getenv(n)) old = v;
  }
  ~EnvGuard() {
    if (old) ::setenv(name, old->c_str(), 1);
    else ::unsetenv(name);
  }
  const char* name;
  std::optional<std::string> old;
};

}  // namespace

TEST_CASE("PTRAIN_RDZV_TIMEOUT_S: unset means none; seconds from 0.001 to 1e7, else an error", "[rdzv_timeout]") {
  EnvGuard guard("PTRAIN_RDZV_TIMEOUT_S");
  ::unsetenv("PTRAIN_RDZV_TIMEOUT_S");
  CHECK_FALSE(rdzv_timeout_from_env().has_value());
  CHECK_FALSE(ProcessGroupOptions{}.rdzv_timeout.has_value());
  ::setenv("PTRAIN_RDZV_TIMEOUT_S", "", 1);
  CHECK_FALSE(rdzv_timeout_from_env().has_value());
  ::setenv("PTRAIN_RDZV_TIMEOUT_S", "900", 1);
  CHECK(rdzv_timeout_from_env() == std::chrono::milliseconds(900'000));
  CHECK(ProcessGroupOptions{}.rdzv_timeout == std::chrono::milliseconds(900'000));
  ::setenv("PTRAIN_RDZV_TIMEOUT_S", "0.25", 1);
  CHECK(rdzv_timeout_from_env() == std::chrono::milliseconds(250));
  for (const char* bad : {"0.0001", "0", "-3", "abc", "1e9", "10s"}) {
    ::setenv("PTRAIN_RDZV_TIMEOUT_S", bad, 1);
    CHECK_THROWS_WITH(rdzv_timeout_from_env(), Catch::Contains("[ptrain.comm.rdzv_timeout_env]") &&
                                                   Catch::Contains("PTRAIN_RDZV_TIMEOUT_S='"));
  }
}

TEST_CASE("rendezvous timeout: a rank 0 that starts after the communicator timeout", "[rdzv_timeout]") {
  const auto timeout = 300ms, late = 1500ms;
  SECTION("without it the other rank gives up connecting") {
    auto [j0, j1] = run_pair(late, 0ms, timeout, std::nullopt);
    CHECK(j1.error.find("[ptrain.store.connect]") != std::string::npos);
    CHECK(j1.took < late);
  }
  SECTION("with it both join, and the store then waits only the communicator timeout") {
    auto [j0, j1] = run_pair(late, 0ms, timeout, 20'000ms);
    REQUIRE(j0.error.empty());
    REQUIRE(j1.error.empty());
    CHECK(j1.took >= late - 100ms);
    CHECK(j0.store->timeout() == timeout);
    CHECK(j1.store->timeout() == timeout);
    // The store works, and a wait for a key nobody sets ends after the short timeout.
    j1.store->set("k", "v");
    CHECK(j0.store->get("k") == "v");
    const auto t0 = Clock::now();
    CHECK_THROWS_WITH(j1.store->get("never"), Catch::Contains("[ptrain.store.timeout]"));
    CHECK(Clock::now() - t0 < 5s);
    j1.store.reset();  // rank 0 serves: it goes last
  }
}

TEST_CASE("rendezvous timeout: rank 0 waits for a late rank, and names one that never comes", "[rdzv_timeout]") {
  const auto timeout = 300ms, late = 1500ms;
  SECTION("a late rank joins within the rendezvous timeout") {
    auto [j0, j1] = run_pair(0ms, late, timeout, 20'000ms);
    REQUIRE(j0.error.empty());
    REQUIRE(j1.error.empty());
    // Rank 0 returned only once rank 1 had joined: the barrier, under the long timeout.
    CHECK(j0.took >= late - 100ms);
    j1.store.reset();
  }
  SECTION("without a rendezvous timeout no barrier is added") {
    // Rank 1 is never started: the store alone does not wait for it (the backend's
    // own connection does, under the communicator's timeout).
    Joined j0 = join(0, ptrain_test::free_port(), 0ms, timeout, std::nullopt);
    REQUIRE(j0.error.empty());
    CHECK(j0.took < 5s);
  }
  SECTION("a rank that never comes fails rank 0 after the rendezvous timeout, named") {
    Joined j0 = join(0, ptrain_test::free_port(), 0ms, timeout, 1500ms);
    CHECK(j0.error.find("[ptrain.store.barrier_timeout]") != std::string::npos);
    CHECK(j0.error.find("missing ranks: 1") != std::string::npos);
    CHECK(j0.took >= 1400ms);
  }
}

#ifdef PTRAIN_GLOO
TEST_CASE("init_process_group (Gloo): a rank later than the communicator timeout joins within PTRAIN_RDZV_TIMEOUT_S",
          "[rdzv_timeout]") {
  EnvGuard guard("PTRAIN_RDZV_TIMEOUT_S");
  const auto timeout = 300ms, late = 1500ms;
  auto run = [&](bool with_rdzv) {
    if (with_rdzv) ::setenv("PTRAIN_RDZV_TIMEOUT_S", "20", 1);
    else ::unsetenv("PTRAIN_RDZV_TIMEOUT_S");
    const int port = ptrain_test::free_port();
    std::string errors[2];
    double sums[2] = {0, 0};
    std::unique_ptr<Communicator> comms[2];
    auto rank_main = [&](int rank) {
      if (rank == 1) std::this_thread::sleep_for(late);
      try {
        ProcessGroupOptions o;  // reads PTRAIN_RDZV_TIMEOUT_S, as a program does
        o.backend = "gloo";
        o.timeout = timeout;
        o.env = rank_env(rank, port);
        comms[rank] = init_process_group(o);
        double x = rank + 1.0;
        comms[rank]->all_reduce(&x, 1, ptrain::DType::F64, ReduceOp::Sum);
        sums[rank] = x;
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    };
    std::thread t0(rank_main, 0), t1(rank_main, 1);
    t0.join();
    t1.join();
    return std::make_pair(std::move(errors[0]), sums[0] + sums[1]);
  };
  SECTION("without it rank 0 gives up before rank 1 comes") {
    auto [error0, total] = run(false);
    CHECK_FALSE(error0.empty());
  }
  SECTION("with it both ranks meet and reduce") {
    auto [error0, total] = run(true);
    CHECK(error0.empty());
    CHECK(total == 6.0);  // each rank's sum is 1 + 2
  }
}
#endif

}  // namespace test_rdzv_timeout
