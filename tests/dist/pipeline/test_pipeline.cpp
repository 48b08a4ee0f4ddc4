// Pipeline parallelism against one process. The executable runs as a real
// multi-process job (mpirun: MPI; ptrun: Gloo) and uses every rank as one stage
// (p = world size), or, for meshes, every factorisation dp x pp of the world.
// Every rank runs every test case in the same order; value checks use CHECK
// (never REQUIRE) so a wrong value cannot make one rank skip communication the
// others still do.
//
// Reference: the same units built by the same factory, chained in one process
// and trained on the whole (global) batch without micro-batches.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <climits>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <ptrain/dist/process_group.hpp>
#include <ptrain/nn/activation.hpp>
#include <ptrain/nn/linear.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/nn/sequential.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/optim/sgd.hpp>
#include <ptrain/parallel/make_engine.hpp>
#include <ptrain/parallel/mesh.hpp>
#include <ptrain/parallel/pipeline.hpp>

#include "dist/frozen_model.hpp"
#include "dist/pipeline/nccl_model.hpp"
#include "dist/pipeline/pipeline_util.hpp"
#include "dist/spawn_util.hpp"

namespace test_pipeline {

using namespace ptrain;
using parallel::Schedule;

namespace {

using namespace pipeline_test;

// The GPT pipelines and check_pipeline's MLP run in double: what they test is the
// schedule (which micro-batch, chunk and gradient goes where), not float rounding. In float the pipeline adds the
// micro-batches' gradients in another order than one process, and AdamW turns those
// last-bit differences of near-zero gradients into parameter differences of about
// 1e-5 relative after two steps, a value that depends on the processor's vector width
// (1.2e-5 with AVX-512). In double the same amplification leaves about 2^-29 of that
// (~1e-13); a wrong micro-batch, chunk or missing gradient is off by more than 1e-3.
constexpr double kDoubleTol = 1e-9;

// The float MLP checks below: forwards, and at most two SGD steps (lr 0.1, momentum 0.9;
// SGD is linear in the gradient, unlike AdamW). Micro-batches change only the grouping of
// the row sums (<= 16 rows) and GEMM blocking of dot products (<= 14 terms) in 8 layers:
// with u = 2^-24, |err| <= (16 + 8 * 15) u ~ 8e-6 of the terms' magnitudes, hence a loss
// within ~6e-6 relative, parameters moved by at most 0.29 (lr (1 + 1.9)) times that
// gradient error, ~2.4e-6 against weights of ~0.4: 1e-5 holds on any vector width. A wrong
// micro-batch or a missing gradient moves the loss or a weight by more than 1e-3.
constexpr double kFloatSgdTol = 1e-5;

// Trains the reference on the full batches; returns each step's loss.
template <class Model, class T>
std::vector<double> train_reference(Model& model, nn::FlatParameters<T>& p, Opt kind,
                                    const std::vector<std::pair<Tensor<T>, Tensor<std::int32_t>>>& batches) {
  auto opt = make_opt(kind, p);
  std::vector<double> losses;
  nn::CrossEntropyLoss<T> ce;
  for (auto& [x, y] : batches) {
    nn::Cache<T> c, lc;
    p.zero_grad();
    losses.push_back(ce.forward(model.forward(x, c), y, lc));
    model.backward(ce.backward(lc), c);
    opt->step();
  }
  return losses;
}

// max |a - b| / max |b| over this stage's parameters, matched by name with the reference.
template <class T>
double rel_error(nn::Module<T>& stage, nn::Module<T>& ref) {
  std::map<std::string, Tensor<T>> want;
  for (auto& p : ref.named_parameters()) want[p.name] = p.param->value;
  double diff = 0, scale = 0;
  for (auto& p : stage.named_parameters()) {
    auto it = want.find(p.name);
    if (it == want.end()) return 1e30;  // a name the full model does not have
    const auto& a = p.param->value;
    const auto& b = it->second;
    if (a.numel() != b.numel()) return 1e30;
    for (std::int64_t i = 0; i < a.numel(); ++i) {
      diff = std::max(diff, std::abs(static_cast<double>(a.data()[i]) - static_cast<double>(b.data()[i])));
      scale = std::max(scale, std::abs(static_cast<double>(b.data()[i])));
    }
  }
  return scale > 0 ? diff / scale : diff;
}

bool identical(const Tensor<float>& a, const Tensor<float>& b) {
  return a.numel() == b.numel() && std::equal(a.data(), a.data() + a.numel(), b.data());
}

std::vector<double> param_costs() {
  std::vector<double> c;
  for (std::size_t u = 0; u < kUnits; ++u) c.push_back(static_cast<double>(make_unit(u)->num_parameters()));
  return c;
}

// Warm-up forwards of stage s under the interleaved schedule (Megatron-LM's count) and
// the most chunk caches it then holds: every forward of the warm-up, plus one in the steady phase.
int interleaved_warmup(int s, int p, int m, int v) { return std::min(2 * (p - s - 1) + (v - 1) * p, m * v); }
int interleaved_peak(int s, int p, int m, int v) {
  const int w = interleaved_warmup(s, p, m, v);
  return w == m * v ? w : w + 1;
}
// The most caches alive on stage s (Note [Schedules]): GPipe all m, 1F1B p - s.
int want_peak(Schedule sched, int s, int p, int m, int v) {
  if (sched == Schedule::GPipe) return m;
  return v > 1 ? interleaved_peak(s, p, m, v) : std::min(p - s, m);
}

// Pipeline over `pp_comm` (one replica of `dp` with index `replica`) against the reference;
// `part` has p * v chunks. In double (kDoubleTol): in float, AdamW multiplies the rounding
// differences of near-zero gradients summed in another order by up to lr / eps = 1e4 per step.
void check_pipeline(dist::Communicator& pp_comm, dist::Communicator* dp_comm, Schedule sched, int m, Opt kind,
                    const parallel::StagePartition& part, int v = 1) {
  const int p = pp_comm.size(), s = pp_comm.rank();
  const int dp = dp_comm ? dp_comm->size() : 1, replica = dp_comm ? dp_comm->rank() : 0;
  // Global rows: divisible by dp * m (m = 4 in meshes, up to 8 without data parallelism; 3 and 6 interleaved).
  const std::int64_t B = dp == 3 || m % 3 == 0 ? 24 : 16, steps = 3;
  std::vector<std::pair<Tensor<double>, Tensor<std::int32_t>>> global;
  for (std::int64_t i = 0; i < steps; ++i) {
    auto b = make_batch<double>(B, 77 + static_cast<std::uint64_t>(i));
    global.emplace_back(b.x, b.y);
  }
  auto ref = full_model<double>();
  nn::FlatParameters<double> ref_p(*ref);
  auto ref_losses = train_reference(*ref, ref_p, kind, global);

  parallel::Pipeline<double> pipe(pp_comm, kUnits, make_unit_as<double>, part,
                                 {.schedule = sched, .micro_batches = m, .virtual_stages = v, .data_parallel = dp_comm});
  auto opt = make_opt(kind, pipe.parameters());
  const std::int64_t rows = B / dp;
  for (std::int64_t i = 0; i < steps; ++i) {
    auto& [x, y] = global[static_cast<std::size_t>(i)];
    const double loss = pipe.train_step(x.narrow(replica * rows, rows), y.narrow(replica * rows, rows));
    opt->step();
    INFO("stage " << s << " of " << p << ", replica " << replica << " of " << dp << ", " << schedule_name(sched)
                  << ", m = " << m << ", v = " << v << ", step " << i);
    // Each replica's loss is the mean over its rows; averaged over replicas it is the global mean.
    CHECK(std::abs(loss - ref_losses[static_cast<std::size_t>(i)]) <= kDoubleTol * std::abs(ref_losses[static_cast<std::size_t>(i)]));
    // Counted, not timed (Note [Schedules]): GPipe holds all m, 1F1B at most p - s, interleaved
    // its warm-up + 1 chunk caches (at most m * v).
    CHECK(pipe.peak_live_caches() == want_peak(sched, s, p, m, v));
    CHECK(pipe.peak_live_caches() <= (sched == Schedule::GPipe ? m : v > 1 ? std::min(m * v, (v + 1) * p) : p));
    CHECK(pipe.live_caches() == 0);
    // The timeline follows the schedule: 2mv events, in make_schedule's order.
    auto plan = parallel::make_schedule(sched, s, p, m, v);
    const auto& tl = pipe.timeline();
    CHECK(tl.size() == plan.size());
    for (std::size_t k = 0; k < std::min(tl.size(), plan.size()); ++k) {
      CHECK(tl[k].kind == static_cast<char>(plan[k].kind));
      CHECK(tl[k].micro_batch == plan[k].micro_batch);
      CHECK(tl[k].chunk == plan[k].chunk);
      CHECK(tl[k].end >= tl[k].start);
      if (k) CHECK(tl[k].start >= tl[k - 1].end);
    }
  }
  const double err = rel_error(pipe.module(), *ref);
  INFO("stage " << s << " of " << p << " (" << part.str() << "), replica " << replica << ", "
                << schedule_name(sched) << ", m = " << m << ": relative error " << err);
  CHECK(err <= kDoubleTol);
}

}  // namespace

TEST_CASE("partition_by_cuts and partition_balanced", "[pipeline]") {
  auto p = parallel::partition_by_cuts(6, {2, 4});
  CHECK(p.bounds() == std::vector<std::size_t>{0, 2, 4, 6});
  CHECK(p.stage_of(0) == 0);
  CHECK(p.stage_of(3) == 1);
  CHECK(p.stage_of(5) == 2);
  CHECK_THROWS_WITH(parallel::partition_by_cuts(6, {4, 2}), Catch::Contains("[ptrain.pipeline.cuts]"));
  CHECK_THROWS_WITH(parallel::partition_by_cuts(6, {0}), Catch::Contains("[ptrain.pipeline.cuts]"));
  CHECK_THROWS_WITH(parallel::partition_balanced({1, 2}, 3), Catch::Contains("[ptrain.pipeline.balance]"));

  // Against brute force over every set of cut points: the same smallest maximum.
  Generator g(3);
  for (int trial = 0; trial < 40; ++trial) {
    const std::size_t n = 2 + g.below(7);
    const int stages = 1 + static_cast<int>(g.below(std::min<std::uint64_t>(n, 4)));
    std::vector<double> cost(n);
    for (auto& c : cost) c = static_cast<double>(g.below(20));
    auto part = parallel::partition_balanced(cost, stages);
    REQUIRE(part.num_stages() == stages);
    auto max_cost = [&](const std::vector<std::size_t>& b) {
      double mx = 0;
      for (std::size_t k = 0; k + 1 < b.size(); ++k) {
        double sum = 0;
        for (std::size_t u = b[k]; u < b[k + 1]; ++u) sum += cost[u];
        mx = std::max(mx, sum);
      }
      return mx;
    };
    double best = 1e300;
    for (std::uint64_t mask = 0; mask < (1ull << (n - 1)); ++mask) {  // bit i: cut before unit i + 1
      if (__builtin_popcountll(mask) != stages - 1) continue;
      std::vector<std::size_t> b{0};
      for (std::size_t i = 0; i + 1 < n; ++i)
        if (mask >> i & 1) b.push_back(i + 1);
      b.push_back(n);
      best = std::min(best, max_cost(b));
    }
    INFO("costs of " << n << " units in " << stages << " stages: " << part.str());
    CHECK(max_cost(part.bounds()) == best);
  }
  // Parameter counts of the test units: the heavy middle units get stages of their own.
  auto costs = param_costs();
  auto bal = parallel::partition_balanced(costs, 4);
  double total = 0;
  for (double c : costs) total += c;
  for (int s = 0; s < 4; ++s) {
    double sum = 0;
    for (std::size_t u = bal.begin(s); u < bal.end(s); ++u) sum += costs[u];
    CHECK(sum <= 0.45 * total);
  }
}

TEST_CASE("schedules: each micro-batch runs forward then backward once; 1F1B keeps at most p - s in flight",
          "[pipeline]") {
  for (Schedule sched : {Schedule::GPipe, Schedule::OneFOneB})
    for (int p : {1, 2, 3, 4})
      for (int m : {1, 2, 3, 4, 8})
        for (int s = 0; s < p; ++s) {
          auto plan = parallel::make_schedule(sched, s, p, m);
          INFO(schedule_name(sched) << " p " << p << " m " << m << " stage " << s);
          CHECK(plan.size() == static_cast<std::size_t>(2 * m));
          std::set<int> live, done_f, done_b;
          std::size_t peak = 0;
          int next_f = 0, next_b = 0;
          for (auto a : plan) {
            if (a.kind == parallel::PipelineAction::Forward) {
              CHECK(a.micro_batch == next_f++);  // forwards in order
              live.insert(a.micro_batch);
            } else {
              CHECK(a.micro_batch == next_b++);  // backwards in order, after their forward
              CHECK(live.count(a.micro_batch) == 1);
              live.erase(a.micro_batch);
            }
            peak = std::max(peak, live.size());
          }
          CHECK(live.empty());
          CHECK(peak == static_cast<std::size_t>(sched == Schedule::GPipe ? m : std::min(p - s, m)));
        }
}

namespace {

// A plan as "F<chunk>.<micro-batch>" / "B<chunk>.<micro-batch>", a step's forward and backward joined by '+'.
std::string plan_str(const std::vector<parallel::PipelineAction>& plan) {
  std::string out;
  for (const auto& a : plan)
    out += ptrain::detail::cat(static_cast<char>(a.kind), a.chunk, ".", a.micro_batch, a.with_next ? "+" : " ");
  if (!out.empty()) out.pop_back();
  return out;
}

}  // namespace

TEST_CASE("interleaved schedule: Megatron-LM's order, by hand for small cases", "[pipeline][interleaved]") {
  using parallel::make_schedule;
  // p = 2, v = 2, m = 4. Micro-batches in groups of p: the forwards (chunk.micro-batch) run
  // 0.0 0.1 1.0 1.1 0.2 0.3 1.2 1.3, the backwards 1.0 1.1 0.0 0.1 1.2 1.3 0.2 0.3. Stage 0 warms
  // up with 2(p - 1) + (v - 1)p = 4 forwards, stage 1 with 2; then forward + backward steps; then
  // the remaining backwards.
  CHECK(plan_str(make_schedule(Schedule::Interleaved, 0, 2, 4, 2)) ==
        "F0.0 F0.1 F1.0 F1.1 F0.2+B1.0 F0.3+B1.1 F1.2+B0.0 F1.3+B0.1 B1.2 B1.3 B0.2 B0.3");
  CHECK(plan_str(make_schedule(Schedule::Interleaved, 1, 2, 4, 2)) ==
        "F0.0 F0.1 F1.0+B1.0 F1.1+B1.1 F0.2+B0.0 F0.3+B0.1 F1.2+B1.2 F1.3+B1.3 B0.2 B0.3");
  // p = 3, v = 2, m = 3: the warm-ups 7, 5 and 3 are capped at m·v = 6, so stage 0 runs every forward first.
  CHECK(plan_str(make_schedule(Schedule::Interleaved, 0, 3, 3, 2)) ==
        "F0.0 F0.1 F0.2 F1.0 F1.1 F1.2 B1.0 B1.1 B1.2 B0.0 B0.1 B0.2");
  CHECK(plan_str(make_schedule(Schedule::Interleaved, 1, 3, 3, 2)) ==
        "F0.0 F0.1 F0.2 F1.0 F1.1 F1.2+B1.0 B1.1 B1.2 B0.0 B0.1 B0.2");
  CHECK(plan_str(make_schedule(Schedule::Interleaved, 2, 3, 3, 2)) ==
        "F0.0 F0.1 F0.2 F1.0+B1.0 F1.1+B1.1 F1.2+B1.2 B0.0 B0.1 B0.2");
  // v = 1 is 1F1B.
  CHECK(plan_str(make_schedule(Schedule::Interleaved, 0, 3, 5, 1)) ==
        plan_str(make_schedule(Schedule::OneFOneB, 0, 3, 5, 1)));
  CHECK(plan_str(make_schedule(Schedule::OneFOneB, 0, 2, 3)) == "F0.0 F0.1 B0.0 F0.2 B0.1 B0.2");
  // Refused: m not a multiple of p, chunks without the interleaved schedule, one stage.
  CHECK_THROWS_WITH(make_schedule(Schedule::Interleaved, 0, 3, 4, 2),
                    Catch::Contains("[ptrain.pipeline.micro_batches]") && Catch::Contains("not a multiple of 3") &&
                        Catch::Contains("use 6"));
  CHECK_THROWS_WITH(make_schedule(Schedule::OneFOneB, 0, 2, 4, 2),
                    Catch::Contains("[ptrain.pipeline.virtual_stages]") && Catch::Contains("Interleaved"));
  CHECK_THROWS_WITH(make_schedule(Schedule::Interleaved, 0, 1, 4, 2), Catch::Contains("[ptrain.pipeline.virtual_stages]"));
  CHECK_THROWS_WITH(make_schedule(Schedule::Interleaved, 0, 2, 4, 0), Catch::Contains("[ptrain.pipeline.virtual_stages]"));
}

TEST_CASE("interleaved schedule: every chunk's micro-batch forward then backward once; caches as counted",
          "[pipeline][interleaved]") {
  for (int p : {2, 3, 4, 5})
    for (int v : {2, 3, 4})
      for (int m = p; m <= 4 * p; m += p)
        for (int s = 0; s < p; ++s) {
          const auto plan = parallel::make_schedule(Schedule::Interleaved, s, p, m, v);
          INFO("p " << p << " v " << v << " m " << m << " stage " << s << ": " << plan_str(plan));
          CHECK(plan.size() == static_cast<std::size_t>(2 * m * v));
          std::set<std::pair<int, int>> live, done;
          std::size_t peak = 0;
          int forwards = 0, warmup = 0;  // warm-up: the forwards before the first step that pairs or runs a backward
          for (const auto& a : plan) {
            if (a.kind != parallel::PipelineAction::Forward || a.with_next) break;
            ++warmup;
          }
          for (std::size_t k = 0; k < plan.size(); ++k) {
            const auto& a = plan[k];
            const std::pair<int, int> key{a.chunk, a.micro_batch};
            CHECK((a.chunk >= 0 && a.chunk < v && a.micro_batch >= 0 && a.micro_batch < m));
            if (a.kind == parallel::PipelineAction::Forward) {
              // Forwards: micro-batches in groups of p, each group through chunks 0, 1, ...
              const int g = forwards / (p * v), r = forwards % (p * v);
              CHECK(a.chunk == r / p);
              CHECK(a.micro_batch == g * p + r % p);
              ++forwards;
              CHECK(live.insert(key).second);
            } else {
              CHECK(live.erase(key) == 1);  // after its forward
              CHECK(done.insert(key).second);
            }
            // Only a forward followed by a backward makes one step.
            if (a.with_next)
              CHECK((a.kind == parallel::PipelineAction::Forward && k + 1 < plan.size() &&
                     plan[k + 1].kind == parallel::PipelineAction::Backward));
            peak = std::max(peak, live.size());
          }
          CHECK(live.empty());
          CHECK(done.size() == static_cast<std::size_t>(m * v));
          CHECK(warmup == interleaved_warmup(s, p, m, v));
          CHECK(peak == static_cast<std::size_t>(interleaved_peak(s, p, m, v)));
        }
}

namespace {

// A model of the transfers a stage posts (Note [Communication order]), built
// from the rules, not from the engine: model chunk g = c·p + s takes its input
// from chunk g - 1 and sends its output to g + 1, on the ring of stages
// (backward the other way). Ids: "A<g>.<i>" the activation into chunk g of
// micro-batch i, "G<g>.<i>" the gradient into chunk g, "S<g>" the shape of
// chunk g's input, which precedes its first activation on the first step.
struct Xfer {
  bool send;
  int peer;
  std::string id;
};
using XferGroup = std::vector<Xfer>;

// One stage's groups in posting order: the first step's inputs; after each
// step its results (a lone shape send before a chunk's first activation) with
// the next step's inputs (a shape recv ends its group).
std::vector<XferGroup> stage_xfers(const std::vector<parallel::PipelineAction>& plan, int s, int p, int v,
                                   bool shapes) {
  using A = parallel::PipelineAction;
  const int next = (s + 1) % p, prev = (s + p - 1) % p, last = p * v - 1;
  auto cat = [](auto&&... x) { return ptrain::detail::cat(x...); };
  std::vector<XferGroup> groups;
  XferGroup open;
  auto close = [&] {
    if (!open.empty()) groups.push_back(std::exchange(open, {}));
  };
  auto post_inputs = [&](std::size_t k) {  // the inputs of the step that starts at plan[k]
    for (; k < plan.size(); ++k) {
      const A& a = plan[k];
      const int g = a.chunk * p + s;
      if (a.kind == A::Forward && g > 0) {
        if (shapes && a.micro_batch == 0) {
          open.push_back({false, prev, cat("S", g)});
          close();
        }
        open.push_back({false, prev, cat("A", g, ".", a.micro_batch)});
      }
      if (a.kind == A::Backward && g < last) open.push_back({false, next, cat("G", g, ".", a.micro_batch)});
      if (!a.with_next) break;
    }
    close();
  };
  post_inputs(0);
  for (std::size_t k = 0; k < plan.size(); ++k) {
    const A& a = plan[k];
    const int g = a.chunk * p + s;
    if (a.kind == A::Forward && g < last) {
      if (shapes && a.micro_batch == 0) groups.push_back({{true, next, cat("S", g + 1)}});
      open.push_back({true, next, cat("A", g + 1, ".", a.micro_batch)});
    }
    if (a.kind == A::Backward && g > 0) open.push_back({true, prev, cat("G", g - 1, ".", a.micro_batch)});
    if (!a.with_next) post_inputs(k + 1);
  }
  return groups;
}

// Replays every stage's groups under NCCL's rules: one stream per rank (a group
// starts when the previous one finished), a send finishes only together with its
// recv, transfers pair by order on each link. Returns "" or what went wrong.
std::string replay(const std::vector<std::vector<XferGroup>>& stages) {
  const int p = static_cast<int>(stages.size());
  // The ids on each directed link, as sent and as received: they must pair up in order.
  std::map<std::pair<int, int>, std::vector<std::string>> sent, received;
  struct Op {
    bool send;
    std::pair<int, int> link;
    std::size_t seq;  // position on its link
    bool done = false;
  };
  std::vector<std::vector<std::vector<Op>>> ops(static_cast<std::size_t>(p));
  for (int s = 0; s < p; ++s)
    for (const auto& g : stages[static_cast<std::size_t>(s)]) {
      auto& og = ops[static_cast<std::size_t>(s)].emplace_back();
      for (const auto& x : g) {
        const std::pair<int, int> link = x.send ? std::pair{s, x.peer} : std::pair{x.peer, s};
        auto& ids = (x.send ? sent : received)[link];
        ids.push_back(x.id);
        og.push_back({x.send, link, ids.size() - 1});
      }
    }
  for (const auto& [link, ids] : sent)
    if (received[link] != ids) return ptrain::detail::cat("link ", link.first, " -> ", link.second, " pairs badly");
  for (const auto& [link, ids] : received)
    if (sent[link] != ids) return ptrain::detail::cat("link ", link.first, " -> ", link.second, " pairs badly");
  std::vector<std::size_t> at(static_cast<std::size_t>(p), 0);  // each stream's current group
  for (bool moved = true; moved;) {
    moved = false;
    for (int s = 0; s < p; ++s) {
      auto& mine = ops[static_cast<std::size_t>(s)];
      const auto us = static_cast<std::size_t>(s);
      if (at[us] == mine.size()) continue;
      for (Op& op : mine[at[us]]) {
        if (op.done) continue;
        const auto peer = static_cast<std::size_t>(op.send ? op.link.second : op.link.first);
        if (at[peer] == ops[peer].size()) continue;
        for (Op& other : ops[peer][at[peer]])
          if (!other.done && other.send != op.send && other.link == op.link && other.seq == op.seq)
            op.done = other.done = moved = true;
      }
      if (std::all_of(mine[at[us]].begin(), mine[at[us]].end(), [](const Op& o) { return o.done; })) {
        ++at[us];
        moved = true;
      }
    }
  }
  for (int s = 0; s < p; ++s)
    if (at[static_cast<std::size_t>(s)] != ops[static_cast<std::size_t>(s)].size())
      return ptrain::detail::cat("deadlock: stage ", s, " stuck in group ", at[static_cast<std::size_t>(s)]);
  return "";
}

}  // namespace

TEST_CASE("interleaved transfers pair in order and cannot deadlock under NCCL's rules (a model)",
          "[pipeline][interleaved]") {
  for (int p = 2; p <= 6; ++p)
    for (int v = 1; v <= 4; ++v)
      for (int m = v > 1 ? p : 1; m <= 4 * p; m += v > 1 ? p : 1)
        for (bool training : {true, false})
          for (bool shapes : {true, false}) {
            const Schedule sched = v > 1 ? Schedule::Interleaved : Schedule::OneFOneB;
            std::vector<std::vector<XferGroup>> stages;
            for (int s = 0; s < p; ++s) {
              auto plan = parallel::make_schedule(sched, s, p, m, v);
              if (!training)  // eval: the forwards alone, one per step
                std::erase_if(plan, [](const auto& a) { return a.kind == parallel::PipelineAction::Backward; });
              for (auto& a : plan) a.with_next = a.with_next && training;
              stages.push_back(stage_xfers(plan, s, p, v, shapes));
            }
            INFO("p " << p << " v " << v << " m " << m << (training ? " train" : " eval")
                      << (shapes ? " with shapes" : ""));
            CHECK(replay(stages) == "");
          }
  // The model can fail: one action per step instead of the interleaved pairs deadlocks (p = 2, v = 2, m = 4).
  std::vector<std::vector<XferGroup>> unpaired;
  for (int s = 0; s < 2; ++s) {
    auto plan = parallel::make_schedule(Schedule::Interleaved, s, 2, 4, 2);
    for (auto& a : plan) a.with_next = false;
    unpaired.push_back(stage_xfers(plan, s, 2, 2, false));
  }
  CHECK_THAT(replay(unpaired), Catch::Contains("deadlock"));
}

TEST_CASE("pipeline training equals one process on the full batch, every schedule and m", "[pipeline]") {
  auto& comm = world();
  const int p = comm.size();
  // Balanced by parameter count, and explicit cuts (every stage gets kUnits / p units, the last the rest).
  std::vector<std::size_t> cuts;
  for (int s = 1; s < p; ++s) cuts.push_back(static_cast<std::size_t>(s) * (kUnits / static_cast<std::size_t>(p)));
  const auto balanced = parallel::partition_balanced(param_costs(), p);
  const auto explicit_cuts = parallel::partition_by_cuts(kUnits, cuts);
  for (Schedule sched : {Schedule::GPipe, Schedule::OneFOneB})
    for (int m : {1, 2, 4, 8}) {
      check_pipeline(comm, nullptr, sched, m, m % 4 == 0 ? Opt::AdamW : Opt::SGD,
                     m <= 2 ? balanced : explicit_cuts);
    }
}

TEST_CASE("interleaved pipelines (v = 2, 3, 4) train like one process; bad options are refused",
          "[pipeline][interleaved]") {
  auto& comm = world();
  const int p = comm.size();
  if (p < 2) return;  // one stage has nothing to interleave
  for (int v : {2, 3, 4}) {
    if (p * v > static_cast<int>(kUnits)) continue;
    const auto part = parallel::partition_balanced(param_costs(), p * v);
    for (int m : {p, 2 * p}) check_pipeline(comm, nullptr, Schedule::Interleaved, m, m == p ? Opt::SGD : Opt::AdamW, part, v);
  }
  // Refused by the constructor, which does not communicate, so every rank throws alike.
  using Options = parallel::PipelineOptions<float>;
  const auto chunks = parallel::partition_balanced(param_costs(), 2 * p);
  const Options ok{.schedule = Schedule::Interleaved, .micro_batches = p, .virtual_stages = 2};
  auto with = [&](auto change) {
    Options o = ok;
    change(o);
    return o;
  };
  CHECK_THROWS_WITH(parallel::Pipeline<float>(comm, kUnits, make_unit, chunks, with([&](Options& o) { o.micro_batches = p + 1; })),
                    Catch::Contains("[ptrain.pipeline.micro_batches]") && Catch::Contains("not a multiple of"));
  CHECK_THROWS_WITH(parallel::Pipeline<float>(comm, kUnits, make_unit, chunks,
                                              with([](Options& o) { o.schedule = Schedule::OneFOneB; })),
                    Catch::Contains("[ptrain.pipeline.virtual_stages]"));
  CHECK_THROWS_WITH(parallel::Pipeline<float>(comm, kUnits, make_unit, parallel::partition_balanced(param_costs(), p), ok),
                    Catch::Contains("[ptrain.pipeline.stages]") && Catch::Contains("partition_balanced(costs, p * v)"));
  parallel::Pipeline<float> pipe(comm, kUnits, make_unit, chunks, ok);
  CHECK_THROWS_WITH(pipe.set_micro_batches(p + 1), Catch::Contains("[ptrain.pipeline.micro_batches]"));
  CHECK_THROWS_WITH(pipe.set_schedule(Schedule::GPipe), Catch::Contains("[ptrain.pipeline.virtual_stages]"));
  CHECK(pipe.options().micro_batches == p);
  CHECK(pipe.options().schedule == Schedule::Interleaved);
}

TEST_CASE("make_engine: a PipelinePlan with virtual stages balances p * v chunks and trains like one process",
          "[pipeline][interleaved]") {
  auto& comm = world();
  const int p = comm.size();
  if (p < 2) return;  // one stage has nothing to interleave
  const Batch b = make_batch(4 * p, 61);
  auto ref = full_model();
  nn::FlatParameters<float> ref_p(*ref);
  const double ref_loss = train_reference(*ref, ref_p, Opt::SGD, {{b.x, b.y}}).at(0);
  auto engine = parallel::make_engine<float>(
      std::shared_ptr<nn::Sequential<float>>(full_model()), comm,
      parallel::PipelinePlan<float>{
          .stages = p, .unit_costs = param_costs(),
          .options = {.schedule = Schedule::Interleaved, .micro_batches = p, .virtual_stages = 2}});
  auto& pipe = static_cast<parallel::Pipeline<float>&>(*engine);
  CHECK(pipe.partition().bounds() == parallel::partition_balanced(param_costs(), 2 * p).bounds());
  auto opt = make_opt(Opt::SGD, engine->parameters());
  engine->zero_grad();
  const double loss = engine->forward_backward(b.x, b.y);
  engine->step(*opt);
  INFO("stage " << comm.rank() << " of " << p);
  CHECK(std::abs(loss - ref_loss) <= kFloatSgdTol * ref_loss);
  CHECK(rel_error(pipe.module(), *ref) <= kFloatSgdTol);
}

// The pipeline runs each chunk on each micro-batch with the ops one process runs
// on that micro-batch, and adds the micro-batches' gradients in the same order:
// the results are the same bits.
TEST_CASE("interleaved: loss and every gradient are bitwise those of one process on the same micro-batches",
          "[pipeline][interleaved]") {
  auto& comm = world();
  const int p = comm.size(), s = comm.rank();
  if (p < 2) return;  // one stage has nothing to interleave
  for (int v : {2, 3}) {
    if (p * v > static_cast<int>(kUnits)) continue;
    const int m = 2 * p;
    const std::int64_t rows = 2;
    const Batch b = make_batch(rows * m, 31);
    auto ref = full_model();
    nn::FlatParameters<float> ref_p(*ref);
    ref_p.zero_grad();
    double ref_loss = 0;
    const auto scale = static_cast<float>(1.0 / m);  // as the pipeline scales each micro-batch's loss gradient
    for (int i = 0; i < m; ++i) {
      nn::CrossEntropyLoss<float> ce;
      nn::Cache<float> c, lc;
      ref_loss += ce.forward(ref->forward(b.x.narrow(i * rows, rows), c), b.y.narrow(i * rows, rows), lc);
      ref->backward(ce.backward(lc, scale), c);
    }
    ref_loss /= m;

    const auto part = parallel::partition_balanced(param_costs(), p * v);
    parallel::Pipeline<float> pipe(comm, kUnits, make_unit, part,
                                   {.schedule = Schedule::Interleaved, .micro_batches = m, .virtual_stages = v});
    const double loss = pipe.train_step(b.x, b.y);
    INFO("stage " << s << " of " << p << ", v = " << v << " (" << part.str() << ")");
    CHECK(loss == ref_loss);
    std::map<std::string, Tensor<float>> want;
    for (auto& prm : ref->named_parameters()) want[prm.name] = prm.param->grad;
    bool same = true;
    std::size_t compared = 0;
    for (auto& prm : pipe.module().named_parameters()) {
      const auto it = want.find(prm.name);
      same = same && it != want.end() && identical(prm.param->grad, it->second);
      ++compared;
    }
    CHECK(same);
    // This stage holds chunks s, s + p, ...: their units, weight and bias each.
    std::vector<std::size_t> units;
    for (int c = 0; c < v; ++c)
      for (std::size_t u = part.begin(c * p + s); u < part.end(c * p + s); ++u) units.push_back(u);
    CHECK(pipe.units_of(s) == units);
    CHECK(compared == 2 * units.size());
    CHECK(pipe.parameters().entries().size() == compared);  // one FlatParameters over every chunk
  }
}

TEST_CASE("dp x pp meshes (2 x 2 on four ranks) equal one process", "[pipeline][mesh]") {
  auto& comm = world();
  const int n = comm.size();
  for (int pp = 1; pp <= n; ++pp) {
    if (n % pp) continue;
    const int dp = n / pp;
    parallel::Mesh mesh(comm, dp, pp);
    CHECK(mesh.pipeline_group().size() == pp);
    CHECK(mesh.data_group().size() == dp);
    CHECK(mesh.world_rank(mesh.replica(), mesh.stage()) == comm.rank());
    const auto part = parallel::partition_balanced(param_costs(), pp);
    for (Schedule sched : {Schedule::GPipe, Schedule::OneFOneB})
      check_pipeline(mesh.pipeline_group(), &mesh.data_group(), sched, 4, Opt::AdamW, part);
    if (pp >= 2)  // two chunks per stage, m = 4 or 3
      check_pipeline(mesh.pipeline_group(), &mesh.data_group(), Schedule::Interleaved, 4 % pp == 0 ? 4 : pp,
                     Opt::AdamW, parallel::partition_balanced(param_costs(), 2 * pp), 2);
  }
}

namespace {
// testing::frozen_mlp cut into pp stages (units 0 and 1, all frozen, on stage 0), dp
// replicas, two micro-batches, AdamW with weight decay and clipping, against one
// process on the global batch. Replicas other than 0 build the model from another
// seed: Mesh::broadcast_parameters must send the frozen values too. A stage of frozen
// units has parameters but no gradient to average over the replicas.
template <class T>
void check_frozen_pipeline(parallel::Mesh& mesh, double tol) {
  const int dp = mesh.dp_size(), pp = mesh.pp_size(), replica = mesh.replica();
  const std::int64_t rows = 4, steps = 4;  // per replica: two micro-batches of two rows
  Generator ga(7), gb(7 + static_cast<std::uint64_t>(replica));
  auto ref = testing::frozen_mlp<T>(ga);
  auto full = testing::frozen_mlp<T>(gb);
  nn::FlatParameters<T> ref_p(*ref);
  std::map<std::string, std::vector<T>> frozen_before;
  for (const auto& e : ref_p.frozen_entries()) frozen_before[e.name] = e.param->value.to_vector();
  std::vector<std::size_t> cuts;
  for (int s = 1; s < pp; ++s) cuts.push_back(static_cast<std::size_t>(s) + 1);
  parallel::Pipeline<T> pipe(mesh, full->units().size(), [&](std::size_t u) { return full->units()[u]; },
                             parallel::partition_by_cuts(full->units().size(), cuts),
                             {.schedule = Schedule::OneFOneB, .micro_batches = 2});
  mesh.broadcast_parameters(pipe.parameters());
  CHECK(pipe.has_parameters());
  const optim::AdamWOptions adam{.lr = 0.01, .eps = 1e-6, .weight_decay = 0.1};
  optim::AdamW<T> ref_opt(ref_p, adam), opt(pipe.parameters(), adam);
  nn::CrossEntropyLoss<T> ce;
  for (std::int64_t i = 0; i < steps; ++i) {
    Generator gd(300 + static_cast<std::uint64_t>(i));
    auto x = Tensor<T>::empty({dp * rows, 10});
    auto y = Tensor<std::int32_t>::empty({dp * rows});
    ops::uniform_(x, -1.0, 1.0, gd);
    for (std::int64_t k = 0; k < dp * rows; ++k) y.data()[k] = static_cast<std::int32_t>(gd.below(4));
    nn::Cache<T> c, lc;
    ref_p.zero_grad();
    const double ref_loss = ce.forward(ref->forward(x, c), y, lc);
    ref->backward(ce.backward(lc), c);
    const double ref_norm = optim::clip_grad_norm_(ref_p.grads(), 1.0);
    ref_opt.step();
    pipe.zero_grad();
    const double loss = pipe.forward_backward(x.narrow(replica * rows, rows), y.narrow(replica * rows, rows));
    const double norm = pipe.clip_grad_norm_(1.0);
    pipe.step(opt);
    INFO("stage " << mesh.stage() << " of " << pp << ", replica " << replica << " of " << dp << ", step " << i);
    CHECK(std::abs(loss - ref_loss) <= tol * std::abs(ref_loss));
    CHECK(std::abs(norm - ref_norm) <= tol * ref_norm);
  }
  const double err = rel_error(pipe.module(), *ref);
  INFO("frozen MLP, stage " << mesh.stage() << " of " << pp << ", replica " << replica << ": relative error " << err);
  CHECK(err <= tol);
  for (auto& p : pipe.module().named_parameters())
    if (!p.param->requires_grad) CHECK(p.param->value.to_vector() == frozen_before[p.name]);  // bit for bit
}
}  // namespace

TEST_CASE("a pipeline with frozen units equals one process (pp 2, dp x pp 2 x 2, pp 3); frozen values stay",
          "[pipeline][frozen]") {
  auto& comm = world();
  const int pp = comm.size() % 2 == 0 ? 2 : comm.size();
  parallel::Mesh mesh(comm, comm.size() / pp, pp);
  check_frozen_pipeline<double>(mesh, 1e-9);
  check_frozen_pipeline<float>(mesh, 2e-4);
}

// NcclModel (nccl_model.hpp) runs over MPI; under ptrun (Gloo) these cases have nothing to run.
TEST_CASE("NcclModel: crossing sends deadlock unless grouped, and tags are refused", "[pipeline][nccl_model]") {
  auto& comm = world();
  if (comm.backend() != "mpi") return;
  NcclModel model(comm), fresh(comm);
  model.set_timeout(std::chrono::milliseconds(1500));  // how long a deadlock takes to be reported
  const auto wait_long = std::chrono::seconds(60);     // waits outlast the model's own verdict
  const int r = model.rank(), peer = r ^ 1;
  const bool paired = peer < model.size();  // the last of an odd number of ranks sits out
  const std::size_t n = 1000;
  std::vector<float> mine(n, static_cast<float>(r + 1)), got(n, -1.0f);
  if (paired) {
    CHECK_THROWS_WITH(model.send_async(mine.data(), n, DType::F32, peer, 3), Catch::Contains("[nccl_model.tag]"));
    // Each rank sends, then receives: under NCCL's rules each send waits for a recv
    // that sits behind the other rank's send on its stream.
    auto s1 = model.send_async(mine.data(), n, DType::F32, peer, 0);
    auto r1 = model.recv_async(got.data(), n, DType::F32, peer, 0);
    CHECK_THROWS_WITH(s1->wait(wait_long),
                      Catch::Contains("[nccl_model.deadlock]") && Catch::Contains("send(F32 x 1000"));
    CHECK_THROWS(r1->wait(wait_long));  // the model is aborted after a deadlock
  }
  // Every rank has its verdict before any completes the stuck transfers on the
  // private communicator (taking the peer's data and acknowledging it), so
  // nothing stays posted there.
  comm.barrier();
  if (!paired) return;
  std::vector<float> drained(n);
  std::int32_t ack = 1;
  model.inner().recv(drained.data(), n, DType::F32, peer, 0);
  model.inner().send(&ack, 1, DType::I32, peer, 1);
  CHECK(drained == std::vector<float>(n, static_cast<float>(peer + 1)));

  // The same exchange in one group completes, on a fresh model.
  fresh.group_start();
  auto s2 = fresh.send_async(mine.data(), n, DType::F32, peer, 0);
  auto r2 = fresh.recv_async(got.data(), n, DType::F32, peer, 0);
  fresh.group_end();
  s2->wait(wait_long);
  r2->wait(wait_long);
  CHECK(got == std::vector<float>(n, static_cast<float>(peer + 1)));
}

TEST_CASE("pipelines under NCCL's point-to-point rules equal one process", "[pipeline][nccl_model]") {
  auto& comm = world();
  if (comm.backend() != "mpi") return;
  NcclModel model(comm);
  const int n = model.size();
  const auto part = parallel::partition_balanced(param_costs(), n);
  for (Schedule sched : {Schedule::GPipe, Schedule::OneFOneB})
    for (int m : {1, 2, 8}) check_pipeline(model, nullptr, sched, m, Opt::AdamW, part);
  // Interleaved, two chunks per stage: the ring's wrap-around included (with p = 2 both links join one pair).
  for (int m : {n, 2 * n})
    check_pipeline(model, nullptr, Schedule::Interleaved, m, Opt::AdamW,
                   parallel::partition_balanced(param_costs(), 2 * n), 2);
  for (int pp = 2; pp < n; ++pp) {
    if (n % pp) continue;
    parallel::Mesh mesh(model, n / pp, pp);
    for (Schedule sched : {Schedule::GPipe, Schedule::OneFOneB})
      check_pipeline(mesh.pipeline_group(), &mesh.data_group(), sched, 4, Opt::AdamW,
                     parallel::partition_balanced(param_costs(), pp));
    check_pipeline(mesh.pipeline_group(), &mesh.data_group(), Schedule::Interleaved, 2 * pp, Opt::AdamW,
                   parallel::partition_balanced(param_costs(), 2 * pp), 2);
  }
}

// eval_loss against the reference's forward loss, over the world and (MPI) under
// NCCL's rules: before any train_step (it agrees the shapes itself), and after one,
// when it must leave the accumulated gradients and the parameters as they are.
TEST_CASE("eval_loss: the forward loss of one process, no gradients, no caches kept", "[pipeline][eval]") {
  auto& comm = world();
  std::unique_ptr<NcclModel> model;
  std::vector<dist::Communicator*> comms{&comm};
  if (comm.backend() == "mpi") comms.push_back((model = std::make_unique<NcclModel>(comm)).get());
  const std::int64_t B = 8;
  const int m = 4;
  auto train = make_batch(B, 5), held_out = make_batch(B, 6);
  auto ref = full_model();
  nn::FlatParameters<float> ref_p(*ref);
  auto ref_loss = [&](const Batch& b) {
    nn::CrossEntropyLoss<float> ce;
    nn::Cache<float> c, lc;
    return ce.forward(ref->forward(b.x, c), b.y, lc);
  };
  const double before = ref_loss(held_out);
  train_reference(*ref, ref_p, Opt::SGD, {{train.x, train.y}});
  const double after = ref_loss(held_out);
  for (dist::Communicator* c : comms) {
    const int p = c->size(), s = c->rank();
    parallel::Pipeline<float> pipe(*c, kUnits, make_unit, parallel::partition_balanced(param_costs(), p),
                                   {.micro_batches = m});
    auto opt = make_opt(Opt::SGD, pipe.parameters());
    INFO("stage " << s << " of " << p << " over " << c->backend());
    CHECK(std::abs(pipe.eval_loss(held_out.x, held_out.y) - before) <= kFloatSgdTol * before);
    pipe.train_step(train.x, train.y);
    const auto grads = pipe.parameters().grads().clone(), values = pipe.parameters().values().clone();
    const double loss = pipe.eval_loss(held_out.x, held_out.y);
    CHECK(pipe.live_caches() == 0);
    CHECK(pipe.peak_live_caches() == 1);
    CHECK(pipe.timeline().size() == static_cast<std::size_t>(m));
    for (const auto& e : pipe.timeline()) CHECK(e.kind == 'F');
    CHECK(identical(pipe.parameters().grads(), grads));
    CHECK(identical(pipe.parameters().values(), values));
    opt->step();
    // Evaluated before the update: the loss of the initial parameters again.
    CHECK(std::abs(loss - before) <= kFloatSgdTol * before);
    CHECK(std::abs(pipe.eval_loss(held_out.x, held_out.y) - after) <= kFloatSgdTol * after);
    CHECK(std::abs(after - before) > 1e-3 * before);  // the step changed the loss: the check above can fail
  }
}

// A loss of the test's own: half the squared distance of each output row to its
// target's one-hot vector, averaged over the rows; with dout, scale times its gradient.
double one_hot_sq_loss(const Tensor<float>& y, const Tensor<std::int32_t>& t, Tensor<float>* dout, float scale) {
  const std::int64_t rows = y.size(0), cols = y.size(1);
  if (dout) *dout = Tensor<float>::empty(y.shape());
  double sum = 0;
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) {
      const double d = static_cast<double>(y.data()[i * cols + j]) - (j == t.data()[i] ? 1.0 : 0.0);
      sum += 0.5 * d * d;
      if (dout) dout->data()[i * cols + j] = static_cast<float>(scale * d / static_cast<double>(rows));
    }
  return sum / static_cast<double>(rows);
}

// PipelineOptions::loss against one process trained with the same loss on the
// whole batch; eval_loss must ask it for no gradient, train_step for every one.
TEST_CASE("A custom loss trains like one process; eval_loss asks it for no gradient", "[pipeline][loss]") {
  auto& comm = world();
  const int p = comm.size(), s = comm.rank();
  const std::int64_t B = 8, steps = 2;
  const int m = 4;
  std::vector<Batch> batches;
  for (std::int64_t i = 0; i < steps; ++i) batches.push_back(make_batch(B, 90 + static_cast<std::uint64_t>(i)));
  auto held_out = make_batch(B, 99);

  auto ref = full_model();
  nn::FlatParameters<float> ref_p(*ref);
  auto ref_opt = make_opt(Opt::SGD, ref_p);
  auto ref_eval = [&] {
    nn::Cache<float> c;
    return one_hot_sq_loss(ref->forward(held_out.x, c), held_out.y, nullptr, 1.0f);
  };
  const double eval_before = ref_eval();
  std::vector<double> ref_losses;
  for (const Batch& b : batches) {
    nn::Cache<float> c;
    ref_p.zero_grad();
    Tensor<float> dout;
    ref_losses.push_back(one_hot_sq_loss(ref->forward(b.x, c), b.y, &dout, 1.0f));
    ref->backward(dout, c);
    ref_opt->step();
  }
  const double eval_after = ref_eval();

  int with_grad = 0, without = 0;  // calls on this stage (the last one makes them all)
  auto loss = [&](const Tensor<float>& y, const Tensor<std::int32_t>& t, Tensor<float>* dout, float scale) {
    ++(dout ? with_grad : without);
    return one_hot_sq_loss(y, t, dout, scale);
  };
  parallel::Pipeline<float> pipe(comm, kUnits, make_unit, parallel::partition_balanced(param_costs(), p),
                                 {.micro_batches = m, .loss = loss});
  auto opt = make_opt(Opt::SGD, pipe.parameters());
  INFO("stage " << s << " of " << p);
  for (std::int64_t i = 0; i < steps; ++i) {
    const double got = pipe.train_step(batches[static_cast<std::size_t>(i)].x, batches[static_cast<std::size_t>(i)].y);
    opt->step();
    const double want = ref_losses[static_cast<std::size_t>(i)];
    CHECK(std::abs(got - want) <= kFloatSgdTol * want);
  }
  CHECK(rel_error(pipe.module(), *ref) <= kFloatSgdTol);
  const int last = s == p - 1 ? 1 : 0;
  CHECK(with_grad == last * m * static_cast<int>(steps));
  CHECK(without == 0);
  CHECK(std::abs(pipe.eval_loss(held_out.x, held_out.y) - eval_after) <= kFloatSgdTol * eval_after);
  CHECK(without == last * m);
  CHECK(std::abs(eval_after - eval_before) > 1e-3 * eval_before);  // the steps changed the loss: the checks can fail
}

TEST_CASE("mesh broadcast_parameters copies replica 0's values", "[pipeline][mesh]") {
  auto& comm = world();
  if (comm.size() % 2) return;
  parallel::Mesh mesh(comm, 2, comm.size() / 2);
  // Each replica starts from other values; after the broadcast both hold replica 0's.
  auto factory = [&](std::size_t u) {
    auto unit = make_unit(u);
    for (auto& p : unit->named_parameters()) ops::fill_(p.param->value, static_cast<float>(mesh.replica() + 1));
    return unit;
  };
  parallel::Pipeline<float> pipe(mesh.pipeline_group(), kUnits, factory,
                                 parallel::partition_balanced(param_costs(), mesh.pp_size()));
  mesh.broadcast_parameters(pipe.parameters());
  bool all_one = true;
  for (auto& p : pipe.module().named_parameters())
    for (float v : p.param->value.to_vector()) all_one = all_one && v == 1.0f;
  CHECK(all_one);
}

// The GPT pipelines run in double, like check_pipeline: see kDoubleTol.

TEST_CASE("GPT (untied) in a pipeline equals one process; a tied GPT is refused", "[pipeline][gpt]") {
  auto& comm = world();
  const int p = comm.size(), s = comm.rank();
  const nn::GPTConfig cfg = pipeline_gpt(std::max(2, p - 1));
  const std::size_t units = static_cast<std::size_t>(cfg.n_layer) + 2;
  auto factory_for = [](nn::GPTConfig c) { return gpt_units<double>(c, 7); };
  Generator gr(7);
  nn::GPT<double> ref(cfg, gr);
  nn::FlatParameters<double> ref_p(ref);
  const std::int64_t B = 4, S = 8, steps = 2;
  // Floating-point ids through train_step() and int32 ids through train_step() take turns.
  std::vector<std::pair<Tensor<double>, Tensor<std::int32_t>>> batches;
  std::vector<Tensor<std::int32_t>> int_ids;
  for (std::int64_t i = 0; i < steps; ++i) {
    auto [ids, tgt] = make_tokens(B, S, cfg.vocab_size, 11 + static_cast<std::uint64_t>(i));
    auto fids = Tensor<double>::empty({B, S});
    for (std::int64_t k = 0; k < B * S; ++k) fids.data()[k] = static_cast<double>(ids.data()[k]);
    batches.emplace_back(fids, tgt);
    int_ids.push_back(ids);
  }
  auto ref_losses = train_reference(ref, ref_p, Opt::AdamW, batches);
  // Last, 1F1B with recomputed blocks: several micro-batches' forwards before their backwards.
  for (auto [sched, recompute] : {std::pair{Schedule::GPipe, false}, std::pair{Schedule::OneFOneB, false},
                                  std::pair{Schedule::OneFOneB, true}}) {
    std::vector<double> cost;
    for (std::size_t u = 0; u < units; ++u) cost.push_back(static_cast<double>(ref.units()[u]->num_parameters()));
    auto stage_cfg = cfg;
    stage_cfg.recompute = recompute;
    parallel::Pipeline<double> pipe(comm, units, factory_for(stage_cfg), parallel::partition_balanced(cost, p),
                                   {.schedule = sched, .micro_batches = 2, .unit_names = ref.unit_names()});
    auto opt = make_opt(Opt::AdamW, pipe.parameters());
    for (std::int64_t i = 0; i < steps; ++i) {
      const auto& [x, y] = batches[static_cast<std::size_t>(i)];
      const double loss = i % 2 ? pipe.train_step(int_ids[static_cast<std::size_t>(i)], y) : pipe.train_step(x, y);
      opt->step();
      CHECK(std::abs(loss - ref_losses[static_cast<std::size_t>(i)]) <= kDoubleTol * ref_losses[static_cast<std::size_t>(i)]);
    }
    const double err = rel_error(pipe.module(), ref);
    INFO("GPT stage " << s << " of " << p << ", " << schedule_name(sched) << (recompute ? ", recompute" : "")
                      << ": relative error " << err);
    CHECK(err <= kDoubleTol);
  }
  // Tied: the stage holding the head refuses to build (no communication in the constructor).
  auto tied = cfg;
  tied.tie_weights = true;
  std::vector<std::size_t> cuts;
  for (int k = 1; k < p; ++k) cuts.push_back(static_cast<std::size_t>(k));
  const auto one_each = parallel::partition_by_cuts(units, cuts);  // the last stage holds the head
  if (s == p - 1) {
    CHECK_THROWS_WITH(parallel::Pipeline<double>(comm, units, factory_for(tied), one_each),
                      Catch::Contains("[ptrain.pipeline.tied]") && Catch::Contains("tie_weights = false"));
  } else {
    CHECK_NOTHROW(parallel::Pipeline<double>(comm, units, factory_for(tied), one_each));
  }
}

// A GPT cut into p·v chunks of one unit each, trained from int32 token ids
// through the interleaved schedule, against one process on the whole batch;
// then eval_loss and the global gradient norm of clip_grad_norm_.
TEST_CASE("a GPT from token ids trains through the interleaved schedule like one process",
          "[pipeline][interleaved][gpt]") {
  auto& comm = world();
  const int p = comm.size(), s = comm.rank(), v = 2, m = p;
  if (p < 2) return;  // one stage has nothing to interleave
  const nn::GPTConfig cfg = pipeline_gpt(p * v - 2);
  const auto units = static_cast<std::size_t>(cfg.n_layer) + 2;
  Generator gr(7);
  nn::GPT<double> ref(cfg, gr);
  nn::FlatParameters<double> ref_p(ref);
  const std::int64_t B = 2 * m, S = 8;
  auto as_real = [](const Tensor<std::int32_t>& ids) {
    auto f = Tensor<double>::empty(ids.shape());
    for (std::int64_t k = 0; k < ids.numel(); ++k) f.data()[k] = static_cast<double>(ids.data()[k]);
    return f;
  };
  std::vector<std::pair<Tensor<std::int32_t>, Tensor<std::int32_t>>> batches;
  std::vector<std::pair<Tensor<double>, Tensor<std::int32_t>>> real_batches;
  for (std::uint64_t i = 0; i < 2; ++i) {
    batches.push_back(make_tokens(B, S, cfg.vocab_size, 40 + i));
    real_batches.emplace_back(as_real(batches.back().first), batches.back().second);
  }
  const auto [held_ids, held_tgt] = make_tokens(B, S, cfg.vocab_size, 49);
  const auto ref_losses = train_reference(ref, ref_p, Opt::AdamW, real_batches);

  parallel::Pipeline<double> pipe(comm, units, gpt_units<double>(cfg, 7),
                                 parallel::partition_balanced(std::vector<double>(units, 1.0), p * v),
                                 {.schedule = Schedule::Interleaved, .micro_batches = m, .virtual_stages = v,
                                  .unit_names = ref.unit_names()});
  CHECK(pipe.units_of(s) == std::vector<std::size_t>{static_cast<std::size_t>(s), static_cast<std::size_t>(s + p)});
  auto opt = make_opt(Opt::AdamW, pipe.parameters());
  for (std::size_t i = 0; i < batches.size(); ++i) {
    const double loss = pipe.train_step(batches[i].first, batches[i].second);
    opt->step();
    INFO("stage " << s << " of " << p << ", step " << i);
    CHECK(std::abs(loss - ref_losses[i]) <= kDoubleTol * ref_losses[i]);
  }
  INFO("GPT stage " << s << " of " << p << ", interleaved v = " << v);
  CHECK(rel_error(pipe.module(), ref) <= kDoubleTol);

  nn::CrossEntropyLoss<double> ce;
  nn::Cache<double> c, lc;
  const double want_eval = ce.forward(ref.forward(as_real(held_ids), c), held_tgt, lc);
  CHECK(std::abs(pipe.eval_loss(held_ids, held_tgt) - want_eval) <= kDoubleTol * want_eval);
  CHECK(pipe.peak_live_caches() == 1);
  CHECK(pipe.timeline().size() == static_cast<std::size_t>(m * v));

  // The gradient of the held-out batch: its global norm over the stages is one process's.
  ref_p.zero_grad();
  ref.backward(ce.backward(lc), c);
  double sq = 0;
  for (double g : ref_p.grads().to_vector()) sq += g * g;
  pipe.train_step(held_ids, held_tgt);
  const double norm = pipe.clip_grad_norm_(1e9);
  CHECK(std::abs(norm - std::sqrt(sq)) <= kDoubleTol * std::sqrt(sq));
}

// A bf16 GPT (int32 ids through train_step, fp32 master weights in
// AdamW) in a pipeline against the same model in one process on the whole
// batch. The pipeline adds two micro-batches' bf16 gradients where the one
// process rounds the batch gradient once, and Adam turns a rounding flip of a
// small gradient into a full step, so the runs drift apart slowly. The losses
// must stay within 2e-2 of the first loss at every step while the loss falls
// by a fifth (so the steps are real); a wrong activation or gradient between
// stages is off by far more.
TEST_CASE("a bf16 GPT trains in a pipeline from token ids like one process", "[pipeline][gpt][bf16]") {
  auto& comm = world();
  const int p = comm.size(), s = comm.rank();
  const nn::GPTConfig cfg = pipeline_gpt(std::max(2, p - 1));
  const std::size_t units = static_cast<std::size_t>(cfg.n_layer) + 2;
  const auto [ids, tgt] = make_tokens(4, 8, cfg.vocab_size, 21);
  const optim::AdamWOptions adam{.lr = 0.02, .weight_decay = 0.1};
  Generator gr(7);
  nn::GPT<bf16> ref(cfg, gr);
  nn::FlatParameters<bf16> ref_p(ref);
  optim::AdamW<bf16> ref_opt(ref_p, adam);
  nn::CrossEntropyLoss<bf16> ce;
  std::vector<double> cost;
  for (const auto& u : ref.units()) cost.push_back(static_cast<double>(u->num_parameters()));
  parallel::Pipeline<bf16> pipe(comm, units, gpt_units<bf16>(cfg, 7), parallel::partition_balanced(cost, p),
                                {.micro_batches = 2, .unit_names = ref.unit_names()});
  optim::AdamW<bf16> opt(pipe.parameters(), adam);
  double first = 0, last_ref = 0;
  for (int step = 0; step < 8; ++step) {
    nn::Cache<bf16> c, lc;
    ref_p.zero_grad();
    last_ref = ce.forward(ref.forward_tokens(ids, c), tgt, lc);
    ref.backward(ce.backward(lc), c);
    ref_opt.step();
    if (step == 0) first = last_ref;
    const double loss = pipe.train_step(ids, tgt);
    opt.step();
    INFO("step " << step << ": stage " << s << " of " << p << ", pipeline " << loss << ", one process " << last_ref);
    CHECK(std::abs(loss - last_ref) <= 2e-2 * first);
  }
  CHECK(last_ref < 0.8 * first);
}

// ---- a stage that dies ------------------------------------------------------

namespace {

// Pass-through unit whose forward kills the process on its k-th call.
class KillSwitch : public nn::Module<float> {
 public:
  explicit KillSwitch(int after) : after_(after) {}
  Tensor<float> forward(const Tensor<float>& x, nn::Cache<float>&) override {
    if (++calls_ == after_) std::raise(SIGKILL);
    return x;
  }
  Tensor<float> backward(const Tensor<float>& dy, nn::Cache<float>&) override { return dy; }
  std::string describe() const override { return "KillSwitch"; }

 private:
  int after_, calls_ = 0;
};

using ptrain::testing::free_port;
using ptrain::testing::self_exe;

// Spawns `world_size` Gloo ranks running [.pipe_kill_child] (v chunks per
// stage); `victim` kills itself in the middle of a step. Every survivor must
// end with the pipeline's CommError within the timeout, and no process may be left.
void pipe_kill_scenario(int world_size, int victim, int timeout_s, int v = 1) {
  std::string exe = self_exe(), port = std::to_string(free_port());
  std::string dir = "/tmp/ptrain_pipe_kill_" + std::to_string(::getpid()) + "_" + std::to_string(victim);
  REQUIRE(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()) == 0);
  std::vector<pid_t> pids;
  const auto started = std::chrono::steady_clock::now();
  for (int r = 0; r < world_size; ++r) {
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ptrain::testing::set_gloo_rank_env(r, world_size, port, timeout_s, dir);
      ::setenv("PTRAIN_KILL_RANK", std::to_string(victim).c_str(), 1);
      ::setenv("PTRAIN_KILL_V", std::to_string(v).c_str(), 1);
      ::execl(exe.c_str(), exe.c_str(), "[.pipe_kill_child]", "--reporter", "compact", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<int> status(static_cast<std::size_t>(world_size), -1);
  std::vector<bool> done(static_cast<std::size_t>(world_size), false);
  const auto deadline = started + std::chrono::seconds(timeout_s + 10);  // start-up and rendezvous included
  int left = world_size;
  while (left > 0 && std::chrono::steady_clock::now() < deadline) {
    for (std::size_t r = 0; r < pids.size(); ++r)
      if (!done[r] && ::waitpid(pids[r], &status[r], WNOHANG) == pids[r]) {
        done[r] = true;
        --left;
      }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (std::size_t r = 0; r < pids.size(); ++r)
    if (!done[r]) {
      ::kill(pids[r], SIGKILL);
      ::waitpid(pids[r], &status[r], 0);
    }
  INFO("world " << world_size << ", victim stage " << victim << ", " << v << " chunk(s) per stage");
  CHECK(left == 0);
  for (int r = 0; r < world_size; ++r) {
    INFO("stage " << r);
    const auto ur = static_cast<std::size_t>(r);
    if (r == victim) {
      CHECK((WIFSIGNALED(status[ur]) && WTERMSIG(status[ur]) == SIGKILL));
      continue;
    }
    CHECK((WIFEXITED(status[ur]) && WEXITSTATUS(status[ur]) == 0));
    const auto [ms, msg] = ptrain::testing::read_child_report(dir, r);
    INFO(msg);
    CHECK(ms >= 0);
    CHECK(ms < timeout_s * 1000);
    CHECK(msg.find("[ptrain.pipeline.comm] stage " + std::to_string(r) + " of " + std::to_string(world_size)) !=
          std::string::npos);
    CHECK(msg.find("a neighbouring stage failed or died") != std::string::npos);
  }
  if (std::getenv("PTRAIN_KILL_KEEP") == nullptr) std::system(("rm -rf " + dir).c_str());
}

}  // namespace

TEST_CASE("pipeline failure child (spawned by [.pipe_kill])", "[.pipe_kill_child]") {
  auto comm = dist::init_process_group();
  REQUIRE(comm->backend() == "gloo");
  const int victim = std::atoi(std::getenv("PTRAIN_KILL_RANK")), v = std::atoi(std::getenv("PTRAIN_KILL_V"));
  const int p = comm->size(), s = comm->rank(), m = v > 1 ? 2 * p : 4;
  const auto part = parallel::partition_balanced(param_costs(), p * v);
  // The victim's first unit dies in its 6th forward: micro-batch 1 of the second step (1F1B), or
  // with two chunks on three stages micro-batch 5 of the first chunk, before the second chunk's run.
  auto factory = [&](std::size_t u) -> std::shared_ptr<nn::Module<float>> {
    auto unit = make_unit(u);
    if (s != victim || u != part.begin(s)) return unit;
    auto seq = std::make_shared<nn::Sequential<float>>();
    seq->add(std::make_shared<KillSwitch>(6));
    seq->add(unit);
    return seq;
  };
  parallel::Pipeline<float> pipe(*comm, kUnits, factory, part,
                                 {.schedule = v > 1 ? Schedule::Interleaved : Schedule::OneFOneB,
                                  .micro_batches = m, .virtual_stages = v});
  auto batch = make_batch(4 * m, 1);
  auto t0 = std::chrono::steady_clock::now();
  try {
    for (int step = 0; step < 1000; ++step) {
      t0 = std::chrono::steady_clock::now();
      pipe.train_step(batch.x, batch.y);
    }
  } catch (const CommError& e) {
    ptrain::testing::write_child_report(s, t0, e.what());
    return;
  }
  FAIL("no CommError although stage " << victim << " was killed");
}

TEST_CASE("pipeline failure: a stage killed mid-step makes every other stage fail with a clear error",
          "[.pipe_kill]") {
  pipe_kill_scenario(4, 1, 20);  // a middle stage
  pipe_kill_scenario(3, 2, 20);  // the last stage
  pipe_kill_scenario(3, 0, 20);  // the first stage (it also serves the store)
  pipe_kill_scenario(3, 1, 20, 2);  // a middle stage of an interleaved ring
}

}  // namespace test_pipeline
