// One training step of an MLP (forward, cross-entropy, backward, AdamW) on one
// process; prints one JSON line. benchmarks/train_step.py is its PyTorch twin
// and benchmarks/run_train_step.sh runs both side by side.
//
// --data: the data path instead (Note [Prefetching loader] in data/loader.hpp), one
// JSON line per measurement: batches/s of Dataset::get on Fashion-MNIST's IDX images
// and of the text windows gpt_char reads, the same through the DataLoader, the wait in
// next() while a step leaves the host idle (as a GPU step does), and a
// Trainer run's data wait and step time per step with the loader off (0 workers)
// and on, with get() as it is and with --data-latency-us of storage latency added
// (medians of 5 runs of 3 epochs).

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "mlp_bench.hpp"
#include "ptrain/data/idx.hpp"
#include "ptrain/data/loader.hpp"
#include "ptrain/data/text.hpp"
#include "ptrain/dist/self_communicator.hpp"
#include "ptrain/train/trainer.hpp"

using namespace ptrain;

// Throughput of one large float GEMM: the practical peak of this CPU core.
static double gemm_peak_gflops() {
  const std::int64_t n = 1024;
  auto a = Tensor<float>::full({n, n}, 0.5f), b = Tensor<float>::full({n, n}, 0.25f), c = Tensor<float>::zeros({n, n});
  auto t = bench::time_runs(2, 9, [&] { ops::matmul_into(a, b, c); });
  return 2.0 * static_cast<double>(n * n * n) / (bench::median(t) * 1e6);
}

// get() of an inner data set after `latency_us` of waiting (a read from slow storage).
class Delayed : public Dataset<float> {
 public:
  Delayed(Dataset<float>& inner, int latency_us) : inner_(inner), latency_us_(latency_us) {}
  std::int64_t size() const override { return inner_.size(); }
  Batch<float> get(const std::vector<std::int64_t>& idx) override {
    if (latency_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(latency_us_));
    return inner_.get(idx);
  }

 private:
  Dataset<float>& inner_;
  int latency_us_;
};

static void print(nlohmann::json j) { std::printf("%s\n", j.dump().c_str()); }

// Batches per second of `one_epoch` (which returns the batches it made), median of 5 rounds.
template <class F>
static double batches_per_s(F&& one_epoch) {
  std::vector<double> rates;
  for (int r = 0; r < 5; ++r) {
    const double t0 = bench::now_ms();
    const std::int64_t n = one_epoch();
    rates.push_back(static_cast<double>(n) / ((bench::now_ms() - t0) / 1e3));
  }
  return bench::median(rates);
}

static int data_bench(const bench::MlpOptions& o, int latency_us, std::int64_t samples) {
  const MnistSplit train = load_mnist(default_fashion_mnist_dir(), true);
  const std::int64_t n = std::min(samples, train.images.size(0));
  TensorDataset<float> images(train.images.narrow(0, n), train.labels.narrow(0, n));

  // The data path alone: get() on the calling thread, then through the loader.
  DistributedSampler sampler(images.size(), 0, 1, 0);
  const double get_rate = batches_per_s([&] {
    sampler.set_epoch(0);
    std::int64_t k = 0;
    for (; !sampler.epoch_done(); ++k) (void)images.get(sampler.next(o.batch));
    return k;
  });
  print({{"bench", "data"}, {"what", "get"}, {"dataset", "idx_images"}, {"cpu", true}, {"batch", o.batch},
         {"batches_per_s", get_rate}});
  for (int workers : {1, 2}) {
    DataLoader<float> loader(images, sampler, {.batch = o.batch, .workers = workers, .prefetch = 4});
    const double rate = batches_per_s([&] {
      sampler.set_epoch(0);
      loader.start();
      std::int64_t k = 0;
      while (loader.next()) ++k;
      return k;
    });
    print({{"bench", "data"}, {"what", "loader"}, {"dataset", "idx_images"}, {"cpu", true}, {"batch", o.batch},
           {"workers", workers}, {"prefetch", 4}, {"batches_per_s", rate}});
  }
  // The wait in next() when the step leaves the host idle (a GPU step: here a 3 ms sleep),
  // against get() on the training thread; median and mean of 200 steps.
  for (int workers : {0, 1}) {
    DataLoader<float> loader(images, sampler, {.batch = o.batch, .workers = workers, .prefetch = 2});
    std::vector<double> waits;
    for (std::uint64_t epoch = 0; waits.size() < 200; ++epoch) {
      sampler.set_epoch(epoch);
      loader.start();
      for (;;) {
        const double t0 = bench::now_ms();
        const auto b = loader.next();
        if (!b) break;
        waits.push_back(bench::now_ms() - t0);
        std::this_thread::sleep_for(std::chrono::milliseconds(3));
      }
    }
    double sum = 0;
    for (double w : waits) sum += w;
    print({{"bench", "data"}, {"what", "wait_host_idle"}, {"dataset", "idx_images"}, {"cpu", true},
           {"batch", o.batch}, {"workers", workers}, {"prefetch", 2}, {"step_ms", 3},
           {"wait_ms_median", bench::median(waits)}, {"wait_ms_mean", sum / static_cast<double>(waits.size())}});
  }
  {  // gpt_char's text windows (RandomWindows::next): 32 windows of 256 tokens from 4M tokens
    Generator g(1);
    auto ids = Tensor<std::int32_t>::empty({std::int64_t{1} << 22});
    for (std::int64_t i = 0; i < ids.numel(); ++i) ids.data()[i] = static_cast<std::int32_t>(g.below(50257));
    RandomWindows windows(TokenCorpus(ids), 256, 0);
    Tensor<float> x;
    Tensor<std::int32_t> y;
    const double rate = batches_per_s([&] {
      for (int k = 0; k < 200; ++k) windows.next(32, x, y);
      return std::int64_t{200};
    });
    print({{"bench", "data"}, {"what", "get"}, {"dataset", "text_windows"}, {"cpu", true}, {"batch", 32},
           {"block", 256}, {"batches_per_s", rate}});
  }

  // A Trainer run: the data wait per step (the straggler report's data_wait_s) with the loader
  // off and on; 3 epochs per run, medians of 5 runs.
  const auto metrics = std::filesystem::temp_directory_path() / ("ptrain_data_bench_" + std::to_string(::getpid()));
  const std::int64_t steps = 3 * num_batches(n, o.batch, false);
  for (int latency : {0, latency_us})
    for (int workers : {0, 1}) {
      Delayed data(images, latency);
      std::vector<double> wait_ms, step_ms;
      for (int rep = 0; rep < 5; ++rep) {
        dist::SelfCommunicator self;
        manual_seed(0);
        auto model = std::make_shared<nn::MLP<float>>(784, std::vector<std::int64_t>(o.layers, o.hidden), 10,
                                                      nn::Activation::ReLU);
        auto engine = parallel::make_engine<float>(model, self, parallel::LocalOptions{});
        optim::AdamW<float> opt(engine->parameters(), {.lr = 1e-3});
        train::Trainer<float> trainer(*engine, opt, data,
                                      {.epochs = 3, .batch = o.batch, .log_every = steps,
                                       .metrics = metrics.string(), .loader_workers = workers, .prefetch = 2});
        std::filesystem::remove(metrics);
        trainer.run();
        std::ifstream in(metrics);
        std::string line;
        std::getline(in, line);
        const auto rec = nlohmann::json::parse(line);
        wait_ms.push_back(rec["data_wait_s"].get<double>() * 1e3);
        step_ms.push_back(rec["step_time_s"].get<double>() * 1e3);
      }
      print({{"bench", "data"}, {"what", "trainer"}, {"dataset", "idx_images"}, {"cpu", true}, {"batch", o.batch},
             {"hidden", o.hidden}, {"layers", o.layers}, {"steps", steps}, {"get_latency_us", latency},
             {"loader_workers", workers}, {"data_wait_ms_per_step", bench::median(wait_ms)},
             {"step_ms", bench::median(step_ms)}});
    }
  std::filesystem::remove(metrics);
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"ptrain MLP training-step benchmark (one process)"};
  bench::MlpOptions o;
  o.add_to(app);
  bool data = false;
  int latency_us = 2000;
  std::int64_t samples = 12800;
  app.add_flag("--data", data, "benchmark the data path and the Trainer's data wait instead");
  app.add_option("--data-latency-us", latency_us, "--data: storage latency added to each get()");
  app.add_option("--data-samples", samples, "--data: Fashion-MNIST training images used");
  CLI11_PARSE(app, argc, argv);
  if (data) return data_bench(o, latency_us, samples);

  manual_seed(0);
  bench::MlpStep s(o, 1);
  auto times = bench::time_runs(o.warmup, o.steps, [&] { s.step(s.model, [] {}); });
  auto j = bench::mlp_record("train_step", o, times, 1, s.loss);
  const double peak = gemm_peak_gflops();
  j["gemm_peak_gflops"] = peak;
  j["fraction_of_gemm_peak"] = j["gflops"].get<double>() / peak;
  std::printf("%s\n", j.dump().c_str());
}
