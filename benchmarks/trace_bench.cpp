// Per-site cost of the observability hooks (Note [Tracing cost], Note [Flight
// recorder]): a span and a collective label with tracing off and on, and an
// all-reduce of one float on the world of one with and without the recording
// communicator. One JSON line per measurement: ns per call, median of 7 rounds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "ptrain/dist/flight_recorder.hpp"
#include "ptrain/dist/self_communicator.hpp"
#include "ptrain/obs/trace.hpp"

using namespace ptrain;

template <class F>
double ns_per_call(std::int64_t n, F&& f) {
  std::vector<double> rounds;
  for (int r = 0; r < 7; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < n; ++i) f(i);
    rounds.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n);
  }
  std::sort(rounds.begin(), rounds.end());
  return rounds[3];
}

void report(const char* what, double ns) { std::printf("{\"bench\":\"trace\",\"what\":\"%s\",\"ns\":%.2f}\n", what, ns); }

int main() {
  volatile std::int64_t sink = 0;
  report("nothing (loop)", ns_per_call(50'000'000, [&](std::int64_t i) { sink = sink + i; }));
  report("span, tracing off", ns_per_call(50'000'000, [&](std::int64_t i) {
           obs::Span s("bench", "bench", i);
           sink = sink + i;
         }));
  report("collective label", ns_per_call(50'000'000, [&](std::int64_t i) {
           dist::CollectiveLabel l("bench");
           sink = sink + i;
         }));
  dist::SelfCommunicator plain;
  dist::RecordingCommunicator recorded(std::make_unique<dist::SelfCommunicator>(), "world", 2000);
  float x = 1;
  report("all_reduce, world of one", ns_per_call(200'000, [&](std::int64_t) {
           plain.all_reduce(&x, 1, DType::F32, dist::ReduceOp::Sum);
         }));
  report("all_reduce, world of one, recorded", ns_per_call(200'000, [&](std::int64_t) {
           recorded.all_reduce(&x, 1, DType::F32, dist::ReduceOp::Sum);
         }));
  const auto dir = std::filesystem::temp_directory_path() / "ptrain_trace_bench";
  std::filesystem::create_directories(dir);
  obs::Tracer::get().configure({.dir = dir.string(), .first_step = 1, .last_step = 1, .nvtx = false}, 0);
  obs::Tracer::get().step(1);
  report("span, tracing on", ns_per_call(200'000, [&](std::int64_t i) {
           obs::Span s("bench", "bench", i);
           sink = sink + i;
         }));
  obs::Tracer::get().flush();
  std::filesystem::remove_all(dir);
  return 0;
}
