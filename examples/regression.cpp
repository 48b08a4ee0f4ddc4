// Fits y = sin(3x) on [-1, 1] with a small Tanh MLP and MSELoss: a data set of
// the user's own with float targets, trained through make_engine and Trainer.
// Runs alone or under a launcher (ptrun, mpirun, torchrun, srun):
//   regression [epochs] [max_mse]   # exits 1 when the final test MSE is above max_mse
#include <cmath>
#include <cstdio>
#include <numeric>
#include <ptrain/ptrain.hpp>
#include <ptrain/train/trainer.hpp>
#include <string>

using namespace ptrain;

// n points evenly spread over [-1, 1] and their targets sin(3x), made on demand
// (from the index alone, so the Trainer's loader may call get() from several threads).
class SineData : public Dataset<float> {
 public:
  explicit SineData(std::int64_t n) : n_(n) {}
  std::int64_t size() const override { return n_; }
  Batch<float> get(const std::vector<std::int64_t>& idx) override {
    const auto rows = static_cast<std::int64_t>(idx.size());
    auto x = Tensor<float>::empty({rows, 1}), y = Tensor<float>::empty({rows, 1});
    for (std::int64_t i = 0; i < rows; ++i) {
      x.data()[i] = -1.0f + 2.0f * static_cast<float>(idx[i]) / static_cast<float>(n_ - 1);
      y.data()[i] = std::sin(3.0f * x.data()[i]);
    }
    return {x, {}, y};  // input, no token ids, float targets
  }

 private:
  std::int64_t n_;
};

int main(int argc, char** argv) try {
  const int epochs = argc > 1 ? std::stoi(argv[1]) : 30;
  auto world = dist::init_process_group();  // a world of one without a launcher
  manual_seed(0);
  auto model = std::make_shared<nn::MLP<float>>(1, std::vector<std::int64_t>{32, 32}, 1, nn::Activation::Tanh);
  auto engine = parallel::make_engine<float>(model, *world, parallel::DDPOptions{});
  engine->set_loss(parallel::loss_fn<float>(nn::MSELoss<float>()));
  optim::AdamW<float> opt(engine->parameters(), {.lr = 1e-2});
  SineData train_data(1024), test_data(201);
  train::Trainer<float> trainer(*engine, opt, train_data, {.epochs = epochs, .batch = 32, .log_every = 0});
  trainer.schedule = optim::WarmupCosine{.base_lr = 1e-2, .warmup = 10, .total = trainer.total_steps()};
  std::vector<std::int64_t> all(static_cast<std::size_t>(test_data.size()));
  std::iota(all.begin(), all.end(), 0);
  const Batch<float> test = test_data.get(all);
  trainer.evaluate = [&](parallel::Engine<float>& e) {  // every rank holds the whole model
    return nlohmann::json{{"test_mse", e.eval_loss(test.x, test.targets)}};
  };
  const double mse = trainer.run().last_eval["test_mse"].get<double>();
  if (world->rank() == 0)
    std::printf("final test MSE %.6f after %d epochs on %d rank(s)\n", mse, epochs, world->size());
  return argc > 2 && !(mse <= std::stod(argv[2])) ? 1 : 0;
} catch (const std::exception& e) {
  dist::record_error(e);  // for the launcher's TORCHELASTIC_ERROR_FILE (torchrun, ptrun)
  std::fprintf(stderr, "regression: %s\n", e.what());
  return 2;
}
