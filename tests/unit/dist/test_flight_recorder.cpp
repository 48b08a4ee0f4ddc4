// The flight recorder's ring, states, labels and dumps on one process
// (SelfCommunicator); tests/dist/comm/test_flight_recorder.cpp runs real ranks.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "ptrain/dist/flight_recorder.hpp"
#include "ptrain/dist/self_communicator.hpp"

namespace test_flight_recorder {

using namespace ptrain;
using namespace ptrain::dist;

TEST_CASE("flight recorder keeps the last N operations with sequence numbers, states and labels", "[dist][flight]") {
  RecordingCommunicator c(std::make_unique<SelfCommunicator>(), "world", 4);
  std::vector<float> a(8, 1.0f), b(8);
  c.all_reduce(a.data(), b.data(), 8, DType::F32, ReduceOp::Sum);  // #1, leaves the ring
  {
    CollectiveLabel l("outer");
    c.broadcast(a.data(), 8, DType::F32, 0);  // #2
    CollectiveLabel inner("inner");
    c.all_gather(a.data(), b.data(), 8, DType::F32);  // #3
  }
  auto pending = c.all_reduce_async(a.data(), a.data(), 3, DType::F64, ReduceOp::Max);  // #4, not waited yet
  c.barrier();                                                                            // #5

  auto e = c.recorder().entries();
  REQUIRE(e.size() == 4);
  CHECK(e[0].seq == 2);
  CHECK(e[0].op == "broadcast");
  CHECK(e[0].root == 0);
  CHECK(e[0].label == "outer");
  CHECK(e[1].label == "inner");
  CHECK(e[1].op == "all_gather");
  CHECK(e[2].seq == 4);
  CHECK(e[2].count == 3);
  CHECK(e[2].dtype == DType::F64);
  CHECK(e[2].reduce_op == "max");
  CHECK(e[2].state == "started");
  CHECK(e[2].end_us == 0);
  CHECK(e[3].op == "barrier");
  CHECK(e[3].label.empty());
  CHECK(e[3].state == "completed");
  CHECK(e[3].end_us >= e[3].start_us);
  pending->wait();
  CHECK(c.recorder().entries()[2].state == "completed");
}

TEST_CASE("flight recorder: all-to-alls with their sizes, in the ring and the JSON", "[dist][flight]") {
  RecordingCommunicator c(std::make_unique<SelfCommunicator>(), "world", 4);
  std::vector<float> a(8, 1.0f), b(8);
  c.all_to_all(a.data(), b.data(), 8, DType::F32);
  const std::size_t send = 5, recv = 5;
  c.all_to_all_v(a.data(), &send, b.data(), &recv, DType::BF16);
  auto e = c.recorder().entries();
  REQUIRE(e.size() == 2);
  CHECK(e[0].op == "all_to_all");
  CHECK(e[0].count == 8);  // per rank
  CHECK(e[0].send_counts.empty());
  CHECK(e[1].seq == 2);
  CHECK(e[1].op == "all_to_all_v");
  CHECK(e[1].count == 5);  // sent
  CHECK(e[1].dtype == DType::BF16);
  CHECK(e[1].send_counts == std::vector<std::size_t>{5});
  CHECK(e[1].recv_counts == std::vector<std::size_t>{5});
  CHECK(e[1].state == "completed");
  const nlohmann::json j = c.recorder().to_json();
  CHECK(j["ops"][1]["send_counts"] == nlohmann::json::array({5}));
  CHECK(j["ops"][1]["recv_counts"] == nlohmann::json::array({5}));
  CHECK_FALSE(j["ops"][0].contains("send_counts"));
}

TEST_CASE("flight recorder: a failed call is recorded as failed", "[dist][flight]") {
  RecordingCommunicator c(std::make_unique<SelfCommunicator>(), "world", 8);
  std::vector<float> a(4);
  CHECK_THROWS_AS(c.broadcast(a.data(), 4, DType::F32, 3), CommError);  // root outside the group of one
  auto e = c.recorder().entries();
  REQUIRE(e.size() == 1);
  CHECK(e[0].state == "failed");
  CHECK(e[0].error.find("[ptrain.comm.root]") != std::string::npos);
}

TEST_CASE("flight recorder dumps every live recorder on SIGUSR2 from its watcher thread", "[dist][flight]") {
  const std::string dir = "/tmp/ptrain_flight_unit_" + std::to_string(::getpid());
  REQUIRE(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()) == 0);
  ::setenv("PTRAIN_FLIGHT_RECORDER_DIR", dir.c_str(), 1);
  {
    RecordingCommunicator c(std::make_unique<SelfCommunicator>(), "world", 16);
    auto child = c.split(0, 0);
    REQUIRE(child != nullptr);
    std::vector<std::int32_t> v(5, 2);
    child->all_reduce(v.data(), 5, DType::I32, ReduceOp::Sum);
    ::raise(SIGUSR2);
    const std::string path = dir + "/rank0.json";
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (::access(path.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::ifstream f(path);
    REQUIRE(f.good());
    auto doc = nlohmann::json::parse(f);
    CHECK(doc["reason"] == "signal " + std::to_string(SIGUSR2));
    CHECK(doc["rank"] == 0);
    bool saw_world = false, saw_child = false;
    for (const auto& g : doc["groups"]) {
      if (g["group"] == "world") {
        saw_world = true;
        REQUIRE(g["ops"].size() == 1);
        CHECK(g["ops"][0]["op"] == "split");
      }
      if (g["group"] == "world/split1.0") {
        saw_child = true;
        REQUIRE(g["ops"].size() == 1);
        CHECK(g["ops"][0]["op"] == "all_reduce");
        CHECK(g["ops"][0]["dtype"] == "I32");
        CHECK(g["ops"][0]["count"] == 5);
        CHECK(g["ops"][0]["state"] == "completed");
      }
    }
    CHECK(saw_world);
    CHECK(saw_child);
  }
  ::unsetenv("PTRAIN_FLIGHT_RECORDER_DIR");
  std::system(("rm -rf " + dir).c_str());
}

TEST_CASE("flight recorder: its folder is made at start-up, and one that cannot be written is refused",
          "[dist][flight]") {
  const std::string dir = "/tmp/ptrain_flight_dir_" + std::to_string(::getpid());
  REQUIRE(std::system(("rm -rf " + dir + " && mkdir -p " + dir + " && echo x > " + dir + "/a_file").c_str()) == 0);
  // Below a regular file nothing can be created, whoever runs the test (root included).
  ::setenv("PTRAIN_FLIGHT_RECORDER_DIR", (dir + "/a_file/fr").c_str(), 1);
  CHECK_THROWS_WITH(RecordingCommunicator(std::make_unique<SelfCommunicator>(), "world", 16),
                    Catch::Contains("[ptrain.flight.dir]") && Catch::Contains(dir + "/a_file/fr") &&
                        Catch::Contains("writable folder"));
  // A folder that does not exist yet (and its parent) is made when the first recorder starts.
  ::setenv("PTRAIN_FLIGHT_RECORDER_DIR", (dir + "/new/fr").c_str(), 1);
  {
    RecordingCommunicator c(std::make_unique<SelfCommunicator>(), "world", 16);
    CHECK(::access((dir + "/new/fr").c_str(), W_OK) == 0);
  }
  ::unsetenv("PTRAIN_FLIGHT_RECORDER_DIR");
  std::system(("rm -rf " + dir).c_str());
}

}  // namespace test_flight_recorder
