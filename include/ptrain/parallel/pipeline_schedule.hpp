#pragma once
// Pipeline schedules, without ranks: which units each stage holds
// (StagePartition, partition_by_cuts, partition_balanced) and the order in
// which a stage runs the forwards and backwards of its micro-batches over its
// chunks (make_schedule, PipelineAction; PipelineEvent records one). They are
// pure functions of the options, tested without a communicator
// (tests/unit/parallel/test_pipeline_schedule.cpp); parallel/pipeline.hpp runs
// them over the ranks of a pipeline group.
//
// Note [Schedules]
// GPipe runs every forward, then every backward: each stage holds m
// micro-batch caches at its peak. 1F1B (PipeDream-flush, as Megatron-LM) lets
// stage s run w = min(p - s - 1, m) warm-up forwards, then alternates one
// forward and one backward, then drains w backwards: at most min(p - s, m) <= p
// caches are alive at once, whatever m is. Both schedules do the same
// arithmetic per micro-batch and have the same bubble, (p - 1) / (m + p - 1) of
// each stage's time when forward and backward times are equal across stages;
// 1F1B only bounds activation memory.
//
// Interleaved (Megatron-LM's virtual pipeline stages) cuts the model into p·v
// chunks; stage s holds chunks s, s + p, ..., s + (v - 1)p, so a micro-batch
// goes round the ring of stages v times (the last stage's chunk k feeds the
// first stage's chunk k + 1). Each stage runs m·v forwards and m·v backwards
// of 1/v of its layers. Megatron's order: micro-batches in groups of p, each
// group forward through the stage's chunk 0, 1, ..., v - 1 and backward
// through v - 1, ..., 0 (detail::nth_action; hence m % p == 0); stage s runs
// w = min(2(p - s - 1) + (v - 1)p, m·v) warm-up forwards, then pairs of one
// forward and one backward, then drains. The ramp (p - 1 chunk times at each
// end) is v times shorter, so the bubble is (p - 1) / (v·m) of the ideal time
// (1F1B: (p - 1) / m). The price is memory: up to w + 1 chunk caches are
// alive, (w + 1) / v stage-equivalents, e.g. stage 0 holds
// (p + (p - 1) / v) stages' worth of activations against p under 1F1B, and v
// times more messages go between stages.
//
// Note [Action order]
// A schedule is a sequence of steps: one action, or (Interleaved, after the
// warm-up) a forward and a backward (PipelineAction::with_next). A pipeline
// exchanges messages with its neighbours once per step (Note [Communication
// order] in parallel/pipeline.hpp).
//
// Pairing. Every stage runs the forwards in one order of (chunk, micro-batch)
// and the backwards in another (nth_action), only their interleaving differs.
// On the link s -> s + 1 (activations; gradients go the other way) the sender
// produces the chunk-k outputs in that order and the receiver consumes them as
// its chunk-k inputs in the same order. Across the wrap-around p - 1 -> 0 the
// last stage's chunk k feeds chunk k + 1 of the first stage: within a group of
// p micro-batches chunk k's forwards come right before chunk k + 1's, so the
// order is kept (backwards: chunk k + 1's gradients of the first stage feed
// chunk k of the last, likewise). With p = 2 the next and the previous stage
// are one rank, and activations and gradients share a link in each direction
// (their common order: Note [Communication order] in parallel/pipeline.hpp).

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ptrain/core/error.hpp"

namespace ptrain::parallel {
namespace detail {
using ::ptrain::detail::cat;
}  // namespace detail

/// Which units each stage holds: stage s owns units [begin(s), end(s)).
class StagePartition {
 public:
  StagePartition() = default;
  /// bounds = {0, c1, ..., c_{p-1}, num_units}, strictly increasing.
  explicit StagePartition(std::vector<std::size_t> bounds) : bounds_(std::move(bounds)) {
    PTRAIN_CHECK(bounds_.size() >= 2 && bounds_.front() == 0, Error,
                 "[ptrain.pipeline.partition] bounds must start at 0 and have at least two entries");
    for (std::size_t i = 1; i < bounds_.size(); ++i)
      PTRAIN_CHECK(bounds_[i] > bounds_[i - 1], Error, "[ptrain.pipeline.partition] stage ", i - 1,
                   " would be empty (bounds ", bounds_[i - 1], " -> ", bounds_[i],
                   "); every stage needs at least one unit");
  }
  int num_stages() const { return static_cast<int>(bounds_.size()) - 1; }
  std::size_t num_units() const { return bounds_.back(); }
  std::size_t begin(int stage) const { return bounds_.at(static_cast<std::size_t>(stage)); }
  std::size_t end(int stage) const { return bounds_.at(static_cast<std::size_t>(stage) + 1); }
  /// The stage that owns `unit`.
  int stage_of(std::size_t unit) const {
    PTRAIN_CHECK(unit < num_units(), Error, "[ptrain.pipeline.partition] unit ", unit, " >= ", num_units());
    return static_cast<int>(std::upper_bound(bounds_.begin(), bounds_.end(), unit) - bounds_.begin()) - 1;
  }
  const std::vector<std::size_t>& bounds() const { return bounds_; }
  /// "[0,3) [3,6)".
  std::string str() const {
    std::string s;
    for (int i = 0; i < num_stages(); ++i)
      s += detail::cat(i ? " " : "", "[", begin(i), ",", end(i), ")");
    return s;
  }

 private:
  std::vector<std::size_t> bounds_;
};

/// Stages cut before the given units: partition_by_cuts(6, {2, 4}) gives [0,2) [2,4) [4,6).
inline StagePartition partition_by_cuts(std::size_t num_units, const std::vector<std::size_t>& cuts) {
  std::vector<std::size_t> b{0};
  for (std::size_t c : cuts) {
    PTRAIN_CHECK(c > b.back() && c < num_units, Error, "[ptrain.pipeline.cuts] cut points must be strictly "
                 "increasing and inside (0, ", num_units, "); got ", c, " after ", b.back());
    b.push_back(c);
  }
  b.push_back(num_units);
  return StagePartition(std::move(b));
}

/// Contiguous stages that minimise the largest stage cost (cost[u] of unit u:
/// parameter count, measured time, FLOPs). Ties go to the cut that puts more
/// units early. Exact dynamic programme, O(p n^2).
inline StagePartition partition_balanced(const std::vector<double>& cost, int stages) {
  const std::size_t n = cost.size();
  PTRAIN_CHECK(stages >= 1 && n >= static_cast<std::size_t>(stages), Error, "[ptrain.pipeline.balance] cannot "
               "split ", n, " units into ", stages, " non-empty stages; use fewer stages or finer units");
  for (double c : cost)
    PTRAIN_CHECK(c >= 0 && std::isfinite(c), Error, "[ptrain.pipeline.balance] unit costs must be finite and >= 0");
  std::vector<double> prefix(n + 1, 0.0);
  for (std::size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost[i];
  const double inf = std::numeric_limits<double>::infinity();
  const auto p = static_cast<std::size_t>(stages);
  // best[k][j]: smallest max-cost of the first j units in k stages; from[k][j]: where stage k-1 starts.
  std::vector<std::vector<double>> best(p + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<std::size_t>> from(p + 1, std::vector<std::size_t>(n + 1, 0));
  best[0][0] = 0;
  for (std::size_t k = 1; k <= p; ++k)
    for (std::size_t j = k; j <= n; ++j)
      for (std::size_t i = k - 1; i < j; ++i) {
        const double v = std::max(best[k - 1][i], prefix[j] - prefix[i]);
        if (v <= best[k][j]) {  // <=: a later start makes earlier stages longer
          best[k][j] = v;
          from[k][j] = i;
        }
      }
  std::vector<std::size_t> b(p + 1);
  b[p] = n;
  for (std::size_t k = p; k >= 1; --k) b[k - 1] = from[k][b[k]];
  return StagePartition(std::move(b));
}

enum class Schedule {
  GPipe,        ///< all forwards, then all backwards (m caches alive per stage)
  OneFOneB,     ///< warm-up, one forward one backward, drain (at most p caches alive)
  Interleaved,  ///< 1F1B over v chunks per stage (PipelineOptions::virtual_stages; Megatron-LM's interleaved schedule)
};

inline const char* schedule_name(Schedule s) {
  return s == Schedule::GPipe ? "gpipe" : s == Schedule::OneFOneB ? "1f1b" : "interleaved";
}

/// One step of a stage's schedule.
struct PipelineAction {
  enum Kind : char { Forward = 'F', Backward = 'B' } kind;
  int micro_batch;
  int chunk = 0;           ///< which of the stage's v chunks (0 without virtual stages)
  bool with_next = false;  ///< runs with the next action as one step (Note [Action order])
  bool operator==(const PipelineAction&) const = default;
};

namespace detail {
// The options a schedule needs (Note [Schedules]).
inline void check_schedule(Schedule s, int stages, int m, int v) {
  PTRAIN_CHECK(m >= 1, Error, "[ptrain.pipeline.micro_batches] micro_batches must be >= 1, got ", m);
  PTRAIN_CHECK(v >= 1, Error, "[ptrain.pipeline.virtual_stages] virtual_stages must be >= 1, got ", v);
  if (v == 1) return;
  PTRAIN_CHECK(s == Schedule::Interleaved, Error, "[ptrain.pipeline.virtual_stages] virtual_stages = ", v,
               " needs schedule = Schedule::Interleaved; ", schedule_name(s), " runs one chunk per stage");
  PTRAIN_CHECK(stages >= 2, Error, "[ptrain.pipeline.virtual_stages] a pipeline of one stage holds the whole "
               "model: use virtual_stages = 1");
  PTRAIN_CHECK(m % stages == 0, Error, "[ptrain.pipeline.micro_batches] the interleaved schedule runs micro-batches "
               "in groups of p = ", stages, " (the number of stages); micro_batches = ", m, " is not a multiple of ",
               stages, ": use ", (m + stages - 1) / stages * stages, " or another multiple, or virtual_stages = 1");
}

// The k-th forward (or backward) of a stage: micro-batches in groups of p, each
// group forward through chunks 0, 1, ..., v - 1 and backward through v - 1,
// ..., 0 (Megatron-LM's order; micro-batch k, chunk 0 when v = 1).
inline PipelineAction nth_action(PipelineAction::Kind kind, int k, int p, int v) {
  const int chunk = k % (p * v) / p;
  return {kind, k / (p * v) * p + k % p, kind == PipelineAction::Forward ? chunk : v - 1 - chunk};
}
}  // namespace detail

/// The order in which `stage` of `stages` runs forwards and backwards of m micro-batches
/// over its v chunks (Note [Schedules]); v > 1 only with Schedule::Interleaved.
inline std::vector<PipelineAction> make_schedule(Schedule s, int stage, int stages, int m, int virtual_stages = 1) {
  PTRAIN_CHECK(stages >= 1 && stage >= 0 && stage < stages && m >= 1, Error, "[ptrain.pipeline.schedule] stage ",
               stage, " of ", stages, " with ", m, " micro-batches is invalid");
  detail::check_schedule(s, stages, m, virtual_stages);
  const int v = virtual_stages, n = m * v;
  auto forward = [&](int k) { return detail::nth_action(PipelineAction::Forward, k, stages, v); };
  auto backward = [&](int k) { return detail::nth_action(PipelineAction::Backward, k, stages, v); };
  std::vector<PipelineAction> out;
  int f = 0, b = 0;
  if (s == Schedule::GPipe) {
    for (; f < n; ++f) out.push_back(forward(f));
    for (; b < n; ++b) out.push_back(backward(b));
    return out;
  }
  // Interleaved with v = 1 is 1F1B.
  const bool interleaved = v > 1;
  const int warmup = interleaved ? std::min((stages - stage - 1) * 2 + (v - 1) * stages, n)
                                 : std::min(stages - stage - 1, m);
  for (; f < warmup; ++f) out.push_back(forward(f));
  for (; f < n; ++f, ++b) {
    out.push_back(forward(f));
    out.back().with_next = interleaved;  // Note [Action order]: one exchange per pair
    out.push_back(backward(b));
  }
  for (; b < n; ++b) out.push_back(backward(b));
  return out;
}

/// Start and end of one forward or backward (steady-clock seconds, comparable across processes of one host).
struct PipelineEvent {
  int stage;
  int micro_batch;
  char kind;  ///< 'F' or 'B'
  double start, end;
  int chunk = 0;  ///< which of the stage's chunks (Schedule::Interleaved)
};

}  // namespace ptrain::parallel
