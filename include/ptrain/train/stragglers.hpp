#pragma once
// Per-rank step timing and the straggler report the Trainer adds to its
// metrics records (docs/observability.md).
//
// Note [Straggler report]
// Each rank sums, over the steps of a report window, its wall time per step,
// the part spent waiting for the batch (data wait: blocked in the prefetching
// loader's next(), Note [Prefetching loader], and the copy to the device), and
// the part its callers spent blocked in waits on collectives (collective wait;
// counted by the recording communicator of Note [Flight recorder], so 0 unless
// it is on). At each report
// every rank all-gathers its three means (one small collective, at the same
// steps on every rank), and the leader writes each rank's step time, the
// slowest rank, and how much slower it is than the median rank. A rank that is
// slow because it computes more shows a long step and a short collective wait;
// the ranks waiting for it show long collective waits.

#include <algorithm>
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "ptrain/dist/communicator.hpp"

namespace ptrain::train {

/// One rank's sums over a report window (Note [Straggler report]).
struct StepTimes {
  std::int64_t steps = 0;
  double step_s = 0, data_s = 0, comm_wait_s = 0;

  void add(double step, double data, double comm_wait) {
    ++steps;
    step_s += step;
    data_s += data;
    comm_wait_s += comm_wait;
  }
};

/// Collective over `comm`: every rank's mean step, data-wait and collective-wait
/// seconds; returns the fields the leader adds to its metrics record.
inline nlohmann::json straggler_report(dist::Communicator& comm, const StepTimes& mine) {
  const double n = mine.steps > 0 ? static_cast<double>(mine.steps) : 1.0;
  double local[3] = {mine.step_s / n, mine.data_s / n, mine.comm_wait_s / n};
  const int size = comm.size();
  std::vector<double> all(3 * static_cast<std::size_t>(size));
  comm.all_gather(local, all.data(), 3, DType::F64);
  std::vector<double> step(size), data(size), wait(size);
  for (int r = 0; r < size; ++r) {
    step[r] = all[3 * r];
    data[r] = all[3 * r + 1];
    wait[r] = all[3 * r + 2];
  }
  const int slowest = static_cast<int>(std::max_element(step.begin(), step.end()) - step.begin());
  std::vector<double> sorted = step;
  std::sort(sorted.begin(), sorted.end());
  const double median = size % 2 ? sorted[size / 2] : 0.5 * (sorted[size / 2 - 1] + sorted[size / 2]);
  return {{"step_time_s", step[0]},
          {"data_wait_s", data[0]},
          {"comm_wait_s", wait[0]},
          {"step_time_per_rank", step},
          {"data_wait_per_rank", data},
          {"comm_wait_per_rank", wait},
          {"slowest_rank", slowest},
          {"slowest_vs_median", median > 0 ? step[slowest] / median : 1.0}};
}

}  // namespace ptrain::train
