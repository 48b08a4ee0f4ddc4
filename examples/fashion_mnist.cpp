// Trains an MLP on Fashion-MNIST and reports test accuracy.
//
//   build/examples/fashion_mnist                       # defaults: 784-512-256-10, AdamW, 10 epochs
//   build/examples/fashion_mnist --epochs 3 --metrics run.jsonl
//
// Data: the files of Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist);
// --data DIR reads the same four IDX files from elsewhere.

#include <CLI/CLI.hpp>
#include <cstdio>
#include <ptrain/ptrain.hpp>

using namespace ptrain;

namespace {

struct Options {
  int epochs = 10;
  std::int64_t batch = 64;
  double lr = 1e-3;
  double weight_decay = 1e-4;
  std::vector<std::int64_t> hidden = {512, 256};
  std::uint64_t seed = 0;
  std::string data = default_fashion_mnist_dir();
  std::string metrics;
  std::int64_t log_every = 100;
};

// Accuracy of the model on a whole split, in evaluation mode, in chunks.
double evaluate(nn::Module<float>& model, const MnistSplit& split) {
  model.train(false);
  const std::int64_t n = split.images.size(0), chunk = 1000;
  std::int64_t correct = 0;
  nn::Cache<float> cache;
  for (std::int64_t start = 0; start < n; start += chunk) {
    const std::int64_t len = std::min(chunk, n - start);
    auto pred = ops::argmax_rows(model.forward(split.images.narrow(start, len), cache));
    cache.clear();
    for (std::int64_t i = 0; i < len; ++i) correct += pred.data()[i] == split.labels.data()[start + i];
  }
  model.train(true);
  return static_cast<double>(correct) / static_cast<double>(n);
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{"Train an MLP on Fashion-MNIST with ptrain"};
  app.add_option("--epochs", opt.epochs, "passes over the training set")->check(CLI::PositiveNumber);
  app.add_option("--batch", opt.batch, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--lr", opt.lr, "AdamW learning rate (cosine decay to 0 after 1% warmup)");
  app.add_option("--weight-decay", opt.weight_decay, "AdamW decoupled weight decay");
  app.add_option("--hidden", opt.hidden, "hidden layer widths, e.g. 512,256")->delimiter(',');
  app.add_option("--seed", opt.seed, "seed for initialisation and shuffling");
  app.add_option("--data", opt.data, "directory with the Fashion-MNIST IDX files");
  app.add_option("--metrics", opt.metrics, "write JSON-lines metrics to this file");
  app.add_option("--log-every", opt.log_every, "progress line every N steps (0: none)");
  CLI11_PARSE(app, argc, argv);

  try {
    Stopwatch wall;
    const MnistSplit train = load_mnist(opt.data, true);
    const MnistSplit test = load_mnist(opt.data, false);
    const std::int64_t n = train.images.size(0), features = train.images.size(1);

    manual_seed(opt.seed);
    nn::MLP<float> model(features, opt.hidden, 10);
    model.set_need_input_grad(false);
    nn::FlatParameters<float> params(model);
    optim::AdamW<float> optimizer(params, {.lr = opt.lr, .weight_decay = opt.weight_decay});
    nn::CrossEntropyLoss<float> loss_fn;

    const std::int64_t steps_per_epoch = num_batches(n, opt.batch, false);
    const std::int64_t total_steps = steps_per_epoch * opt.epochs;
    const optim::WarmupCosine schedule{.base_lr = opt.lr, .warmup = std::max<std::int64_t>(1, total_steps / 100),
                                       .total = total_steps};
    MetricsWriter metrics(opt.metrics);
    Progress progress(total_steps, opt.log_every);
    std::printf("model %s, %lld parameters, %lld steps\n", model.describe().c_str(),
                static_cast<long long>(model.num_parameters()), static_cast<long long>(total_steps));

    auto x = Tensor<float>::empty({opt.batch, features});
    auto y = Tensor<std::int32_t>::empty({opt.batch});
    nn::Cache<float> cache, loss_cache;
    std::int64_t step = 0;
    double accuracy = 0;
    for (int epoch = 0; epoch < opt.epochs; ++epoch) {
      const auto order = shuffled_indices(n, opt.seed, static_cast<std::uint64_t>(epoch));
      Stopwatch epoch_time;
      for (std::int64_t start = 0; start < n; start += opt.batch) {
        const std::int64_t len = std::min(opt.batch, n - start);
        gather_rows(train.images, order.data() + start, len, x);
        gather_rows(train.labels, order.data() + start, len, y);
        auto xb = x.narrow(0, len);
        auto yb = y.narrow(0, len);

        optimizer.set_lr(schedule(step));
        params.zero_grad();
        const double loss = loss_fn.forward(model.forward(xb, cache), yb, loss_cache);
        model.backward(loss_fn.backward(loss_cache), cache);
        optimizer.step();
        ++step;
        progress.update(step, epoch + 1, loss, optimizer.lr(), len);
        metrics.write({{"step", step}, {"epoch", epoch + 1}, {"loss", loss}, {"lr", optimizer.lr()}});
      }
      accuracy = evaluate(model, test);
      const double sps = static_cast<double>(n) / epoch_time.seconds();
      std::printf("epoch %d: test_accuracy %.4f, %.0f samples/s\n", epoch + 1, accuracy, sps);
      metrics.write({{"step", step}, {"epoch", epoch + 1}, {"test_accuracy", accuracy}, {"samples_per_s", sps}});
    }
    std::printf("final test_accuracy %.4f, wall time %.1f s\n", accuracy, wall.seconds());
  } catch (const Error& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 1;
  }
  return 0;
}
