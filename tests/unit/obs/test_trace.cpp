// The tracer's step window, its Chrome-trace file and the collective spans of
// the recording communicator, read back with nlohmann::json.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "ptrain/dist/flight_recorder.hpp"
#include "ptrain/dist/self_communicator.hpp"
#include "ptrain/obs/trace.hpp"

namespace test_trace {

using namespace ptrain;

TEST_CASE("tracer records spans only inside its step window and writes a Chrome trace", "[obs][trace]") {
  const std::string dir = "/tmp/ptrain_trace_unit_" + std::to_string(::getpid());
  REQUIRE(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()) == 0);
  obs::Tracer& t = obs::Tracer::get();
  t.configure({.dir = dir, .first_step = 2, .last_step = 3, .nvtx = false}, 5);
  dist::RecordingCommunicator comm(std::make_unique<dist::SelfCommunicator>(), "world", 8);
  std::vector<float> buf(16, 1.0f);
  for (std::int64_t step = 1; step <= 4; ++step) {
    t.step(step);
    CHECK(obs::tracing() == (step == 2 || step == 3));
    obs::Span s("work", "test", step);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    dist::CollectiveLabel label("grads");
    comm.all_reduce(buf.data(), buf.size(), DType::F32, dist::ReduceOp::Sum);
  }
  CHECK_FALSE(obs::tracing());
  std::ifstream f(dir + "/trace_rank5.json");
  REQUIRE(f.good());
  const auto doc = nlohmann::json::parse(f);
  std::map<std::string, int> count;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M") continue;
    CHECK(e["pid"] == 5);
    count[e["name"].get<std::string>()]++;
    if (e["name"] == "work") {
      const auto n = e["args"]["n"].get<int>();
      CHECK((n == 2 || n == 3));  // steps 1 and 4 are outside the window
      CHECK(e["dur"].get<double>() >= 2000.0);
    }
    if (e["ph"] == "X") CHECK(e["dur"].get<double>() >= 0);
  }
  CHECK(count["work"] == 2);
  CHECK(count["comm.all_reduce grads"] == 2);
  CHECK(count["step"] == 2);
  CHECK(t.flush().empty());  // written once
  std::system(("rm -rf " + dir).c_str());
}

TEST_CASE("the trace folder is made and proved writable when the tracer is configured", "[obs][trace]") {
  // Issue 44: a folder that cannot be written is an error at start-up naming it, not after the traced steps.
  const std::string dir = "/tmp/ptrain_trace_dir_" + std::to_string(::getpid());
  REQUIRE(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()) == 0);
  std::ofstream(dir + "/a_file") << "not a directory";
  obs::Tracer& t = obs::Tracer::get();
  const std::string below_file = dir + "/a_file/trace";  // nothing can be made below a file, even by root
  CHECK_THROWS_WITH(t.configure({.dir = below_file, .first_step = 1, .last_step = 1, .nvtx = false}, 3),
                    Catch::Contains("[ptrain.trace.dir]") && Catch::Contains("rank 3") &&
                        Catch::Contains(below_file) && Catch::Contains("--trace-dir"));
  t.configure({.dir = dir + "/new/trace", .first_step = 1, .last_step = 1, .nvtx = false}, 3);
  CHECK(std::filesystem::is_directory(dir + "/new/trace"));
  CHECK(std::filesystem::is_empty(dir + "/new/trace"));  // the probe is gone
  t.configure({.dir = "", .first_step = 1, .last_step = 1, .nvtx = false}, 3);
  std::system(("rm -rf " + dir).c_str());
}

TEST_CASE("trace window from the environment is checked", "[obs][trace]") {
  ::setenv("PTRAIN_TRACE_STEPS", "7:9", 1);
  auto o = obs::trace_options_from_env();
  CHECK(o.first_step == 7);
  CHECK(o.last_step == 9);
  ::setenv("PTRAIN_TRACE_STEPS", "4", 1);
  o = obs::trace_options_from_env();
  CHECK((o.first_step == 4 && o.last_step == 4));
  for (const char* bad : {"9:7", "0:2", "x", "3:", "2:3:4"}) {
    ::setenv("PTRAIN_TRACE_STEPS", bad, 1);
    CHECK_THROWS_WITH(obs::trace_options_from_env(), Catch::Contains("[ptrain.trace.steps]"));
  }
  ::unsetenv("PTRAIN_TRACE_STEPS");
}

}  // namespace test_trace
