#pragma once
// Trainer: an optional training loop on the Engine contract (parallel/engine.hpp),
// in the spirit of a Determined trial or a Lightning Trainer. It runs epochs
// of steps over a Dataset with gradient accumulation, clipping and a learning
// rate schedule; evaluates every N steps and after each epoch; saves
// asynchronous checkpoints every N steps and at the end; on SIGTERM, SIGINT or
// SIGUSR1 saves a checkpoint and returns the agreed exit code; resumes from the
// newest checkpoint that verifies (skipping corrupt ones, restoring the sampler
// position and the schedule's step, at any world size); writes JSON-lines
// metrics and the progress line on rank 0.
//
//   train::Trainer<float> trainer(*engine, opt, data, {.epochs = 10, .batch = 64, .checkpoint_dir = "ckpt"});
//   trainer.schedule = optim::WarmupCosine{...};        // optional
//   trainer.evaluate = [&](parallel::Engine<float>& e) { return nlohmann::json{{"accuracy", acc(e)}}; };
//   return trainer.run().exit_code;
//
// Every part is a public piece (Engine, DistributedSampler, ckpt::save/load,
// PreemptionHandler, MetricsWriter, Progress) and run() is the loop a program
// would write with them; replace a part with a callback, or copy the loop.
//
// Note [Trainer steps]
// A step is one optimizer update: `batch` samples per data-parallel rank,
// split into grad_accum micro-batches (all but the last inside no_sync()),
// each weighted by its share of the rows so the gradient is that of the mean
// over the whole batch. The step count is derived from the sampler position,
// not stored, and counted from the end of the epoch: a checkpoint taken after
// p samples per rank of epoch e on W ranks continues on M ranks at position
// p' = p W / M of the epoch's N samples per rank, and the sampler still yields
// num_batches(N - p') batches there, so the run stands at step
// (e + 1) * steps_per_epoch(M) - num_batches(N - p') (resumed_step). Every epoch
// then ends on a multiple of steps_per_epoch(M) and the run on total_steps(),
// where the schedule reaches its end, whatever p' is. On the same world size
// and batch p is a multiple of the batch and this is the step saved. The
// schedule, the progress total and the end of training follow the new world
// size (Note [Sampler reshape] in ckpt/sampler_state.hpp). On more ranks the
// steps are smaller than the checkpoint's: the manager knows the run resumed
// (CheckpointManager::resumed_from), so the new saves replace the old numbering.
//
// Note [Token-weighted loss]
// The default loss is the mean cross-entropy over a micro-batch's targets that count
// (not the ignore index -100). When the data set masks targets (Dataset::masks_targets:
// instruction data, where only answers count) a step's loss is the mean over every
// counted target of the global batch, all micro-batches of all data-parallel ranks, as
// one process over the whole batch computes it: not a mean of micro-batch or rank
// means, which differ as soon as micro-batches count different numbers of targets.
// So micro-batch j of a rank, counting n_j targets, gets the weight
//   w_j = n_j W / N,   N = the sum of n_j over the micro-batches and ranks
// (one all-reduce of a count per step over the data-parallel group of W ranks), and
// forward_backward(mb, w_j) adds w_j grad(mean_j) = (W / N) grad(sum of its losses);
// the engines average the gradients over the W ranks, which leaves grad(sum over all
// targets) / N. The step's loss, sum_j w_j loss_j, averaged over the ranks
// (Engine::average, as the metrics record does), is the same token-weighted mean. A
// step where nothing counts gets weights 0 (loss 0, no gradient). Otherwise, and with
// a loss of the user's (Engine::set_loss: the Trainer cannot know what it counts) or
// value targets, micro-batches weigh by their rows, as before. The weights are
// arguments of the loss kernels, which a captured CUDA graph would keep fixed: a run
// whose data set masks targets runs eagerly, with one line in the log. Limit: the
// pipeline engine's own micro-batches are still a mean of means (parallel/pipeline.hpp).
//
// On a GPU the step's loss stays on the device and is read only where it is
// reported (Note [Loss on the device] in train/step_graph.hpp), and the whole
// step is captured in a CUDA graph and replayed (Note [CUDA graphs of the step]).

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ptrain/ckpt/async_writer.hpp"
#include "ptrain/ckpt/checkpoint.hpp"
#include "ptrain/ckpt/engine_checkpoint.hpp"
#include "ptrain/ckpt/preemption.hpp"
#include "ptrain/data/batches.hpp"
#include "ptrain/data/dataset.hpp"
#include "ptrain/data/loader.hpp"
#include "ptrain/data/sampler.hpp"
#include "ptrain/dist/flight_recorder.hpp"
#include "ptrain/obs/trace.hpp"
#include "ptrain/optim/optimizer.hpp"
#include "ptrain/optim/schedule.hpp"
#include "ptrain/parallel/engine.hpp"
#include "ptrain/parallel/expert_parallel.hpp"
#include "ptrain/train/metrics.hpp"
#include "ptrain/train/progress.hpp"
#include "ptrain/train/step_graph.hpp"
#include "ptrain/train/stragglers.hpp"

namespace ptrain::train {

struct TrainerOptions {
  int epochs = 1;
  std::int64_t batch = 32;  ///< samples per data-parallel rank per step
  int grad_accum = 1;       ///< micro-batches per step (Note [Trainer steps])
  double grad_clip = 0;     ///< global-norm clipping before each update; 0: off
  bool drop_last = false;   ///< drop an epoch's last partial batch (the pipeline needs equal batches)
  std::uint64_t seed = 0;   ///< data order (DistributedSampler)
  std::int64_t log_every = 100;   ///< progress line and metrics record every N steps (0: none)
  std::int64_t eval_every = 0;    ///< evaluate every N steps (0: only after each epoch)
  std::string metrics = {};       ///< JSON-lines file written by rank 0 ("": none)
  std::string tensorboard = {};   ///< directory for rank 0's TensorBoard event file ("": none)
  std::string checkpoint_dir = {};    ///< "": no checkpoints, no resume, signals end the process as usual
  std::int64_t checkpoint_every = 0;  ///< background checkpoint every N steps (0: only at the end and on a signal)
  int keep_checkpoints = 3;           ///< committed checkpoints kept; 0 keeps all
  bool resume = true;                 ///< continue from the newest good checkpoint in checkpoint_dir
  bool start_over = false;  ///< when every checkpoint there is corrupt: set them aside and start at step 0 (else refuse)
  int preempt_exit_code = 0;          ///< returned after the checkpoint a signal asked for
  nlohmann::json config = nlohmann::json::object();  ///< the run's settings; a resume with others is refused
  /// Keep each step's loss on the device, read only for the progress line and metrics, at
  /// checkpoints and at the end (Note [Loss on the device]). Unset: on when the parameters
  /// are on a GPU, the engine is Local, DDP or FSDP and its loss is the default cross-entropy.
  std::optional<bool> device_loss = {};
  /// Capture the whole step in a CUDA graph and replay it (Note [CUDA graphs of the step]);
  /// GPU runs with the loss on the device only; turned off, with a note, where it cannot be.
  bool cuda_graphs = true;
  /// Threads that call Dataset::get ahead of the step (Note [Prefetching loader] in
  /// data/loader.hpp, which says what the Dataset must guarantee); 0: get() on the
  /// training thread, as the loop did before the loader.
  int loader_workers = 1;
  int prefetch = 2;  ///< batches prepared ahead of the step (loader_workers >= 1)
};

/// What run() ended with.
struct TrainResult {
  std::int64_t step = 0;      ///< steps done, over all runs of the job
  bool preempted = false;     ///< stopped by a signal after a checkpoint
  int exit_code = 0;          ///< 0, or options.preempt_exit_code after a signal
  nlohmann::json last_eval;   ///< the last evaluate() result (null without one)
};

/// The step a run stands at when it resumes at `position` of the `per_rank` samples of
/// (0-based) `epoch`: the epoch's steps less those the sampler still yields, so that the
/// epoch ends on step (epoch + 1) * steps_per_epoch (Note [Trainer steps]).
inline std::int64_t resumed_step(std::int64_t epoch, std::int64_t steps_per_epoch, std::int64_t per_rank,
                                 std::int64_t position, std::int64_t batch, bool drop_last) {
  return (epoch + 1) * steps_per_epoch - num_batches(per_rank - position, batch, drop_last);
}

/// What on_step sees after each step.
struct StepInfo {
  std::int64_t step;  ///< 1-based, over the whole run
  int epoch;          ///< 1-based
  double loss;        ///< this rank's weighted sum of micro-batch losses (Note [Token-weighted loss]); with the
                      ///< loss on the device (Note [Loss on the device]) NaN, except on steps that log, where it
                      ///< is the mean since the last log
  double lr;
};

template <class T>
class Trainer {
 public:
  /// `engine`, `opt` (built on engine.parameters()) and `data` must outlive the trainer.
  Trainer(parallel::Engine<T>& engine, optim::Optimizer<T>& opt, Dataset<T>& data, TrainerOptions options)
      : engine_(engine), opt_(opt), data_(data), o_(std::move(options)) {
    PTRAIN_CHECK(o_.epochs >= 1 && o_.batch >= 1 && o_.grad_accum >= 1 && o_.grad_accum <= o_.batch, Error,
                 "[ptrain.trainer.options] need epochs >= 1, batch >= 1 and 1 <= grad_accum <= batch (got ", o_.epochs,
                 ", ", o_.batch, ", ", o_.grad_accum, ")");
    PTRAIN_CHECK(o_.log_every >= 0 && o_.eval_every >= 0 && o_.checkpoint_every >= 0 && o_.grad_clip >= 0, Error,
                 "[ptrain.trainer.options] log_every, eval_every, checkpoint_every and grad_clip must be >= 0");
    PTRAIN_CHECK(o_.loader_workers >= 0 && o_.prefetch >= 1, Error, "[ptrain.trainer.options] need loader_workers "
                 ">= 0 and prefetch >= 1 (got ", o_.loader_workers, ", ", o_.prefetch, ")");
    dist::Communicator* dp = engine_.data_parallel_group();
    data_rank_ = dp ? dp->rank() : 0;
    data_world_ = dp ? dp->size() : 1;
    const std::int64_t per_rank = DistributedSampler(data_.size(), data_rank_, data_world_, o_.seed).num_samples();
    per_epoch_ = num_batches(per_rank, o_.batch, o_.drop_last);
    PTRAIN_CHECK(per_epoch_ > 0, Error, "[ptrain.trainer.data] ", data_.size(), " samples give no batch of ",
                 o_.batch, " on each of ", data_world_, " data-parallel ranks; use a smaller batch");
  }

  /// Steps of the whole run (for a schedule); depends on the data-parallel world size.
  std::int64_t total_steps() const { return per_epoch_ * o_.epochs; }

  /// Learning rate of step s (0-based); default: the optimizer's rate, unchanged.
  std::function<double(std::int64_t step)> schedule;
  /// Collective evaluation (every rank calls it); its JSON object goes to the metrics and the log.
  std::function<nlohmann::json(parallel::Engine<T>&)> evaluate;
  /// Called after every step on every rank.
  std::function<void(const StepInfo&)> on_step;

  /// Runs (or resumes) the training; collective.
  TrainResult run() {
    const int data_world = data_world_;
    const bool lead = engine_.communicator().rank() == 0;
    DistributedSampler sampler(data_.size(), data_rank_, data_world, o_.seed);
    const std::int64_t total = total_steps();

    TrainResult result;
    int start_epoch = 0;
    bool resumed = false;
    std::unique_ptr<ckpt::CheckpointManager> mgr;
    std::unique_ptr<ckpt::AsyncCheckpointer> saver;
    std::unique_ptr<ckpt::PreemptionHandler> preempt;
    if (!o_.checkpoint_dir.empty()) {
      mgr = std::make_unique<ckpt::CheckpointManager>(o_.checkpoint_dir, &engine_.communicator(),
                                                      ckpt::CheckpointOptions{.keep_last = o_.keep_checkpoints});
      mgr->check_writable();
      saver = std::make_unique<ckpt::AsyncCheckpointer>(*mgr);
      if (o_.resume) resumed = try_resume(*mgr, sampler, lead, start_epoch, result.step);
      preempt = std::make_unique<ckpt::PreemptionHandler>();
    }
    std::int64_t last_saved = resumed ? result.step : -1;
    auto state = [&] {
      ckpt::TrainerState ts;
      ts.step = result.step;
      ts.sampler = ckpt::sampler_state(sampler, data_world);
      ts.user = {{"config", o_.config}};
      return ts;
    };

    const bool device_loss = use_device_loss();
    auto restore = [this, device_loss](void*) {
      if (device_loss) engine_.set_loss({});
      own_loss_ = false;
      (void)opt_.use_device_scalars(false);
      graph_ = CudaStepGraph();
      inputs_ = Batch<T>();
    };
    const std::unique_ptr<void, decltype(restore)> restore_guard(this, restore);
    plan_ = StepGraphPlan(1);
    if (const std::string why = graph_blocker(device_loss); !why.empty()) {
      plan_.turn_off(why);
      if (lead && o_.cuda_graphs && engine_.parameters().values().device().is_cuda())
        std::printf("CUDA graphs off: %s\n", why.c_str());
    }
    MetricsWriter metrics = open_metrics(lead, resumed);
    obs::Tracer& tracer = obs::Tracer::get();
    tracer.configure_from_env(engine_.communicator().rank());
    StepTimes times;  // Note [Straggler report]
    Progress progress(total, lead ? o_.log_every : 0, std::cout, result.step);
    Stopwatch clock;
    ReportWindow window{clock.seconds()};  // a resumed run's first window holds only the steps run here
    parallel::reset_moe_metrics(engine_.local_module());  // so do the MoE layers' (Note [MoE metrics window])
    auto run_eval = [&](int epoch) {
      if (!evaluate) return;
      engine_.train(false);
      result.last_eval = evaluate(engine_);
      engine_.train(true);
      nlohmann::json rec = {{"step", result.step}, {"epoch", epoch}};
      rec.update(result.last_eval);
      metrics.write(rec);
      if (lead) {
        std::string line;
        for (const auto& [key, value] : result.last_eval.items()) {
          char num[32];
          if (value.is_number_float()) std::snprintf(num, sizeof num, "%.4f", value.template get<double>());
          line += ", " + key + " " + (value.is_number_float() ? std::string(num) : value.dump());
        }
        std::printf("epoch %d, step %lld%s\n", epoch, static_cast<long long>(result.step), line.c_str());
      }
    };

    // Note [Prefetching loader]: batch k is the sampler's k-th step whatever the workers'
    // timing, and the sampler advances only by what next() hands out. While the side-stream
    // copy is gated the batch stays on the host and goes to the device as before.
    const Device param_dev = engine_.parameters().values().device();
    const bool copy_ahead = param_dev.is_cuda() && kernels::cuda_kernel_enabled("prefetch_copy_stream");
    DataLoader<T> loader(data_, sampler, {.batch = o_.batch, .drop_last = o_.drop_last, .workers = o_.loader_workers,
                                          .prefetch = o_.prefetch, .device = copy_ahead ? param_dev : Device::cpu()});
    for (int epoch = start_epoch; epoch < o_.epochs; ++epoch) {
      if (!(resumed && epoch == start_epoch)) sampler.set_epoch(static_cast<std::uint64_t>(epoch));
      loader.start();
      while (!sampler.epoch_done()) {
        tracer.step(result.step + 1);
        const double t0 = clock.seconds(), wait0 = dist::collective_wait_seconds();
        std::optional<obs::Span> data_span(std::in_place, "data", "train");
        std::optional<Batch<T>> next = loader.next();  // the data wait: blocked here
        if (!next) break;                              // a partial last batch with drop_last
        // With the loss on the device the batch goes to the device in device_step().
        const Batch<T> b = device_loss ? std::move(*next) : to_device(std::move(*next));
        data_span.reset();
        const double t_data = clock.seconds() - t0;
        if (schedule) opt_.set_lr(schedule(result.step));
        double loss = device_loss ? 0.0 : step(b);
        if (device_loss) device_step(b, lead);
        ++result.step;
        const bool report = o_.log_every > 0 && (result.step % o_.log_every == 0 || result.step == total);
        // Device loss: 0 for the steps between reports and the window's sum at a report,
        // so that the progress line and the record below average what they did before.
        if (device_loss && report) loss = losses_.sum();
        times.add(clock.seconds() - t0, t_data, dist::collective_wait_seconds() - wait0);
        progress.update(result.step, epoch + 1, loss, opt_.lr(), b.rows() * data_world);
        window.add(b.rows() * data_world, loss);
        if (on_step) {
          const double step_loss = !device_loss ? loss
                                   : report     ? window.mean_loss()
                                                : std::numeric_limits<double>::quiet_NaN();
          on_step({result.step, epoch + 1, step_loss, opt_.lr()});
        }
        if (device_loss && report) losses_.reset();
        if (report) {
          const double mean = engine_.average(window.mean_loss());  // every rank, same steps
          const double now = clock.seconds();
          nlohmann::json rec = {{"step", result.step}, {"epoch", epoch + 1}, {"loss", mean}, {"lr", opt_.lr()},
                                {"samples_per_s", window.samples_per_s(now)}, {"world_size", data_world}};
          rec.update(straggler_report(engine_.communicator(), times));  // every rank, same steps
          rec.update(memory_fields());
          // MoE routing over the window's training forwards, of every rank (pipeline stages hold
          // different layers: rank 0's stage, its own micro-batches); a new window after the record.
          if (engine_.mode() != parallel::Mode::Pipeline)
            parallel::all_reduce_moe_stats(engine_.local_module(), engine_.communicator());  // every rank
          for (const auto& [name, value] : engine_.local_module().named_metrics()) rec[name] = value;
          metrics.write(rec);
          parallel::reset_moe_metrics(engine_.local_module());
          window.reset(now);
          times = {};
        }
        if (saver && o_.checkpoint_every > 0 && result.step % o_.checkpoint_every == 0) {
          obs::Span span("checkpoint.save", "ckpt");
          if (device_loss) (void)losses_.sum();  // a bad target surfaces before the checkpoint
          ckpt::save(*saver, *mgr, result.step, engine_, &opt_, state());  // returns after a copy to host memory
          last_saved = result.step;
        }
        if (o_.eval_every > 0 && result.step % o_.eval_every == 0) run_eval(epoch + 1);
        // One all-reduce per step: every rank stops at the same step when any got a signal.
        if (preempt && preempt->should_stop(&engine_.communicator())) {
          saver->wait();
          if (device_loss) (void)losses_.sum();
          ckpt::save(*mgr, result.step, engine_, &opt_, state());
          if (lead) {
            std::printf("signal %d: checkpoint of step %lld committed in %s; exiting\n", preempt->signal(),
                        static_cast<long long>(result.step), o_.checkpoint_dir.c_str());
            std::fflush(stdout);  // the launcher's SIGTERM may come before exit() flushes a pipe
          }
          result.preempted = true;
          result.exit_code = o_.preempt_exit_code;
          return result;
        }
      }
      if (o_.eval_every == 0 || result.step % o_.eval_every != 0) run_eval(epoch + 1);
    }
    if (device_loss) (void)losses_.sum();  // the end: a bad target of the last steps surfaces here
    if (saver) {
      saver->wait();
      if (last_saved != result.step) ckpt::save(*mgr, result.step, engine_, &opt_, state());
    }
    tracer.flush();
    return result;
  }

  /// One optimizer step on this rank's batch (Note [Trainer steps]); returns the weighted sum of
  /// the micro-batch losses (Note [Token-weighted loss]; NaN when the engine's loss keeps it on the
  /// device: Note [Loss on the device]). Collective when the data set masks targets.
  double step(const Batch<T>& b) { return step(b, micro_batch_weights(b)); }
  /// step() with the micro-batches' loss weights (micro_batch_weights).
  double step(const Batch<T>& b, const std::vector<double>& weights) {
    const std::int64_t rows = b.rows();
    const int k = static_cast<int>(weights.size());
    PTRAIN_CHECK(k >= 1 && k <= rows, Error, "[ptrain.trainer.weights] ", k, " micro-batch weights for ", rows,
                 " rows; pass micro_batch_weights(batch)");
    engine_.zero_grad();
    double loss = 0;
    for (int j = 0; j < k; ++j) {
      const std::int64_t begin = rows * j / k, end = rows * (j + 1) / k;
      const Batch<T> mb = b.narrow(begin, end - begin);
      const double w = weights[static_cast<std::size_t>(j)];
      obs::Span span("forward_backward", "train", j);
      if (j + 1 < k) {
        auto guard = engine_.no_sync();
        loss += w * forward_backward(mb, w);
      } else {
        loss += w * forward_backward(mb, w);
      }
    }
    if (o_.grad_clip > 0) {
      obs::Span span("clip_grad_norm", "train");
      engine_.clip_grad_norm_(o_.grad_clip);
    }
    obs::Span span("optimizer_step", "train");
    engine_.step(opt_);
    return loss;
  }

  /// The loss weight of each of the min(grad_accum, rows) micro-batches of `b`: their share
  /// of the rows, or of the global batch's counted targets when the data set masks targets
  /// (Note [Token-weighted loss]; then collective over the data-parallel group).
  std::vector<double> micro_batch_weights(const Batch<T>& b) {
    const std::int64_t rows = b.rows();
    const int k = static_cast<int>(std::min<std::int64_t>(o_.grad_accum, rows));
    std::vector<double> w(static_cast<std::size_t>(k));
    const bool count = data_.masks_targets() && b.targets.is_ids() && (!engine_.has_loss() || own_loss_);
    Tensor<std::int32_t> t;
    if (count) t = b.targets.ids().device().is_cpu() ? b.targets.ids() : b.targets.ids().to(Device::cpu());
    const std::int64_t per_row = count ? t.numel() / rows : 0;
    double total = 0;
    for (int j = 0; j < k; ++j) {
      const std::int64_t begin = rows * j / k, end = rows * (j + 1) / k;
      double& x = w[static_cast<std::size_t>(j)];
      if (!count) {
        x = static_cast<double>(end - begin) / static_cast<double>(rows);
        continue;
      }
      const std::int32_t *p = t.data() + begin * per_row, *q = t.data() + end * per_row;
      x = static_cast<double>((q - p) - std::count(p, q, -100));
      total += x;
    }
    if (!count) return w;
    if (dist::Communicator* dp = engine_.data_parallel_group(); dp && dp->size() > 1)
      dp->all_reduce(&total, 1, DType::F64, dist::ReduceOp::Sum);
    for (double& x : w) x = total > 0 ? x * data_world_ / total : 0.0;
    return w;
  }

  /// The steps' losses on the device since the last report (Note [Loss on the device]).
  const LossWindow& loss_window() const { return losses_; }
  /// When graphs are captured and replayed (Note [CUDA graphs of the step]); off() says
  /// whether the last run() ran eagerly and why_off() why.
  const StepGraphPlan& graph_plan() const { return plan_; }

 private:
  // The leader's metrics writer. Every rank learns whether it opened: a leader
  // that fails alone must not leave the others waiting in the first collective.
  MetricsWriter open_metrics(bool lead, bool resumed) {
    MetricsWriter w;
    std::exception_ptr err;
    try {
      if (lead) w = MetricsWriter(o_.metrics, resumed, o_.tensorboard);
    } catch (const Error&) {
      err = std::current_exception();
    }
    dist::Communicator& comm = engine_.communicator();
    std::int32_t failed = err ? 1 : 0;
    if (comm.size() > 1) comm.all_reduce(&failed, 1, DType::I32, dist::ReduceOp::Max);
    if (err) std::rethrow_exception(err);
    PTRAIN_CHECK(failed == 0, Error, "[ptrain.metrics.open] rank 0 could not open its metrics or TensorBoard files "
                 "(its log has the reason)");
    return w;
  }

  // Allocator bytes (live and peak) of the host and of the parameters' GPU, in MiB.
  nlohmann::json memory_fields() const {
    const Device d = engine_.parameters().values().device();
    const MemoryStats cpu = memory_stats(Device::cpu());
    nlohmann::json m = {{"mem_cpu_live_mib", cpu.live_bytes / 1048576.0}, {"mem_cpu_peak_mib", cpu.peak_bytes / 1048576.0}};
    if (d.is_cuda()) {
      const MemoryStats gpu = memory_stats(d);
      m["mem_gpu_live_mib"] = gpu.live_bytes / 1048576.0;
      m["mem_gpu_peak_mib"] = gpu.peak_bytes / 1048576.0;
    }
    return m;
  }

  // The batch on the device of the engine's parameters (a copy when the data lives elsewhere).
  Batch<T> to_device(Batch<T> b) const {
    const Device d = engine_.parameters().values().device();
    auto move = [d](auto& t) {
      if (t.defined() && t.device() != d) t = t.to(d);
    };
    move(b.x);
    move(b.ids);
    b.targets = b.targets.to(d);
    return b;
  }

  double forward_backward(const Batch<T>& mb, double scale) {
    return mb.ids.defined() ? engine_.forward_backward(mb.ids, mb.targets, scale)
                            : engine_.forward_backward(mb.x, mb.targets, scale);
  }

  // Note [Loss on the device]: on where asked, or by default on a GPU for the engines whose
  // forward_backward runs the whole model's loss on this rank, with the default loss.
  bool use_device_loss() {
    const parallel::Mode m = engine_.mode();
    const bool whole_loss = m == parallel::Mode::Local || m == parallel::Mode::DDP || m == parallel::Mode::FSDP;
    const bool on = o_.device_loss.value_or(engine_.parameters().values().device().is_cuda() && whole_loss &&
                                            !engine_.has_loss());
    if (!on) return false;
    PTRAIN_CHECK(whole_loss && !engine_.has_loss(), Error, "[ptrain.trainer.device_loss] device_loss needs a "
                 "Local, DDP or FSDP engine with the default cross-entropy loss (the Trainer sets "
                 "parallel::device_cross_entropy); leave device_loss unset");
    // keep_output: the Trainer does not know whether the model's last layer reads its output.
    engine_.set_loss(parallel::device_cross_entropy<T>(losses_.step(), -100, 0.0, true));
    own_loss_ = true;
    losses_.reset();
    return true;
  }

  // Why this run cannot capture its step (empty: it can; Note [CUDA graphs of the step]).
  std::string graph_blocker(bool device_loss) {
    if (!o_.cuda_graphs || !engine_.parameters().values().device().is_cuda()) return "not asked for";
    if (!kernels::cuda_kernel_enabled("cuda_graph_step"))
      return "cuda_graph_step is gated (ptrain/kernels/cuda_unverified.hpp; PTRAIN_UNVERIFIED_CUDA=1 runs it)";
    if (!device_loss) return "the loss is read on the host each step (a loss of your own, or a pipeline or "
                             "tensor-parallel engine)";
    if (data_.masks_targets())
      return "the data set masks targets, so each step weighs its micro-batches by the targets that count, "
             "a scale a captured graph would keep fixed (Note [Token-weighted loss])";
    dist::Communicator* dp = engine_.data_parallel_group();
    if (engine_.mode() != parallel::Mode::Local &&
        (!engine_.communicator().graph_capturable() || (dp && !dp->graph_capturable())))
      return "the engine's collectives go through host memory (MPI, Gloo); NCCL's can be captured";
    if (o_.grad_clip > 0)
      return "grad_clip reads the norm on the host; clip on the device with AdamWOptions::max_grad_norm instead";
    if (!opt_.use_device_scalars(true))
      return "the optimizer takes the learning rate by value (AdamW's one-launch update on a GPU reads it from "
             "the device)";
    return {};
  }

  // The step with the loss on the device: eager, captured or replayed (Note [CUDA graphs of
  // the step]); `b` is the batch as the data set gave it.
  void device_step(const Batch<T>& b, bool lead) {
    const std::vector<double> weights = micro_batch_weights(b);  // from the host batch: no device read
    auto eager = [&](const Batch<T>& batch) {
      losses_.begin_step();
      (void)step(batch, weights);
      losses_.end_step();
    };
    StepGraphKey key;
    if (b.x.defined()) key.add_shape(b.x.shape());
    if (b.ids.defined()) key.add_shape(b.ids.shape());
    key.add_shape(b.targets.shape());
    key.settings = "grad_accum=" + std::to_string(o_.grad_accum);
    auto note_off = [&](const std::string& why) {
      plan_.turn_off(why);
      (void)opt_.use_device_scalars(false);
      graph_ = CudaStepGraph();
      inputs_ = Batch<T>();
      if (lead) std::printf("CUDA graphs off: %s\n", why.c_str());
    };
    switch (plan_.next(key)) {
      case StepGraphPlan::Action::Eager: {
        const std::uint64_t draws = random_draws();
        if (!plan_.off()) opt_.stage_device_scalars();  // a warm-up step: the optimizer reads them already
        eager(to_device(b));
        if (!plan_.off() && random_draws() != draws)
          note_off("the model draws random numbers on the host (dropout), which a replay would repeat");
        return;
      }
      case StepGraphPlan::Action::Capture: {
        const Device d = engine_.parameters().values().device();
        inputs_ = to_device(b);
        inputs_ = {inputs_.x.defined() ? inputs_.x.clone() : Tensor<T>(),
                   inputs_.ids.defined() ? inputs_.ids.clone() : Tensor<std::int32_t>(),
                   inputs_.targets.is_ids() ? nn::Targets<T>(inputs_.targets.ids().clone())
                                            : nn::Targets<T>(inputs_.targets.values().clone())};
        if (!graph_.defined()) graph_ = CudaStepGraph(d.index);  // a capture again reuses its stream's pool
        const std::int64_t steps = opt_.steps();
        opt_.stage_device_scalars();
        std::string failed;
        try {
          graph_.capture("the Trainer's step", [&] { eager(inputs_); });
        } catch (const Error& e) {
          failed = e.what();
        }
        // Every rank keeps its graph, or none does: their collectives must match.
        dist::Communicator& comm = engine_.communicator();
        std::int32_t any_failed = failed.empty() ? 0 : 1;
        if (comm.size() > 1) comm.all_reduce(&any_failed, 1, DType::I32, dist::ReduceOp::Max);
        if (any_failed) {
          opt_.set_steps(steps);
          note_off("capturing the step failed: " + (failed.empty() ? std::string("on another rank") : failed));
          eager(to_device(b));
          return;
        }
        plan_.captured();
        graph_.launch();
        return;
      }
      case StepGraphPlan::Action::Replay:
        put(inputs_.x, b.x);
        put(inputs_.ids, b.ids);
        if (b.targets.is_ids()) put(inputs_.targets.ids(), b.targets.ids());
        else put(inputs_.targets.values(), b.targets.values());
        opt_.stage_device_scalars();
        graph_.launch();
        opt_.count_replayed_step();
        return;
    }
  }

  // Copies a batch tensor into the graph's input of the same shape: from host memory
  // without waiting for the device (kernels::CudaGraphCalls::upload).
  template <class U>
  static void put(const Tensor<U>& dst, const Tensor<U>& src) {
    if (!src.defined()) return;
    if (src.device().is_cpu() && dst.device().is_cuda()) {
      kernels::cuda_graph_calls().upload(dst.data(), src.data(), static_cast<std::size_t>(src.numel()) * sizeof(U),
                                         dst.device().index);
    } else {
      Tensor<U>(dst).copy_(src);
    }
  }

  // The offsets of the model's random streams, summed: a step that moves them draws on the host.
  std::uint64_t random_draws() {
    std::uint64_t sum = 0;
    for (Generator* g : engine_.local_module().random_streams()) sum += g->offset();
    return sum;
  }

  // Loads the newest good checkpoint (if any); sets the sampler, the epoch and the step.
  bool try_resume(ckpt::CheckpointManager& mgr, DistributedSampler& sampler, bool lead, int& epoch,
                  std::int64_t& step) {
    const auto last = mgr.latest_to_resume(o_.start_over);
    for (const auto& s : last.skipped)
      if (lead) std::fprintf(stderr, "ptrain: skipping checkpoint %s: %s\n", s.path.c_str(), s.reason.c_str());
    if (!last.found()) {
      if (lead) std::printf("no checkpoint in %s; starting from step 0\n", o_.checkpoint_dir.c_str());
      return false;
    }
    // The settings first, from trainer.json alone: a mismatch leaves the model untouched.
    const ckpt::TrainerState saved = ckpt::Checkpoint(last.path, false).trainer_state();
    check_config(saved.user, last.path.string());
    PTRAIN_CHECK(saved.sampler.has_value(), CheckpointError, "[ptrain.trainer.resume] ", last.path.string(),
                 " has no sampler position; it was not written by a Trainer");
    ckpt::load(mgr, last.path, engine_, &opt_);
    // Another data-parallel size continues the epoch as exactly as the sample count
    // allows (Note [Sampler reshape]); the same size resumes bit for bit.
    ckpt::restore_sampler(sampler, *saved.sampler, data_world_, saved.sampler->world_size != data_world_);
    epoch = static_cast<int>(saved.sampler->epoch);
    step = resumed_step(epoch, per_epoch_, sampler.num_samples(), sampler.position(), o_.batch, o_.drop_last);
    if (lead)
      std::printf("resumed from %s: step %lld, epoch %d (saved at step %lld on %d data-parallel rank(s))\n",
                  last.path.c_str(), static_cast<long long>(step), epoch + 1, static_cast<long long>(saved.step),
                  saved.sampler->world_size);
    return true;
  }

  void check_config(const nlohmann::json& user, const std::string& path) const {
    const nlohmann::json was = user.is_object() && user.contains("config") ? user["config"] : nlohmann::json();
    std::string diff;
    for (const auto& [key, now] : o_.config.items()) {
      const nlohmann::json before = was.is_object() && was.contains(key) ? was[key] : nlohmann::json();
      if (before != now) diff += "; " + key + " " + before.dump() + " in the checkpoint, " + now.dump() + " now";
    }
    PTRAIN_CHECK(diff.empty(), CheckpointError, "[ptrain.trainer.config] ", path,
                 " was written with other settings", diff,
                 "; resume with the same settings, or use another checkpoint directory");
  }

  parallel::Engine<T>& engine_;
  optim::Optimizer<T>& opt_;
  Dataset<T>& data_;
  TrainerOptions o_;
  int data_rank_ = 0, data_world_ = 1;
  std::int64_t per_epoch_ = 0;  // steps per epoch
  LossWindow losses_;           // Note [Loss on the device]
  bool own_loss_ = false;       // the engine's loss is the Trainer's device_cross_entropy
  StepGraphPlan plan_;          // Note [CUDA graphs of the step]
  CudaStepGraph graph_;
  Batch<T> inputs_;             // the graph's static inputs
};

}  // namespace ptrain::train
