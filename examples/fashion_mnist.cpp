// Trains an MLP or a CNN on Fashion-MNIST and reports test accuracy, on one
// process, data parallel or fully sharded over the launched ranks.
//
//   build/examples/fashion_mnist                       # one process: 784-512-256-10, AdamW, 10 epochs
//   build/launcher/ptrun --nproc-per-node 2 build/examples/fashion_mnist --model cnn --parallel ddp
//   build/launcher/ptrun --nproc-per-node 2 build/examples/fashion_mnist --parallel ddp
//   mpirun -np 2 build/examples/fashion_mnist --parallel fsdp --metrics run.jsonl
//
// --batch is the batch of each rank (global batch = ranks x batch); every rank
// reads its own shard of each epoch (DistributedSampler), and rank 0 prints and
// writes the metrics. The training loop is train::Trainer on the Engine contract
// (docs/training.md): the mode is chosen in one line, and nothing else depends on it.
//
// Checkpoints: --checkpoint-dir DIR saves every --checkpoint-every steps (in the
// background), at the end, and when SIGTERM/SIGINT/SIGUSR1 arrives (all ranks
// agree at the next step, save and exit with --preempt-exit-code); --resume
// continues from the newest complete checkpoint in DIR, written in any mode and
// on any number of ranks (docs/checkpointing.md):
//   ptrun --nproc-per-node 2 fashion_mnist --parallel ddp --checkpoint-dir ckpt --checkpoint-every 200 --resume
//
// --model cnn: two blocks of 3x3 convolution, batch norm, ReLU and 2x2 max-pool
// (--channels, default 16,32) and a linear head (nn::CNN); on two or more ranks
// its norms are SyncBatchNorm, so statistics span the global batch.
// --train-limit / --test-limit use the first N images of a split (quick runs) and
// --min-accuracy A exits with status 3 when the final test accuracy is below A.
//
// Data: the files of Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist);
// --data DIR reads the same four IDX files from elsewhere.

#include <CLI/CLI.hpp>
#include <cstdio>
#include <ptrain/ptrain.hpp>
#include <ptrain/train/trainer.hpp>

#include "checkpoint_flags.hpp"
#include "cli_checks.hpp"
#include "observe_flags.hpp"

using namespace ptrain;

namespace {

struct Options {
  int epochs = 10;
  std::int64_t batch = 64;
  double lr = 1e-3;
  double weight_decay = 1e-4;
  std::string model = "mlp";
  std::vector<std::int64_t> hidden = {512, 256};
  std::vector<std::int64_t> channels = {16, 32};
  std::int64_t train_limit = 0;
  std::int64_t test_limit = 0;
  double min_accuracy = 0.0;
  std::uint64_t seed = 0;
  std::string data = default_fashion_mnist_dir();
  std::string metrics;
  std::int64_t log_every = 100;
  std::string parallel = "none";
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;
  int keep_checkpoints = 3;
  int preempt_exit_code = 0;
  bool resume = false;
  bool start_over = false;
};

// Accuracy on a whole split in evaluation mode. Each data-parallel rank scores a
// contiguous part of the split in the same number of forward calls (FSDP's forward
// is collective), and the counts are summed across ranks.
double accuracy(parallel::Engine<float>& engine, const MnistSplit& split) {
  dist::Communicator* dp = engine.data_parallel_group();
  const int rank = dp ? dp->rank() : 0, world = dp ? dp->size() : 1;
  const std::int64_t n = split.images.size(0), lo = n * rank / world, hi = n * (rank + 1) / world;
  const std::int64_t calls = ((n + world - 1) / world + 999) / 1000;
  std::int64_t correct = 0;
  nn::Cache<float> cache;
  for (std::int64_t c = 0; c < calls; ++c) {
    const std::int64_t begin = lo + (hi - lo) * c / calls, len = lo + (hi - lo) * (c + 1) / calls - begin;
    // A rank with no rows left still takes part, with one row it does not count.
    auto pred = ops::argmax_rows(engine.local_module().forward(split.images.narrow(len ? begin : 0, std::max<std::int64_t>(len, 1)), cache));
    cache.clear();
    for (std::int64_t i = 0; i < len; ++i) correct += pred.data()[i] == split.labels.data()[begin + i];
  }
  if (dp) dp->all_reduce(&correct, 1, DType::I64, dist::ReduceOp::Sum);
  return static_cast<double>(correct) / static_cast<double>(n);
}

// The first `limit` images of a split (all of them when limit is 0 or too large).
MnistSplit first_images(MnistSplit s, std::int64_t limit) {
  if (limit <= 0 || limit >= s.images.size(0)) return s;
  s.images = s.images.narrow(0, limit);
  s.labels = s.labels.narrow(0, limit);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{"Train an MLP or a CNN on Fashion-MNIST with ptrain"};
  app.add_option("--model", opt.model, "mlp or cnn")->check(CLI::IsMember({"mlp", "cnn"}));
  app.add_option("--epochs", opt.epochs, "passes over the training set")->check(positive);
  app.add_option("--batch", opt.batch, "batch size of each rank")->check(positive);
  app.add_option("--lr", opt.lr, "AdamW learning rate (cosine decay to 0 after 1% warmup)");
  app.add_option("--weight-decay", opt.weight_decay, "AdamW decoupled weight decay");
  app.add_option("--hidden", opt.hidden, "hidden layer widths of the MLP, e.g. 512,256")->delimiter(',');
  app.add_option("--channels", opt.channels, "output channels of the CNN's conv blocks, e.g. 16,32")->delimiter(',');
  app.add_option("--train-limit", opt.train_limit, "train on the first N images only (0: all)");
  app.add_option("--test-limit", opt.test_limit, "test on the first N images only (0: all)");
  app.add_option("--min-accuracy", opt.min_accuracy, "exit with status 3 if the final test accuracy is below this");
  app.add_option("--seed", opt.seed, "seed for initialisation and shuffling");
  app.add_option("--data", opt.data, "directory with the Fashion-MNIST IDX files");
  app.add_option("--metrics", opt.metrics, "write JSON-lines metrics to this file");
  app.add_option("--log-every", opt.log_every, "progress line and metrics record every N steps (0: none)");
  app.add_option("--parallel", opt.parallel,
                 "none (one process), ddp (data parallel) or fsdp (fully sharded) over the launched ranks")
      ->check(CLI::IsMember({"none", "ddp", "fsdp"}));
  ObserveFlags observe;
  if (const int rc = parse_training_flags("fashion_mnist", app, argc, argv, opt, observe); rc >= 0) return rc;
  apply_observe_flags(observe);

  try {
    Stopwatch wall;
    auto world = dist::init_process_group();  // a world of one without a launcher
    const MnistSplit train_split = first_images(load_mnist(opt.data, true), opt.train_limit);
    const MnistSplit test_split = first_images(load_mnist(opt.data, false), opt.test_limit);
    PTRAIN_CHECK(train_split.images.size(0) > 0 && test_split.images.size(0) > 0, Error, "[fashion_mnist.data] ",
                 opt.data, " holds ", train_split.images.size(0), " training and ", test_split.images.size(0),
                 " test images; both splits need at least one");

    manual_seed(opt.seed);
    std::shared_ptr<nn::Sequential<float>> model;
    if (opt.model == "mlp") {
      auto mlp = std::make_shared<nn::MLP<float>>(train_split.images.size(1), opt.hidden, 10);
      mlp->set_need_input_grad(false);
      model = mlp;
    } else {
      PTRAIN_CHECK(train_split.images.size(1) == 28 * 28, Error, "[fashion_mnist.data] the CNN takes 28x28 images, "
                   "got rows of ", train_split.images.size(1));
      model = std::make_shared<nn::CNN<float>>(1, 28, 28, opt.channels, 10, /*sync_bn=*/world->size() > 1);
    }
    const std::int64_t num_parameters = model->num_parameters();  // FSDP releases the model's own tensors
    const std::string description = model->describe();
    parallel::Plan<float> plan = parallel::LocalOptions{};
    if (opt.parallel == "ddp") plan = parallel::DDPOptions{};
    if (opt.parallel == "fsdp") plan = parallel::FSDPOptions{};
    auto engine = parallel::make_engine<float>(model, *world, plan);
    optim::AdamW<float> optimizer(engine->parameters(), {.lr = opt.lr, .weight_decay = opt.weight_decay});

    TensorDataset<float> data(train_split.images, train_split.labels);
    train::Trainer<float> trainer(*engine, optimizer, data,
                                  {.epochs = opt.epochs, .batch = opt.batch, .seed = opt.seed,
                                   .log_every = opt.log_every, .metrics = opt.metrics,
                                   .tensorboard = observe.tensorboard_dir,
                                   .checkpoint_dir = opt.checkpoint_dir, .checkpoint_every = opt.checkpoint_every,
                                   .keep_checkpoints = opt.keep_checkpoints, .resume = opt.resume,
                                   .start_over = opt.start_over,
                                   .preempt_exit_code = opt.preempt_exit_code,
                                   .config = {{"program", "fashion_mnist"}, {"model", opt.model},
                                              {"hidden", opt.hidden}, {"channels", opt.channels},
                                              {"seed", opt.seed}}});
    const std::int64_t total = trainer.total_steps();
    trainer.schedule = optim::WarmupCosine{.base_lr = opt.lr, .warmup = std::max<std::int64_t>(1, total / 100),
                                           .total = total};
    trainer.evaluate = [&](parallel::Engine<float>& e) {
      return nlohmann::json{{"test_accuracy", accuracy(e, test_split)}};
    };
    const bool lead = world->rank() == 0;
    if (lead)
      std::printf("model %s, %lld parameters, %d rank(s) (%s), %s, %lld steps\n", description.c_str(),
                  static_cast<long long>(num_parameters), world->size(), world->backend().c_str(), opt.parallel.c_str(),
                  static_cast<long long>(total));
    const train::TrainResult result = trainer.run();
    // No evaluation yet (a preemption before the first one): last_eval is null.
    const double acc = result.last_eval.is_object() ? result.last_eval.value("test_accuracy", 0.0) : 0.0;
    if (lead && !result.preempted) std::printf("final test_accuracy %.4f, wall time %.1f s\n", acc, wall.seconds());
    if (!result.preempted && acc < opt.min_accuracy) {
      if (lead) std::fprintf(stderr, "fashion_mnist: test accuracy %.4f is below --min-accuracy %.4f\n", acc,
                             opt.min_accuracy);
      return 3;
    }
    return result.exit_code;
  } catch (const Error& e) {
    dist::record_error(e);  // for the launcher's TORCHELASTIC_ERROR_FILE (torchrun, ptrun)
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 1;
  }
}
