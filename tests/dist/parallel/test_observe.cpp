// The Trainer's observability on real ranks: DDP through a recording
// communicator, the straggler and memory fields of rank 0's metrics, the
// TensorBoard file, and each rank's trace with its collective spans.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <ptrain/dist/flight_recorder.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/obs/trace.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/make_engine.hpp>
#include <ptrain/train/trainer.hpp>

#include "dist/world.hpp"

namespace test_observe {

using namespace ptrain;

TEST_CASE("Trainer writes straggler fields, TensorBoard scalars and per-rank traces", "[trainer][observe]") {
  auto& world = ptrain::testing::world();
  const int n = world.size(), rank = world.rank();
  const auto dir = ptrain::testing::shared_tmp_dir(world, "ptrain_observe_");
  if (rank == 0) std::filesystem::create_directories(dir);
  world.barrier();
  dist::RecordingCommunicator comm(world.split(0, rank), "world");

  Generator g(3);
  auto x = Tensor<float>::empty({64 * n, 6});
  auto y = Tensor<std::int32_t>::empty({64 * n});
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] = static_cast<float>(g.uniform() * 2 - 1);
  for (std::int64_t i = 0; i < y.numel(); ++i) y.data()[i] = static_cast<std::int32_t>(g.below(4));
  TensorDataset<float> data(x, y);
  auto model = std::make_shared<nn::MLP<float>>(6, std::vector<std::int64_t>{16}, 4, nn::Activation::ReLU, g);
  auto engine = parallel::make_engine<float>(model, comm, parallel::DDPOptions{});
  optim::AdamW<float> opt(engine->parameters(), {.lr = 0.01});
  obs::Tracer::get().configure({.dir = dir.string(), .first_step = 2, .last_step = 3, .nvtx = false}, rank);
  train::Trainer<float> trainer(*engine, opt, data,
                                {.epochs = 1, .batch = 8, .log_every = 4, .metrics = (dir / "m.jsonl").string(),
                                 .tensorboard = dir.string()});
  CHECK(trainer.run().step == 8);
  comm.barrier();

  if (rank == 0) {
    std::ifstream f(dir / "m.jsonl");
    std::string line;
    int records = 0;
    while (std::getline(f, line)) {
      const auto rec = nlohmann::json::parse(line);
      ++records;
      REQUIRE(rec["step_time_per_rank"].size() == static_cast<std::size_t>(n));
      const int slowest = rec["slowest_rank"].get<int>();
      REQUIRE((slowest >= 0 && slowest < n));
      double top = 0;
      for (int q = 0; q < n; ++q) {
        const double s = rec["step_time_per_rank"][q].get<double>();
        CHECK(s > 0);
        CHECK(rec["data_wait_per_rank"][q].get<double>() <= s);
        CHECK(rec["comm_wait_per_rank"][q].get<double>() <= s);
        if (n > 1) CHECK(rec["comm_wait_per_rank"][q].get<double>() > 0);  // DDP waits for its buckets
        top = std::max(top, s);
      }
      CHECK(rec["step_time_per_rank"][slowest].get<double>() == top);
      CHECK(rec["slowest_vs_median"].get<double>() >= 1.0);
      CHECK(rec["mem_cpu_peak_mib"].get<double>() >= rec["mem_cpu_live_mib"].get<double>());
      CHECK(rec["mem_cpu_peak_mib"].get<double>() > 0);
    }
    CHECK(records == 2);  // steps 4 and 8
    int event_files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir))
      event_files += e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
    CHECK(event_files == 1);
  }

  std::ifstream tf(dir / ("trace_rank" + std::to_string(rank) + ".json"));
  REQUIRE(tf.good());
  const auto trace = nlohmann::json::parse(tf);
  std::map<std::string, int> count;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] != "M") count[e["name"].get<std::string>()]++;
  CHECK(count["step"] == 2);
  CHECK(count["data"] == 2);
  CHECK(count["forward_backward"] == 2);
  CHECK(count["optimizer_step"] == 2);
  if (n > 1) {
    CHECK(count["ddp.bucket_wait"] >= 2);
    CHECK(count["comm.all_reduce ddp.bucket"] >= 2);
  }
  comm.barrier();
  if (rank == 0) std::filesystem::remove_all(dir);
}

}  // namespace test_observe
