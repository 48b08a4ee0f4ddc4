#pragma once
// Timing helpers shared by the benchmarks: wall-clock medians over repeated runs.

#include <algorithm>
#include <chrono>
#include <vector>

namespace ptrain::bench {

inline double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

/// Runs f() warmup times, then `reps` timed times; returns the per-run times in ms.
template <class F>
std::vector<double> time_runs(int warmup, int reps, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> t;
  t.reserve(static_cast<std::size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_ms();
    f();
    t.push_back(now_ms() - t0);
  }
  return t;
}

}  // namespace ptrain::bench
