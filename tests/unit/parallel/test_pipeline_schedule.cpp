// Pipeline schedules and partitions without ranks: every stage's action list is
// run against the others by a naive event-driven simulation (an action runs
// once the actions of the neighbouring stages it depends on ran), which must
// finish without a deadlock, run every (micro-batch, chunk) forward then
// backward exactly once, keep the documented number of caches alive (Note
// [Schedules]) and pair the transfers on every link in order (Note [Action
// order]). Partitions are checked on examples worked out by hand.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ptrain/parallel/pipeline_schedule.hpp>

namespace test_pipeline_schedule {

using ptrain::parallel::make_schedule;
using ptrain::parallel::PipelineAction;
using ptrain::parallel::Schedule;
using Plan = std::vector<PipelineAction>;

namespace {

// The most caches Note [Schedules] says stage s of p holds: GPipe all m, 1F1B min(p - s, m),
// interleaved Megatron-LM's warm-up count w plus the one forward of the first steady step
// (w alone when the warm-up already ran every forward). Interleaved with v = 1 is 1F1B.
int documented_peak(Schedule sched, int s, int p, int m, int v) {
  if (sched == Schedule::GPipe) return m;
  if (sched == Schedule::OneFOneB || v == 1) return std::min(p - s, m);
  const int w = std::min(2 * (p - s - 1) + (v - 1) * p, m * v);
  return w < m * v ? w + 1 : w;
}

// What the simulation of one pipeline found.
struct Outcome {
  bool finished = false;                 // every stage ran its whole list (no deadlock)
  std::vector<std::string> errors;       // broken rules, in words
  std::vector<int> peak;                 // most caches alive per stage
  std::string str() const {
    std::ostringstream os;
    os << (finished ? "finished" : "deadlocked");
    for (const auto& e : errors) os << "; " << e;
    return os.str();
  }
};

// One transfer on a link: kind, micro-batch and the model chunk that produced it.
using Message = std::tuple<char, int, int>;

// Runs the p stages' lists against each other. The model has G = p·v chunks; model chunk
// g = c·p + s is chunk c of stage s. F(j, g) needs F(j, g - 1) (g > 0); B(j, g) needs F(j, g)
// on its own stage and B(j, g + 1) (g < G - 1; the model's last chunk starts from its own loss).
// A stage runs its list in order; a result reaches the neighbour when the step that
// produced it ends (a forward marked with_next and the backward after it are one step), or,
// with per_step off, as soon as the action ran.
Outcome simulate(const std::vector<Plan>& plans, int m, int v, bool per_step) {
  const int p = static_cast<int>(plans.size()), G = p * v;
  Outcome out;
  out.peak.assign(static_cast<std::size_t>(p), 0);
  auto idx = [&](int j, int g) { return static_cast<std::size_t>(j) * static_cast<std::size_t>(G) +
                                        static_cast<std::size_t>(g); };
  const std::size_t cells = static_cast<std::size_t>(m) * static_cast<std::size_t>(G);
  std::vector<int> fran(cells, 0), bran(cells, 0);         // times each ran
  std::vector<char> fsent(cells, 0), bsent(cells, 0);      // result visible to the neighbour
  std::vector<std::size_t> pos(static_cast<std::size_t>(p), 0);
  std::vector<int> live(static_cast<std::size_t>(p), 0);
  std::vector<std::vector<std::pair<char, int>>> unsent(static_cast<std::size_t>(p));  // results of the open step
  std::map<std::pair<int, int>, std::vector<Message>> sent, received;  // by (from stage, to stage)
  auto stage_of = [&](int g) { return g % p; };
  auto error = [&](std::string e) {
    if (out.errors.size() < 8) out.errors.push_back(std::move(e));
  };

  // Checks one action's fields before it can be simulated.
  for (int s = 0; s < p; ++s)
    for (const auto& a : plans[static_cast<std::size_t>(s)])
      if (a.micro_batch < 0 || a.micro_batch >= m || a.chunk < 0 || a.chunk >= v) {
        error(ptrain::detail::cat("stage ", s, " has an action outside the grid: ", static_cast<char>(a.kind),
                                  a.chunk, ".", a.micro_batch));
        return out;
      }

  auto ready = [&](int s, const PipelineAction& a) {
    const int g = a.chunk * p + s, j = a.micro_batch;
    if (a.kind == PipelineAction::Forward) return g == 0 || fsent[idx(j, g - 1)] != 0;
    if (fran[idx(j, g)] == 0) return false;  // its own forward has not run (yet)
    return g == G - 1 || bsent[idx(j, g + 1)] != 0;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      const auto us = static_cast<std::size_t>(s);
      const Plan& plan = plans[us];
      while (pos[us] < plan.size() && ready(s, plan[pos[us]])) {
        const PipelineAction& a = plan[pos[us]++];
        const int g = a.chunk * p + s, j = a.micro_batch;
        const bool fwd = a.kind == PipelineAction::Forward;
        if (fwd) {
          if (++fran[idx(j, g)] > 1) error(ptrain::detail::cat("stage ", s, " ran F", a.chunk, ".", j, " twice"));
          out.peak[us] = std::max(out.peak[us], ++live[us]);
          if (g > 0) received[{stage_of(g - 1), s}].emplace_back('F', j, g - 1);
          if (g < G - 1) sent[{s, stage_of(g + 1)}].emplace_back('F', j, g);
        } else {
          if (++bran[idx(j, g)] > 1) error(ptrain::detail::cat("stage ", s, " ran B", a.chunk, ".", j, " twice"));
          --live[us];
          if (g < G - 1) received[{stage_of(g + 1), s}].emplace_back('B', j, g + 1);
          if (g > 0) sent[{s, stage_of(g - 1)}].emplace_back('B', j, g);
        }
        unsent[us].emplace_back(a.kind, static_cast<int>(idx(j, g)));
        if (!per_step || !a.with_next || pos[us] == plan.size()) {
          for (auto [kind, cell] : unsent[us])
            (kind == PipelineAction::Forward ? fsent : bsent)[static_cast<std::size_t>(cell)] = 1;
          unsent[us].clear();
        }
        progress = true;
      }
    }
  }
  out.finished = true;
  for (int s = 0; s < p; ++s) {
    const auto us = static_cast<std::size_t>(s);
    if (pos[us] < plans[us].size()) {
      out.finished = false;
      const auto& a = plans[us][pos[us]];
      error(ptrain::detail::cat("stage ", s, " waits at action ", pos[us], " (", static_cast<char>(a.kind), a.chunk,
                                ".", a.micro_batch, ")"));
    }
  }
  if (!out.finished) return out;
  for (int j = 0; j < m; ++j)
    for (int g = 0; g < G; ++g)
      if (fran[idx(j, g)] != 1 || bran[idx(j, g)] != 1)
        error(ptrain::detail::cat("micro-batch ", j, " of model chunk ", g, " ran ", fran[idx(j, g)],
                                  " forwards and ", bran[idx(j, g)], " backwards"));
  // Messages pair by order on each link (tag 0): what a stage sends to another must be what
  // that one receives from it, in the same order.
  for (const auto& [link, msgs] : sent)
    if (received[link] != msgs)
      error(ptrain::detail::cat("the link ", link.first, " -> ", link.second, " sends ", msgs.size(),
                                " messages in another order than they are received"));
  for (const auto& [link, msgs] : received)
    if (!sent.count(link) && !msgs.empty())
      error(ptrain::detail::cat("the link ", link.first, " -> ", link.second, " receives what nobody sends"));
  return out;
}

std::vector<Plan> plans_of(Schedule sched, int p, int m, int v) {
  std::vector<Plan> plans;
  for (int s = 0; s < p; ++s) plans.push_back(make_schedule(sched, s, p, m, v));
  return plans;
}

// The checks of one stage's list on its own: m·v forwards and backwards, each (micro-batch,
// chunk) once per kind, a backward after its own forward, with_next only on a forward that a
// backward follows.
std::vector<std::string> check_list(const Plan& plan, int m, int v) {
  std::vector<std::string> errs;
  std::map<std::pair<int, int>, int> f, b;
  int forwards = 0, backwards = 0;
  for (std::size_t k = 0; k < plan.size(); ++k) {
    const auto& a = plan[k];
    const std::pair<int, int> key{a.chunk, a.micro_batch};
    if (a.kind == PipelineAction::Forward) {
      ++forwards;
      ++f[key];
    } else {
      ++backwards;
      if (!f.count(key)) errs.push_back(ptrain::detail::cat("B", a.chunk, ".", a.micro_batch, " before its forward"));
      ++b[key];
    }
    if (a.with_next && (a.kind != PipelineAction::Forward || k + 1 == plan.size() ||
                        plan[k + 1].kind != PipelineAction::Backward || plan[k + 1].with_next))
      errs.push_back(ptrain::detail::cat("action ", k, " pairs with something other than one backward"));
  }
  if (forwards != m * v || backwards != m * v)
    errs.push_back(ptrain::detail::cat(forwards, " forwards and ", backwards, " backwards, not ", m * v, " each"));
  for (int c = 0; c < v; ++c)
    for (int j = 0; j < m; ++j)
      if (f[{c, j}] != 1 || b[{c, j}] != 1)
        errs.push_back(ptrain::detail::cat("chunk ", c, " micro-batch ", j, ": ", f[{c, j}], " forwards, ",
                                           b[{c, j}], " backwards"));
  return errs;
}

std::string show(const Plan& plan) {
  std::string out;
  for (const auto& a : plan)
    out += ptrain::detail::cat(static_cast<char>(a.kind), a.chunk, ".", a.micro_batch, a.with_next ? "+" : " ");
  return out;
}

PipelineAction F(int j, int c = 0) { return {PipelineAction::Forward, j, c}; }
PipelineAction B(int j, int c = 0) { return {PipelineAction::Backward, j, c}; }

}  // namespace

TEST_CASE("pipeline schedules run to the end on every stage, each micro-batch once, caches as documented",
          "[pipeline][schedule]") {
  struct Case {
    Schedule sched;
    int p, m, v;
  };
  std::vector<Case> grid;
  for (int p = 1; p <= 5; ++p)
    for (int m = 1; m <= 9; ++m) {
      grid.push_back({Schedule::GPipe, p, m, 1});
      grid.push_back({Schedule::OneFOneB, p, m, 1});
      grid.push_back({Schedule::Interleaved, p, m, 1});
      for (int v = 2; v <= 4 && p >= 2; ++v)
        if (m % p == 0) grid.push_back({Schedule::Interleaved, p, m, v});
    }
  for (int p : {2, 3, 4})  // a few more micro-batches for the interleaved schedule
    for (int v = 2; v <= 4; ++v) grid.push_back({Schedule::Interleaved, p, 4 * p, v});
  int simulated = 0;
  for (const Case& c : grid) {
    const auto plans = plans_of(c.sched, c.p, c.m, c.v);
    for (bool per_step : {true, false}) {
      INFO(schedule_name(c.sched) << " p = " << c.p << " m = " << c.m << " v = " << c.v
                                  << (per_step ? ", results sent per step" : ", results sent per action"));
      const Outcome o = simulate(plans, c.m, c.v, per_step);
      INFO(o.str());
      CHECK(o.finished);
      CHECK(o.errors.empty());
      for (int s = 0; s < c.p && o.finished; ++s) {
        INFO("stage " << s << ": " << show(plans[static_cast<std::size_t>(s)]));
        CHECK(o.peak[static_cast<std::size_t>(s)] == documented_peak(c.sched, s, c.p, c.m, c.v));
      }
      ++simulated;
    }
    for (int s = 0; s < c.p; ++s) {
      INFO(schedule_name(c.sched) << " p = " << c.p << " m = " << c.m << " v = " << c.v << " stage " << s << ": "
                                  << show(plans[static_cast<std::size_t>(s)]));
      const auto errs = check_list(plans[static_cast<std::size_t>(s)], c.m, c.v);
      CHECK(errs.empty());
      for (const auto& e : errs) UNSCOPED_INFO(e);
    }
  }
  CHECK(simulated > 200);
  // Interleaved with one chunk per stage is 1F1B.
  for (int p = 1; p <= 4; ++p)
    for (int s = 0; s < p; ++s)
      CHECK(make_schedule(Schedule::Interleaved, s, p, 5, 1) == make_schedule(Schedule::OneFOneB, s, p, 5, 1));
}

TEST_CASE("the schedule simulation catches broken schedules", "[pipeline][schedule]") {
  // p = 2, m = 2, 1F1B: stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1.
  const auto good = plans_of(Schedule::OneFOneB, 2, 2, 1);
  REQUIRE(good[0] == Plan{F(0), F(1), B(0), B(1)});
  REQUIRE(good[1] == Plan{F(0), B(0), F(1), B(1)});
  REQUIRE(simulate(good, 2, 1, true).errors.empty());

  SECTION("backwards swapped on the first stage: the gradients arrive in another order") {
    auto bad = good;
    std::swap(bad[0][2], bad[0][3]);
    const Outcome o = simulate(bad, 2, 1, true);
    CHECK(o.finished);
    REQUIRE(o.errors.size() == 1);
    CHECK_THAT(o.errors[0], Catch::Contains("1 -> 0") && Catch::Contains("another order"));
  }
  SECTION("no warm-up on the first stage while the last stage runs both forwards first: deadlock") {
    const std::vector<Plan> bad{{F(0), B(0), F(1), B(1)}, {F(0), F(1), B(0), B(1)}};
    const Outcome o = simulate(bad, 2, 1, true);
    CHECK_FALSE(o.finished);
    CHECK_THAT(o.str(), Catch::Contains("stage 0 waits at action 1") && Catch::Contains("stage 1 waits at action 1"));
  }
  SECTION("a backward before its own forward never runs") {
    auto bad = good;
    std::swap(bad[1][0], bad[1][1]);
    CHECK_FALSE(simulate(bad, 2, 1, true).finished);
    CHECK_FALSE(check_list(bad[1], 2, 1).empty());
  }
  SECTION("a micro-batch run twice and another never") {
    auto bad = good;
    bad[0][1] = F(0);
    CHECK_FALSE(check_list(bad[0], 2, 1).empty());
    CHECK_FALSE(simulate(bad, 2, 1, true).errors.empty());
  }
  SECTION("one warm-up forward too many holds one cache more than documented") {
    auto plans = plans_of(Schedule::OneFOneB, 3, 4, 1);
    // Stage 1 warms up with p - s - 1 = 1 forward; give it 2 (F0 F1 F2 B0 ... instead of F0 F1 B0 F2 ...).
    auto& st = plans[1];
    REQUIRE(show(st) == "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3 ");
    std::swap(st[2], st[3]);
    const Outcome o = simulate(plans, 4, 1, true);
    CHECK(o.finished);
    CHECK(o.peak[1] == documented_peak(Schedule::OneFOneB, 1, 3, 4, 1) + 1);
  }
  SECTION("interleaved: two forwards of the model's last chunk swapped take their inputs out of order") {
    auto plans = plans_of(Schedule::Interleaved, 2, 4, 2);
    auto& st = plans[1];
    auto forward_of = [&](int j, int c) {
      return std::find_if(st.begin(), st.end(), [&](const PipelineAction& a) {
        return a.kind == PipelineAction::Forward && a.micro_batch == j && a.chunk == c;
      });
    };
    const auto f10 = forward_of(0, 1), f11 = forward_of(1, 1);
    REQUIRE(f10 != st.end());
    REQUIRE(f11 != st.end());
    std::swap(f10->micro_batch, f11->micro_batch);
    const Outcome o = simulate(plans, 4, 2, true);
    CHECK_FALSE(o.errors.empty());
  }
}

TEST_CASE("partition_by_cuts and partition_balanced on examples worked by hand", "[pipeline][partition]") {
  using ptrain::parallel::partition_balanced;
  using ptrain::parallel::partition_by_cuts;
  using V = std::vector<std::size_t>;

  const auto cuts = partition_by_cuts(6, {2, 4});
  CHECK(cuts.bounds() == V{0, 2, 4, 6});
  CHECK(cuts.num_stages() == 3);
  CHECK(cuts.num_units() == 6);
  CHECK(cuts.str() == "[0,2) [2,4) [4,6)");
  CHECK(cuts.stage_of(0) == 0);
  CHECK(cuts.stage_of(1) == 0);
  CHECK(cuts.stage_of(2) == 1);
  CHECK(cuts.stage_of(5) == 2);
  CHECK(partition_by_cuts(5, {}).bounds() == V{0, 5});
  CHECK(partition_by_cuts(5, {1, 2, 3, 4}).bounds() == V{0, 1, 2, 3, 4, 5});

  // Equal costs: equal halves.
  CHECK(partition_balanced({1, 1, 1, 1}, 2).bounds() == V{0, 2, 4});
  // A heavy first unit gets a stage of its own: [4] [1 1 1 1], max 4.
  CHECK(partition_balanced({4, 1, 1, 1, 1}, 2).bounds() == V{0, 1, 5});
  // [3] [1 1 1] [3]: max 3, the only cut that reaches it.
  CHECK(partition_balanced({3, 1, 1, 1, 3}, 3).bounds() == V{0, 1, 4, 5});
  // Ties (max 2 either way) go to the cut that puts more units early: [1 1] [1], not [1] [1 1].
  CHECK(partition_balanced({1, 1, 1}, 2).bounds() == V{0, 2, 3});
  CHECK(partition_balanced({0, 0, 0, 0}, 2).bounds() == V{0, 3, 4});
  // [2 3] [5] [1 4]: max 5 (5 + anything exceeds it).
  CHECK(partition_balanced({2, 3, 5, 1, 4}, 3).bounds() == V{0, 2, 3, 5});
  // One stage holds everything; as many stages as units, one each.
  CHECK(partition_balanced({7, 1, 3}, 1).bounds() == V{0, 3});
  CHECK(partition_balanced({7, 1, 3}, 3).bounds() == V{0, 1, 2, 3});
}

TEST_CASE("invalid partitions and schedule options are refused with their error ids", "[pipeline][schedule]") {
  using ptrain::parallel::partition_balanced;
  using ptrain::parallel::partition_by_cuts;
  using ptrain::parallel::StagePartition;
  using ptrain::parallel::detail::check_schedule;
  using V = std::vector<std::size_t>;
  using Catch::Contains;

  CHECK_THROWS_WITH(StagePartition(V{0}), Contains("[ptrain.pipeline.partition]"));
  CHECK_THROWS_WITH(StagePartition(V{1, 3}), Contains("[ptrain.pipeline.partition]"));
  CHECK_THROWS_WITH(StagePartition(V{0, 2, 2, 5}), Contains("[ptrain.pipeline.partition]") && Contains("stage 1"));
  CHECK_THROWS_WITH(StagePartition(V{0, 2, 5}).stage_of(5), Contains("[ptrain.pipeline.partition]"));

  CHECK_THROWS_WITH(partition_by_cuts(6, {4, 2}), Contains("[ptrain.pipeline.cuts]"));
  CHECK_THROWS_WITH(partition_by_cuts(6, {2, 2}), Contains("[ptrain.pipeline.cuts]"));
  CHECK_THROWS_WITH(partition_by_cuts(6, {0}), Contains("[ptrain.pipeline.cuts]"));
  CHECK_THROWS_WITH(partition_by_cuts(6, {6}), Contains("[ptrain.pipeline.cuts]"));

  CHECK_THROWS_WITH(partition_balanced({1, 2}, 3), Contains("[ptrain.pipeline.balance]"));
  CHECK_THROWS_WITH(partition_balanced({1, 2}, 0), Contains("[ptrain.pipeline.balance]"));
  CHECK_THROWS_WITH(partition_balanced({1, -1}, 1), Contains("[ptrain.pipeline.balance]"));
  CHECK_THROWS_WITH(partition_balanced({1, std::numeric_limits<double>::quiet_NaN()}, 1),
                    Contains("[ptrain.pipeline.balance]"));
  CHECK_THROWS_WITH(partition_balanced({1, std::numeric_limits<double>::infinity()}, 1),
                    Contains("[ptrain.pipeline.balance]"));

  CHECK_THROWS_WITH(make_schedule(Schedule::OneFOneB, 2, 2, 4), Contains("[ptrain.pipeline.schedule]"));
  CHECK_THROWS_WITH(make_schedule(Schedule::OneFOneB, -1, 2, 4), Contains("[ptrain.pipeline.schedule]"));
  CHECK_THROWS_WITH(make_schedule(Schedule::GPipe, 0, 2, 0), Contains("[ptrain.pipeline.schedule]"));
  CHECK_THROWS_WITH(check_schedule(Schedule::GPipe, 2, 0, 1), Contains("[ptrain.pipeline.micro_batches]"));
  CHECK_THROWS_WITH(check_schedule(Schedule::Interleaved, 2, 4, 0), Contains("[ptrain.pipeline.virtual_stages]"));
  CHECK_THROWS_WITH(make_schedule(Schedule::GPipe, 0, 2, 4, 2),
                    Contains("[ptrain.pipeline.virtual_stages]") && Contains("Interleaved"));
  CHECK_THROWS_WITH(make_schedule(Schedule::Interleaved, 0, 1, 4, 2), Contains("[ptrain.pipeline.virtual_stages]"));
  CHECK_THROWS_WITH(make_schedule(Schedule::Interleaved, 0, 3, 4, 2),
                    Contains("[ptrain.pipeline.micro_batches]") && Contains("not a multiple of 3") &&
                        Contains("use 6"));
  CHECK_NOTHROW(check_schedule(Schedule::Interleaved, 3, 6, 2));
  CHECK_NOTHROW(check_schedule(Schedule::GPipe, 1, 1, 1));
}

}  // namespace test_pipeline_schedule
