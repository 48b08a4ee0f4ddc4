// Pipeline schedules: per-stage timelines and the measured bubble against the
// theory, for GPipe, 1F1B and the interleaved schedule with v chunks per stage.
// Every rank is one stage (p = number of processes); launch with mpirun or
// ptrun, one core per rank:
//
//   OPENBLAS_NUM_THREADS=1 mpirun -np 2 build/benchmarks/pipeline_bench > pipe.jsonl
//   /usr/bin/python3 benchmarks/plot_pipeline.py pipe.jsonl docs/images/pipeline_timeline.png
//
// The model: `units` units (default 4p + 1) of Linear(width, width) + ReLU, the
// last one Linear(width, 10), cut into p stages (p·v chunks) by parameter count. A
// micro-batch has `rows` rows, so m micro-batches make a batch of m * rows. Each
// train_step is preceded by a barrier; on the median step (by step time) rank 0 prints:
//   {"bench":"pipeline", schedule, v, p, m, step_ms, bubble, theory, ratio, bubble_time, ...}
//   {"bench":"pipeline_timeline", schedule, v, m, stage, events:[[mb,"F",start_ms,end_ms,chunk],...]}
// with times in ms from the step's first event on any stage.
//
// Bubble: 1 - (sum over stages of forward/backward time) / (p * span), span
// from the first event start to the last event end over all stages; time
// spent in send/recv and waiting counts as bubble. Its theory is
// (p - 1) / (v·m + p - 1) (v = 1 for GPipe and 1F1B). bubble_time is the same
// measurement as Megatron-LM states it, idle time over compute time,
// bubble / (1 - bubble), against (p - 1) / (v·m) (time_theory). cpu_share (CPU
// time of the most starved stage over its step time, median over steps) tells
// whether other programs shared the cores: on an idle machine it is close to 1 - bubble.

#include <CLI/CLI.hpp>
#include <ctime>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <ptrain/dist/process_group.hpp>
#include <ptrain/kernels/cpu/gemm.hpp>
#include <ptrain/nn/activation.hpp>
#include <ptrain/nn/linear.hpp>
#include <ptrain/nn/sequential.hpp>
#include <ptrain/optim/sgd.hpp>
#include <ptrain/parallel/pipeline.hpp>

#include "bench_util.hpp"

using namespace ptrain;

namespace {

struct Options {
  std::int64_t width = 768, rows = 64;
  int units = 0, steps = 9, warmup = 2;  // units 0: 4p + 1 (four full units per stage, plus the head)
  std::vector<int> micro_batches;  // default: 1, p, 2p, 4p, 8p
  std::vector<int> virtual_stages{2, 4};  // the interleaved schedule's v (those the units allow)
};

// One step's `events` events of every stage, gathered to every rank, 5 doubles each.
std::vector<std::vector<parallel::PipelineEvent>> gather_timeline(dist::Communicator& comm,
                                                                  const std::vector<parallel::PipelineEvent>& mine,
                                                                  std::size_t events) {
  constexpr std::size_t kFields = 5;
  const std::size_t per = events * kFields;
  std::vector<double> send(per, 0), recv(per * static_cast<std::size_t>(comm.size()));
  for (std::size_t k = 0; k < mine.size() && k < events; ++k) {
    double* e = send.data() + kFields * k;
    e[0] = mine[k].micro_batch;
    e[1] = mine[k].kind == 'F' ? 0 : 1;
    e[2] = mine[k].start;
    e[3] = mine[k].end;
    e[4] = mine[k].chunk;
  }
  comm.all_gather(send.data(), recv.data(), per, DType::F64);
  std::vector<std::vector<parallel::PipelineEvent>> all(static_cast<std::size_t>(comm.size()));
  for (int s = 0; s < comm.size(); ++s)
    for (std::size_t k = 0; k < events; ++k) {
      const double* e = recv.data() + static_cast<std::size_t>(s) * per + kFields * k;
      all[static_cast<std::size_t>(s)].push_back(
          {s, static_cast<int>(e[0]), e[1] == 0 ? 'F' : 'B', e[2], e[3], static_cast<int>(e[4])});
    }
  return all;
}

// CPU seconds this process has used: with cpu_share = CPU time / wall time of
// a step well below 1 on a busy stage, other programs took the cores and the
// measured bubble includes their time.
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct StepStats {
  double span = 0, bubble = 0, cpu_share = 0;
  std::vector<std::vector<parallel::PipelineEvent>> events;
};

StepStats analyse(std::vector<std::vector<parallel::PipelineEvent>> all) {
  StepStats st;
  double t0 = 1e300, t1 = -1e300, busy = 0;
  for (auto& stage : all)
    for (auto& e : stage) {
      t0 = std::min(t0, e.start);
      t1 = std::max(t1, e.end);
      busy += e.end - e.start;
    }
  st.span = t1 - t0;
  st.bubble = 1.0 - busy / (static_cast<double>(all.size()) * st.span);
  for (auto& stage : all)
    for (auto& e : stage) {
      e.start -= t0;
      e.end -= t0;
    }
  st.events = std::move(all);
  return st;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ptrain pipeline schedules: timelines and bubble fraction"};
  Options o;
  app.add_option("--width", o.width, "width of every Linear");
  app.add_option("--rows", o.rows, "rows per micro-batch");
  app.add_option("--units", o.units, "number of units (default 4p + 1)");
  app.add_option("--steps", o.steps, "timed steps per configuration");
  app.add_option("--warmup", o.warmup, "untimed steps first");
  app.add_option("--m", o.micro_batches, "micro-batch counts (default 1 p 2p 4p 8p; interleaved: the multiples of p)");
  app.add_option("--virtual-stages", o.virtual_stages, "chunks per stage of the interleaved schedule (default 2 4; "
                 "0 skips it)");
  CLI11_PARSE(app, argc, argv);

  kernels::cpu::set_num_threads(1);  // one core per stage
  auto comm = dist::init_process_group();
  const int p = comm->size(), rank = comm->rank();
  if (o.micro_batches.empty()) o.micro_batches = {1, p, 2 * p, 4 * p, 8 * p};
  if (o.units <= 0) o.units = 4 * p + 1;

  const auto n_units = static_cast<std::size_t>(o.units);
  auto factory = [&](std::size_t u) -> std::shared_ptr<nn::Module<float>> {
    Generator g(100 + u);
    auto s = std::make_shared<nn::Sequential<float>>();
    const bool last = u + 1 == n_units;
    s->add(std::make_shared<nn::Linear<float>>(o.width, last ? 10 : o.width, true, g));
    if (!last) s->add(std::make_shared<nn::ReLU<float>>());
    return s;
  };
  // Cut by parameter count: the small head shares the last stage (chunk) with full units.
  std::vector<double> cost(n_units, static_cast<double>(o.width * (o.width + 1)));
  cost.back() = static_cast<double>(10 * (o.width + 1));
  // GPipe and 1F1B, then the interleaved schedule for each v that leaves every chunk a unit.
  std::vector<std::pair<parallel::Schedule, int>> runs{{parallel::Schedule::GPipe, 1},
                                                       {parallel::Schedule::OneFOneB, 1}};
  for (int v : o.virtual_stages)
    if (v > 1 && static_cast<std::size_t>(p * v) <= n_units && p > 1) runs.emplace_back(parallel::Schedule::Interleaved, v);

  if (rank == 0)
    std::fprintf(stderr, "%-11s %2s %3s %4s %10s %8s %8s %6s %11s %11s %9s\n", "sched", "v", "p", "m", "step_ms",
                 "bubble", "theory", "ratio", "bubble_time", "time_theory", "cpu_share");
  for (const auto& [sched, v] : runs)
    for (int m : o.micro_batches) {
      if (v > 1 && m % p != 0) continue;  // micro-batches in groups of p
      const auto part = parallel::partition_balanced(cost, p * v);
      parallel::Pipeline<float> pipe(*comm, n_units, factory, part,
                                     {.schedule = sched, .micro_batches = m, .virtual_stages = v});
      optim::SGD<float> opt(pipe.parameters(), {.lr = 1e-3});
      Generator g(7);
      auto x = Tensor<float>::empty({m * o.rows, o.width});
      ops::uniform_(x, -1.0, 1.0, g);
      auto y = Tensor<std::int32_t>::empty({m * o.rows});
      for (std::int64_t i = 0; i < y.numel(); ++i) y.data()[i] = static_cast<std::int32_t>(g.below(10));
      std::vector<StepStats> stats;
      for (int it = 0; it < o.warmup + o.steps; ++it) {
        comm->barrier();
        const double c0 = process_cpu_seconds(), w0 = bench::now_ms();
        pipe.train_step(x, y);
        // The least CPU share over stages: the stage most starved by other programs.
        double share = (process_cpu_seconds() - c0) * 1e3 / (bench::now_ms() - w0);
        comm->all_reduce(&share, 1, DType::F64, dist::ReduceOp::Min);
        opt.step();
        auto all = gather_timeline(*comm, pipe.timeline(), static_cast<std::size_t>(2 * m * v));
        if (it >= o.warmup) {
          stats.push_back(analyse(std::move(all)));
          stats.back().cpu_share = share;
        }
      }
      if (rank != 0) continue;
      // The median step by span, and the median bubble over steps.
      std::sort(stats.begin(), stats.end(), [](const StepStats& a, const StepStats& b) { return a.span < b.span; });
      const StepStats& med = stats[stats.size() / 2];
      std::vector<double> bubbles, shares;
      for (auto& s : stats) {
        bubbles.push_back(s.bubble);
        shares.push_back(s.cpu_share);
      }
      const double bubble = bench::median(bubbles);
      const double theory = static_cast<double>(p - 1) / static_cast<double>(v * m + p - 1);
      const double bubble_time = bubble / (1 - bubble), time_theory = static_cast<double>(p - 1) / (v * m);
      nlohmann::json j{{"bench", "pipeline"},
                       {"schedule", parallel::schedule_name(sched)},
                       {"v", v},
                       {"backend", comm->backend()},
                       {"p", p},
                       {"m", m},
                       {"rows_per_micro_batch", o.rows},
                       {"width", o.width},
                       {"units", o.units},
                       {"partition", part.str()},
                       {"step_ms", med.span * 1e3},
                       {"bubble", bubble},
                       {"theory", theory},
                       {"ratio", theory > 0 ? bubble / theory : 0.0},
                       {"bubble_time", bubble_time},
                       {"time_theory", time_theory},
                       {"cpu_share", bench::median(shares)}};
      std::printf("%s\n", j.dump().c_str());
      for (std::size_t s = 0; s < med.events.size(); ++s) {
        nlohmann::json ev = nlohmann::json::array();
        for (auto& e : med.events[s])
          ev.push_back({e.micro_batch, std::string(1, e.kind), e.start * 1e3, e.end * 1e3, e.chunk});
        nlohmann::json t{{"bench", "pipeline_timeline"}, {"schedule", parallel::schedule_name(sched)}, {"v", v},
                         {"p", p}, {"m", m}, {"stage", s}, {"events", ev}};
        std::printf("%s\n", t.dump().c_str());
      }
      std::fflush(stdout);
      std::fprintf(stderr, "%-11s %2d %3d %4d %10.2f %8.3f %8.3f %6.2f %11.3f %11.3f %9.2f\n",
                   parallel::schedule_name(sched), v, p, m, med.span * 1e3, bubble, theory,
                   theory > 0 ? bubble / theory : 0.0, bubble_time, time_theory, bench::median(shares));
    }
}
