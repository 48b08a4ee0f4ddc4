// A small deterministic data-parallel trainer for the checkpoint tests:
// MLP + DDP + DistributedSampler + AdamW + warmup-cosine schedule on a
// synthetic data set, with checkpoints, resume and preemption handling.
//
//   ptrun --nproc-per-node 2 ckpt_trainer --dir D --steps 12 --every 3 [--async] [--resume] --out final.safetensors
//
// Side files for the test driver: D/pid-rank<R> (this rank's pid, once its
// signal handlers are installed),
// --samples-log P (P.rank<R>: one line per step with the sample indices this
// rank used), --dump-loaded P (P.rank<R>: parameters right after a resume,
// raw bytes in parameter order). With --sharded, checkpoints go through
// save_sharded as FSDP uses it: rank r writes elements [r n / W, (r + 1) n / W)
// of the flat parameter and AdamW buffers, as pieces of the parameters (and
// their state) that range cuts, and a resumed rank of any world size loads
// whole tensors assembled from the pieces. With --fsdp STRATEGY the model is
// wrapped in FSDP instead of DDP and checkpoints are its shards (always
// sharded; any world size loads them). Exit code 0 after --steps steps or
// after a preemption signal (then a checkpoint of the current step is committed).
// --dtype f64 trains in double (checkpoints then hold F64 tensors): the tests that
// compare runs on different numbers of ranks use it (see test_ckpt_dist.cpp).
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>
#include <unistd.h>

#include <ptrain/ckpt/async_writer.hpp>
#include <ptrain/ckpt/checkpoint.hpp>
#include <ptrain/ckpt/fsdp_checkpoint.hpp>
#include <ptrain/ckpt/preemption.hpp>
#include <ptrain/data/batches.hpp>
#include <ptrain/data/sampler.hpp>
#include <ptrain/dist/process_group.hpp>
#include <ptrain/nn/loss.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/ddp.hpp>
#include <ptrain/parallel/fsdp.hpp>

using namespace ptrain;

namespace {

struct Args {
  std::string dir, out, samples_log, dump_loaded, fsdp_strategy, dtype = "f32";
  std::int64_t steps = 12, every = 0, global_batch = 12, sleep_ms = 0, hidden = 16;
  bool resume = false, async = false, sharded = false;
};

template <class T>
int train(const Args& a) {
  const std::string &dir = a.dir, &out = a.out, &samples_log = a.samples_log, &dump_loaded = a.dump_loaded,
                    &fsdp_strategy = a.fsdp_strategy;
  const std::int64_t steps = a.steps, every = a.every, global_batch = a.global_batch, sleep_ms = a.sleep_ms,
                     hidden = a.hidden;
  const bool resume = a.resume, async = a.async;
  bool sharded = a.sharded;

  try {
    auto comm = dist::init_process_group();
    const int rank = comm->rank(), world = comm->size();
    PTRAIN_CHECK(global_batch % world == 0, Error, "global batch ", global_batch, " not divisible by ", world);
    const std::int64_t batch = global_batch / world;

    // Data: 96 samples, 6 features, 3 classes, the same on every rank.
    const std::int64_t n = 96, features = 6;
    Generator data_gen(1234);
    auto X = Tensor<T>::empty({n, features});
    auto Y = Tensor<std::int32_t>::empty({n});
    for (std::int64_t i = 0; i < X.numel(); ++i) X.data()[i] = static_cast<T>(data_gen.uniform() * 2 - 1);
    for (std::int64_t i = 0; i < n; ++i) Y.data()[i] = static_cast<std::int32_t>(data_gen.below(3));

    Generator init(42);
    nn::MLP<T> model(features, {hidden}, 3, nn::Activation::ReLU, init);
    model.set_need_input_grad(false);
    // DDP over flat parameters, or FSDP over the MLP's layers; `values` is what the optimizer updates.
    std::unique_ptr<nn::FlatParameters<T>> flat;
    std::unique_ptr<nn::Module<T>> wrapped;
    parallel::FSDP<T>* fsdp = nullptr;
    std::unique_ptr<optim::AdamW<T>> adamw;
    if (fsdp_strategy.empty()) {
      flat = std::make_unique<nn::FlatParameters<T>>(model);
      wrapped = std::make_unique<parallel::DDP<T>>(model, *flat, *comm);
      adamw = std::make_unique<optim::AdamW<T>>(*flat, optim::AdamWOptions{.lr = 0.01});
    } else {
      parallel::FSDPOptions fo{.hybrid_shard_size = 2, .unit_names = model.unit_names()};
      for (auto st : {parallel::ShardingStrategy::FullShard, parallel::ShardingStrategy::ShardGradOp,
                      parallel::ShardingStrategy::ShardOptimizer, parallel::ShardingStrategy::NoShard,
                      parallel::ShardingStrategy::Hybrid})
        if (fsdp_strategy == parallel::strategy_name(st)) fo.strategy = st;
      PTRAIN_CHECK(fsdp_strategy == parallel::strategy_name(fo.strategy), Error, "unknown --fsdp ", fsdp_strategy);
      auto f = std::make_unique<parallel::FSDP<T>>(model.units(), *comm, fo);
      fsdp = f.get();
      wrapped = std::move(f);
      adamw = std::make_unique<optim::AdamW<T>>(fsdp->parameters(), optim::AdamWOptions{.lr = 0.01});
      sharded = true;
    }
    optim::AdamW<T>& opt = *adamw;
    // The parameters by name, whole (collective under FSDP).
    auto named_values = [&] {
      if (fsdp) return fsdp->full_parameters();
      std::vector<std::pair<std::string, Tensor<T>>> v;
      for (const auto& e : flat->entries()) v.emplace_back(e.name, e.param->value);
      return v;
    };
    const optim::WarmupCosine schedule{0.01, 3, 24, 1e-4};
    DistributedSampler sampler(n, rank, world, 7);

    ckpt::CheckpointManager mgr(dir, comm.get(), {.keep_last = 2});
    std::optional<ckpt::AsyncCheckpointer> saver;
    if (async) saver.emplace(mgr);
    std::int64_t step = 0;
    if (resume) {
      auto last = mgr.latest();
      for (const auto& s : last.skipped)
        if (rank == 0) std::fprintf(stderr, "skipping %s: %s\n", s.path.c_str(), s.reason.c_str());
      if (last.found()) {
        const ckpt::TrainerState ts = fsdp ? ckpt::load_fsdp(last.path, *fsdp, &opt) : mgr.load(last.path, *flat, &opt);
        step = ts.step;
        ckpt::restore_sampler(sampler, *ts.sampler, world);
        if (rank == 0) std::printf("resumed from step %lld (saved on %d ranks)\n", static_cast<long long>(step), ts.world_size);
        if (!dump_loaded.empty()) {
          std::ofstream f(dump_loaded + ".rank" + std::to_string(rank), std::ios::binary);
          for (const auto& [name, t] : named_values())
            f.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
        }
      }
    }
    std::ofstream log;
    if (!samples_log.empty()) log.open(samples_log + ".rank" + std::to_string(rank), std::ios::app);

    auto state = [&] {
      ckpt::TrainerState ts;
      ts.sampler = ckpt::sampler_state(sampler, world);
      ts.schedule = schedule;
      ts.user = {{"program", "ckpt_trainer"}};
      ts.optimizer_steps = opt.steps();
      ts.lr = opt.lr();
      return ts;
    };
    // This rank's slice of the flat buffers, cut into pieces of parameters, for save_sharded.
    auto shard = [&] {
      if (fsdp) return ckpt::fsdp_state(*fsdp, &opt);
      auto& params = *flat;
      const std::int64_t n_all = params.numel(), lo = n_all * rank / world, hi = n_all * (rank + 1) / world;
      ckpt::ShardedState part;
      for (const auto& e : params.entries()) {
        const std::int64_t b = std::max(lo, e.offset), en = std::min(hi, e.offset + e.numel());
        if (b >= en) continue;
        part.model.push_back(ckpt::piece(e.name, e.shape, b - e.offset, params.values().view(b, {en - b})));
        for (const auto& [kind, buf] : opt.flat_state())
          part.optimizer.push_back(ckpt::piece(e.name + "." + kind, e.shape, b - e.offset, buf.view(b, {en - b})));
      }
      return part;
    };
    auto save = [&](bool allow_async) {
      if (saver && allow_async) {
        if (sharded) saver->save_sharded(step, shard(), state());
        else saver->save(step, *flat, &opt, state());
      } else {
        if (sharded) mgr.save_sharded(step, shard(), state());
        else mgr.save(step, *flat, &opt, state());
      }
    };
    ckpt::PreemptionHandler preempt;
    if (!dir.empty()) {  // after the handler: a test may signal this rank as soon as the file exists
      std::filesystem::create_directories(dir);
      std::ofstream(dir + "/pid-rank" + std::to_string(rank) + ".tmp") << ::getpid() << "\n";
      std::filesystem::rename(dir + "/pid-rank" + std::to_string(rank) + ".tmp", dir + "/pid-rank" + std::to_string(rank));
    }
    auto x = Tensor<T>::empty({batch, features});
    auto y = Tensor<std::int32_t>::empty({batch});
    nn::CrossEntropyLoss<T> ce;
    while (step < steps) {
      if (sampler.epoch_done()) sampler.set_epoch(sampler.epoch() + 1);
      const auto idx = sampler.next(batch);
      PTRAIN_CHECK(static_cast<std::int64_t>(idx.size()) == batch, Error, "partial batch");
      if (log.is_open()) {
        log << step + 1;
        for (auto i : idx) log << ' ' << i;
        log << '\n' << std::flush;
      }
      gather_rows(X, idx.data(), batch, x);
      gather_rows(Y, idx.data(), batch, y);
      nn::Cache<T> c, lc;
      opt.set_lr(schedule(step));
      if (fsdp) {
        fsdp->zero_grad();
        ce.forward(fsdp->forward(x, c), y, lc);
        fsdp->backward(ce.backward(lc), c);
        fsdp->step(opt);
      } else {
        auto& ddp = static_cast<parallel::DDP<T>&>(*wrapped);
        flat->zero_grad();
        ce.forward(ddp.forward(x, c), y, lc);
        ddp.backward(ce.backward(lc), c);
        ddp.finish_gradient_sync();
        opt.step();
      }
      ++step;
      if (every > 0 && step % every == 0) save(true);
      if (sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
      if (preempt.should_stop(comm.get())) {
        if (saver) saver->wait();
        save(false);
        std::printf("rank %d: signal %d, checkpoint of step %lld committed, exiting\n", rank, preempt.signal(),
                    static_cast<long long>(step));
        comm->barrier();
        return 0;
      }
    }
    if (saver) saver->wait();
    if (!out.empty()) {
      const auto final_values = named_values();
      std::vector<ckpt::TensorRef> refs;
      for (const auto& [name, t] : final_values) refs.push_back(ckpt::tensor_ref(name, t));
      if (rank == 0) ckpt::write_safetensors(out, refs);
    }
    comm->barrier();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_trainer: %s\n", e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"checkpoint test trainer"};
  app.add_option("--dir", a.dir, "checkpoint directory");
  app.add_option("--steps", a.steps, "train until this many steps are done");
  app.add_option("--every", a.every, "checkpoint every N steps (0: never)");
  app.add_option("--global-batch", a.global_batch, "samples per step over all ranks");
  app.add_option("--hidden", a.hidden, "hidden width of the MLP");
  app.add_option("--sleep-ms", a.sleep_ms, "pause after each step (gives tests time to send signals)");
  app.add_option("--out", a.out, "rank 0 writes the final parameters here (safetensors)");
  app.add_option("--samples-log", a.samples_log, "per-rank log of sample indices");
  app.add_option("--dump-loaded", a.dump_loaded, "per-rank raw dump of parameters after resume");
  app.add_flag("--resume", a.resume, "resume from the latest checkpoint in --dir if there is one");
  app.add_flag("--async", a.async, "asynchronous checkpoints");
  app.add_flag("--sharded", a.sharded, "one checkpoint file per rank (save_sharded)");
  app.add_option("--fsdp", a.fsdp_strategy, "FSDP instead of DDP: full_shard, shard_grad_op, shard_optimizer, no_shard, "
                 "hybrid (shard groups of 2)");
  app.add_option("--dtype", a.dtype, "f32 (default) or f64: the element type of the model, optimizer and checkpoints")
      ->check(CLI::IsMember({"f32", "f64"}));
  CLI11_PARSE(app, argc, argv);
  return a.dtype == "f64" ? train<double>(a) : train<float>(a);
}
