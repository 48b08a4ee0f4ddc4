// Trains an MLP on Fashion-MNIST and reports test accuracy, on one process or
// data-parallel on several.
//
//   build/examples/fashion_mnist                       # one process: 784-512-256-10, AdamW, 10 epochs
//   build/launcher/ptrun --nproc-per-node 2 build/examples/fashion_mnist --parallel ddp
//   mpirun -np 2 build/examples/fashion_mnist --parallel ddp --metrics run.jsonl
//
// With --parallel ddp, --batch is the batch of each rank (global batch =
// ranks x batch), every rank reads its own shard of each epoch
// (DistributedSampler), and rank 0 prints and writes the metrics.
//
// Checkpoints: --checkpoint-dir DIR saves every --checkpoint-every steps (in the
// background), at the end, and when SIGTERM/SIGINT/SIGUSR1 arrives (all ranks
// agree at the next step, save and exit 0); --resume continues from the newest
// complete checkpoint in DIR when there is one (docs/checkpointing.md):
//   ptrun --nproc-per-node 2 fashion_mnist --parallel ddp --checkpoint-dir ckpt --checkpoint-every 200 --resume
//
// Data: the files of Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist);
// --data DIR reads the same four IDX files from elsewhere.

#include <CLI/CLI.hpp>
#include <cstdio>
#include <ptrain/ckpt/async_writer.hpp>
#include <ptrain/ckpt/checkpoint.hpp>
#include <ptrain/ckpt/preemption.hpp>
#include <ptrain/ptrain.hpp>

#include "checkpoint_flags.hpp"

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
  std::string parallel = "none";
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;
  int keep_checkpoints = 3;
  int preempt_exit_code = 0;
  bool resume = false;
};

// Accuracy on a whole split in evaluation mode. Each rank scores a contiguous
// part of the split and the counts are summed across ranks.
double evaluate(nn::Module<float>& model, const MnistSplit& split, dist::Communicator* comm) {
  model.train(false);
  const std::int64_t n = split.images.size(0), chunk = 1000;
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
  const std::int64_t lo = n * rank / world, hi = n * (rank + 1) / world;
  std::int64_t correct = 0;
  nn::Cache<float> cache;
  for (std::int64_t start = lo; start < hi; start += chunk) {
    const std::int64_t len = std::min(chunk, hi - start);
    auto pred = ops::argmax_rows(model.forward(split.images.narrow(start, len), cache));
    cache.clear();
    for (std::int64_t i = 0; i < len; ++i) correct += pred.data()[i] == split.labels.data()[start + i];
  }
  if (comm) comm->all_reduce(&correct, 1, DType::I64, dist::ReduceOp::Sum);
  model.train(true);
  return static_cast<double>(correct) / static_cast<double>(n);
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{"Train an MLP on Fashion-MNIST with ptrain"};
  app.add_option("--epochs", opt.epochs, "passes over the training set")->check(positive);
  app.add_option("--batch", opt.batch, "batch size")->check(positive);
  app.add_option("--lr", opt.lr, "AdamW learning rate (cosine decay to 0 after 1% warmup)");
  app.add_option("--weight-decay", opt.weight_decay, "AdamW decoupled weight decay");
  app.add_option("--hidden", opt.hidden, "hidden layer widths, e.g. 512,256")->delimiter(',');
  app.add_option("--seed", opt.seed, "seed for initialisation and shuffling");
  app.add_option("--data", opt.data, "directory with the Fashion-MNIST IDX files");
  app.add_option("--metrics", opt.metrics, "write JSON-lines metrics to this file");
  app.add_option("--log-every", opt.log_every, "progress line and metrics record every N steps (0: none)");
  app.add_option("--parallel", opt.parallel, "none (one process) or ddp (data parallel over the launched ranks)")
      ->check(CLI::IsMember({"none", "ddp"}));
  add_checkpoint_flags(app, opt);
  CLI11_PARSE(app, argc, argv);
  if (opt.resume && opt.checkpoint_dir.empty()) {
    std::fprintf(stderr, "fashion_mnist: --resume needs --checkpoint-dir\n");
    return 2;
  }

  try {
    Stopwatch wall;
    std::unique_ptr<dist::Communicator> comm;
    if (opt.parallel == "ddp") comm = dist::init_process_group();
    const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
    const bool lead = rank == 0;

    const MnistSplit train = load_mnist(opt.data, true);
    const MnistSplit test = load_mnist(opt.data, false);
    PTRAIN_CHECK(train.images.size(0) > 0 && test.images.size(0) > 0, Error, "[fashion_mnist.data] ", opt.data,
                 " holds ", train.images.size(0), " training and ", test.images.size(0),
                 " test images; both splits need at least one");
    const std::int64_t features = train.images.size(1);

    manual_seed(opt.seed);
    nn::MLP<float> mlp(features, opt.hidden, 10);
    mlp.set_need_input_grad(false);
    nn::FlatParameters<float> params(mlp);
    std::unique_ptr<parallel::DDP<float>> ddp;
    if (comm) ddp = std::make_unique<parallel::DDP<float>>(mlp, params, *comm);
    nn::Module<float>& model = ddp ? static_cast<nn::Module<float>&>(*ddp) : mlp;
    optim::AdamW<float> optimizer(params, {.lr = opt.lr, .weight_decay = opt.weight_decay});
    nn::CrossEntropyLoss<float> loss_fn;

    DistributedSampler sampler(train.images.size(0), rank, world, opt.seed);
    const std::int64_t steps_per_epoch = num_batches(sampler.num_samples(), opt.batch, false);
    const std::int64_t total_steps = steps_per_epoch * opt.epochs;
    const optim::WarmupCosine schedule{.base_lr = opt.lr, .warmup = std::max<std::int64_t>(1, total_steps / 100),
                                       .total = total_steps};
    // Checkpoints (optional): resume first, so that metrics append to the resumed run's file.
    std::unique_ptr<ckpt::CheckpointManager> checkpoints;
    std::unique_ptr<ckpt::AsyncCheckpointer> saver;
    std::int64_t step = 0, last_saved = -1;
    int start_epoch = 0;
    bool resumed = false;
    if (!opt.checkpoint_dir.empty()) {
      checkpoints = std::make_unique<ckpt::CheckpointManager>(
          opt.checkpoint_dir, comm.get(), ckpt::CheckpointOptions{.keep_last = opt.keep_checkpoints});
      saver = std::make_unique<ckpt::AsyncCheckpointer>(*checkpoints);
    }
    if (checkpoints && opt.resume) {
      const auto last = checkpoints->latest();
      for (const auto& s : last.skipped)
        if (lead) std::fprintf(stderr, "fashion_mnist: skipping %s: %s\n", s.path.c_str(), s.reason.c_str());
      if (last.found()) {
        const ckpt::TrainerState st = checkpoints->load(last.path, params, &optimizer);
        PTRAIN_CHECK(st.sampler.has_value(), CheckpointError, "[fashion_mnist.resume] ", last.path.string(),
                     " has no sampler position; it was not written by this program");
        // Another world size continues the epoch as exactly as the sample count allows
        // (Note [Sampler reshape]); the same world size resumes bit for bit.
        ckpt::restore_sampler(sampler, *st.sampler, world, /*allow_repeat=*/st.world_size != world);
        step = last_saved = st.step;
        start_epoch = static_cast<int>(st.sampler->epoch);
        resumed = true;
        if (lead)
          std::printf("resumed from %s: step %lld, epoch %d (saved on %d rank(s))\n", last.path.c_str(),
                      static_cast<long long>(step), start_epoch + 1, st.world_size);
      } else if (lead) {
        std::printf("no checkpoint in %s; starting from step 0\n", opt.checkpoint_dir.c_str());
      }
    }
    std::unique_ptr<ckpt::PreemptionHandler> preempt;
    if (checkpoints) preempt = std::make_unique<ckpt::PreemptionHandler>();
    auto trainer_state = [&] {
      ckpt::TrainerState ts;
      ts.sampler = ckpt::sampler_state(sampler, world);
      ts.schedule = schedule;
      ts.user = {{"program", "fashion_mnist"}, {"batch", opt.batch}, {"hidden", opt.hidden}, {"seed", opt.seed},
                 {"epochs", opt.epochs}};
      return ts;
    };

    MetricsWriter metrics(lead ? opt.metrics : "", resumed);
    Progress progress(total_steps, lead ? opt.log_every : 0);
    if (lead)
      std::printf("model %s, %lld parameters, %d rank(s)%s, %lld steps\n", mlp.describe().c_str(),
                  static_cast<long long>(mlp.num_parameters()), world,
                  comm ? (" (" + comm->backend() + ")").c_str() : "", static_cast<long long>(total_steps));

    auto x = Tensor<float>::empty({opt.batch, features});
    auto y = Tensor<std::int32_t>::empty({opt.batch});
    nn::Cache<float> cache, loss_cache;
    double accuracy = 0, window_loss = 0;
    Stopwatch window;
    for (int epoch = start_epoch; epoch < opt.epochs; ++epoch) {
      if (!(resumed && epoch == start_epoch)) sampler.set_epoch(static_cast<std::uint64_t>(epoch));
      Stopwatch epoch_time;
      while (!sampler.epoch_done()) {
        const auto idx = sampler.next(opt.batch);
        const auto len = static_cast<std::int64_t>(idx.size());
        gather_rows(train.images, idx.data(), len, x);
        gather_rows(train.labels, idx.data(), len, y);
        auto xb = x.narrow(0, len);
        auto yb = y.narrow(0, len);

        optimizer.set_lr(schedule(step));
        params.zero_grad();
        const double loss = loss_fn.forward(model.forward(xb, cache), yb, loss_cache);
        model.backward(loss_fn.backward(loss_cache), cache);
        if (ddp) ddp->finish_gradient_sync();
        optimizer.step();
        ++step;
        progress.update(step, epoch + 1, loss, optimizer.lr(), len * world);

        // Every rank takes part in the loss average at the same steps.
        window_loss += loss;
        if (opt.log_every > 0 && (step % opt.log_every == 0 || step == total_steps)) {
          const std::int64_t steps_in_window = (step - 1) % opt.log_every + 1;
          double mean_loss = window_loss / static_cast<double>(steps_in_window);
          if (ddp) mean_loss = ddp->average(mean_loss);
          const double sps = static_cast<double>(steps_in_window * opt.batch * world) / window.seconds();
          metrics.write({{"step", step}, {"epoch", epoch + 1}, {"loss", mean_loss}, {"lr", optimizer.lr()},
                         {"samples_per_s", sps}});
          window_loss = 0;
          window.reset();
        }
        if (saver && opt.checkpoint_every > 0 && step % opt.checkpoint_every == 0) {
          saver->save(step, params, &optimizer, trainer_state());  // returns after a copy to host memory
          last_saved = step;
        }
        // One all-reduce per step: every rank stops at the same step when any got a signal.
        if (preempt && preempt->should_stop(comm.get())) {
          saver->wait();
          checkpoints->save(step, params, &optimizer, trainer_state());
          if (lead) {
            std::printf("signal %d: checkpoint of step %lld committed in %s; exiting\n", preempt->signal(),
                        static_cast<long long>(step), opt.checkpoint_dir.c_str());
            std::fflush(stdout);  // the launcher's SIGTERM may come before exit() flushes a pipe
          }
          return opt.preempt_exit_code;
        }
      }
      accuracy = evaluate(model, test, comm.get());
      const double sps = static_cast<double>(sampler.num_samples() * world) / epoch_time.seconds();
      if (lead) std::printf("epoch %d: test_accuracy %.4f, %.0f samples/s\n", epoch + 1, accuracy, sps);
      metrics.write({{"step", step}, {"epoch", epoch + 1}, {"test_accuracy", accuracy}, {"samples_per_s", sps}});
    }
    if (saver) {
      saver->wait();
      if (last_saved != step) checkpoints->save(step, params, &optimizer, trainer_state());
    }
    if (lead) std::printf("final test_accuracy %.4f, wall time %.1f s\n", accuracy, wall.seconds());
  } catch (const Error& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 1;
  }
  return 0;
}
