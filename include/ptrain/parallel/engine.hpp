#pragma once
// The training contract. Every way of spreading training over ranks is an
// Engine: one process (Local), data parallel (DDP), fully sharded (FSDP, every
// strategy), pipeline (Pipeline, with data-parallel replicas), tensor parallel
// (TensorParallel: Megatron-style, with optional sequence parallelism, pipeline
// stages and data-parallel replicas); a training loop written against Engine
// runs unchanged in each of them. make_engine (parallel/make_engine.hpp) builds
// any of them from a Plan.
//
//   auto world = dist::init_process_group();                  // a world of one without a launcher
//   auto engine = parallel::make_engine<float>(model, *world, parallel::FSDPOptions{});  // picks the mode
//   optim::AdamW<float> opt(engine->parameters(), {.lr = 1e-3});
//   for (...) {
//     engine->zero_grad();
//     double loss = engine->forward_backward(x, y);          // this rank's batch
//     engine->clip_grad_norm_(1.0);
//     engine->step(opt);                                       // finishes the gradient sync first
//   }
//
// Note [Engine contract]
// - parameters() are the flat parameters this rank's optimizer updates: the
//   whole model (Local, DDP), this rank's shard (FSDP), this stage's
//   (Pipeline), this rank's tensor-parallel shards of its stage
//   (TensorParallel). Optimizers are built on them the same way in every mode.
// - forward_backward(input, targets, grad_scale) runs forward, the loss
//   (LossFn; default: mean cross-entropy over rows) and backward on this rank's
//   batch and adds grad_scale * d(loss) to the gradients. Targets are int32
//   class ids or values of T (nn/targets.hpp), whichever the loss takes.
//   Synchronisation of the gradients may start during backward and go on
//   after it returns.
// - Nothing reads gradients before their synchronisation has finished:
//   clip_grad_norm_(), step() and parameter checkpoints finish it first, and
//   a forward_backward() that follows another without step() waits for the
//   previous one's (so accumulating without no_sync() is correct, only slower).
// - Inside no_sync() forward_backward() accumulates without communicating
//   where the mode keeps full gradients (Local, DDP, FSDP ShardOptimizer and
//   NoShard, the data-parallel reductions of the pipeline and of tensor
//   parallelism); the first one after the scope reduces what was accumulated.
//   Sharded-gradient FSDP reduces every time (Note [Accumulation] in fsdp.hpp).
// - Every rank calls the same Engine functions in the same order, with the
//   same batch shape (Note [Collective order contract] in dist/communicator.hpp);
//   only Local calls no collective.

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>

#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/flight_recorder.hpp"
#include "ptrain/obs/trace.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/nn/loss.hpp"
#include "ptrain/nn/module.hpp"
#include "ptrain/optim/clip.hpp"
#include "ptrain/optim/optimizer.hpp"

namespace ptrain::parallel {

namespace detail {
using ::ptrain::detail::cat;

/// Hands the SyncBatchNorm layers of `m` the all-reduce over `dp`, the
/// engine's data-parallel group (Note [Synchronised batch statistics] in
/// ops/batch_norm.hpp); without a group of two or more they use their local
/// batch. The group must outlive the module's use of it.
template <class T>
void attach_replica_sum(nn::Module<T>& m, dist::Communicator* dp) {
  if (!dp || dp->size() < 2) {
    m.set_replica_sum({});
    return;
  }
  m.set_replica_sum([dp](Tensor<double>& t) {
    dp->check_serves(t.device(), "SyncBatchNorm");
    dp->all_reduce(t.data(), t.data(), static_cast<std::size_t>(t.numel()), DType::F64, dist::ReduceOp::Sum);
  });
}

/// Steady-clock seconds, for the event timelines of DDP, FSDP and the pipeline.
inline double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace detail

using nn::Targets;

/// A loss on a model's output: returns the loss of one batch and, unless dout is
/// null (evaluation), sets *dout to the gradient of scale * loss with respect to
/// the output. A lambda whose targets parameter is `const Tensor<std::int32_t>&`
/// converts too (Note [Targets conversion] in nn/targets.hpp).
template <class T>
using LossFn = std::function<double(const Tensor<T>& output, const Targets<T>& targets, Tensor<T>* dout,
                                    acc_t<T> scale)>;

/// A LossFn from a loss of nn/loss.hpp (copied into the function), reduced as it
/// was built (mean or sum): `engine->set_loss(parallel::loss_fn<float>(nn::MSELoss<float>()))`.
template <class T, class Loss>
LossFn<T> loss_fn(Loss loss) {
  return [loss](const Tensor<T>& output, const Targets<T>& targets, Tensor<T>* dout, acc_t<T> scale) mutable {
    nn::Cache<T> cache;
    const double l = loss.forward(output, targets, cache);
    if (dout) *dout = loss.backward(cache, scale);
    return l;
  };
}

/// The default LossFn: mean cross-entropy over the rows of the output (nn::CrossEntropyLoss).
template <class T>
double cross_entropy(const Tensor<T>& output, const Targets<T>& targets, Tensor<T>* dout, acc_t<T> scale) {
  nn::CrossEntropyLoss<T> ce;
  nn::Cache<T> cache;
  const double loss = ce.forward(output, targets, cache);
  if (dout) *dout = ce.backward(cache, scale);
  return loss;
}

/// A LossFn that keeps the training loss on the device: mean cross-entropy by
/// ops::fused_classifier_ (nn::CrossEntropyLoss::forward_backward), the gradient
/// written over the output, and grad_scale * loss added to `window` on the output's
/// device, so that a training step never waits for the host to read a loss. For
/// models whose output nothing reads after the loss (a language model's head: its
/// backward needs the head's input and weight, not its output). forward_backward()
/// then returns NaN: read window.mean() where the program reports (the mean loss per
/// step when a step's grad_scales add up to 1, as gradient accumulation's do) and
/// reset() it there. Evaluation (no dout) computes and returns the loss as
/// cross_entropy does. `window` must outlive the engine's use of the function.
/// keep_output: the gradient goes to a copy of the output, which stays as it was (for
/// a model whose last layer reads its output in backward; one more [rows, classes]).
///
///   ops::DeviceLoss window;
///   engine->set_loss(parallel::device_cross_entropy<bf16>(window));
///   ... engine->forward_backward(ids, targets); engine->step(opt); ...
///   if (step % 100 == 0) { std::printf("loss %.4f\n", engine->average(window.mean())); window.reset(); }
template <class T>
LossFn<T> device_cross_entropy(ops::DeviceLoss& window, std::int32_t ignore_index = -100,
                               double label_smoothing = 0.0, bool keep_output = false) {
  return [&window, ignore_index, label_smoothing, keep_output](const Tensor<T>& output, const Targets<T>& targets,
                                                               Tensor<T>* dout, acc_t<T> scale) {
    nn::CrossEntropyLoss<T> ce(ignore_index, label_smoothing);
    if (!dout) {
      nn::Cache<T> cache;
      return ce.forward(output, targets, cache);
    }
    Tensor<T> logits = keep_output ? output.clone() : output;  // overwritten with the gradient
    *dout = ce.forward_backward(logits, targets, window, scale, static_cast<double>(scale));
    return std::numeric_limits<double>::quiet_NaN();
  };
}

/// One batch's input: features (x) or int32 token ids, which the first unit looks
/// up (Module::forward_tokens; the only form for bf16 language models).
template <class T>
struct BatchInput {
  const Tensor<T>* x = nullptr;
  const Tensor<std::int32_t>* ids = nullptr;
};

/// Which mode an engine runs (checkpoints write and read each mode's layout).
enum class Mode { Local, DDP, FSDP, Pipeline, TensorParallel };

template <class T>
class Engine {
 public:
  virtual ~Engine() = default;
  Engine() = default;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  virtual Mode mode() const = 0;
  /// The flat parameters this rank's optimizer updates (Note [Engine contract]).
  virtual nn::FlatParameters<T>& parameters() = 0;
  /// The module this rank runs: the model (Local, DDP), the sharded model whose
  /// forward gathers (FSDP, collective), this stage's units (Pipeline), this
  /// rank's tensor-parallel model or stage (TensorParallel).
  virtual nn::Module<T>& local_module() = 0;
  /// The ranks this engine spans.
  virtual dist::Communicator& communicator() = 0;

  /// Zeroes every gradient buffer the engine keeps (after finishing any sync that writes them).
  virtual void zero_grad() = 0;
  /// Waits for outstanding gradient synchronisation; gradients are then final.
  virtual void finish_gradient_sync() = 0;

  /// Forward, loss and backward of this rank's batch (Note [Engine contract]); returns the loss.
  double forward_backward(const Tensor<T>& x, const Targets<T>& targets, double grad_scale = 1.0) {
    return run(BatchInput<T>{&x, nullptr}, targets, grad_scale, true);
  }
  /// forward_backward() from int32 token ids.
  double forward_backward(const Tensor<std::int32_t>& ids, const Targets<T>& targets,
                          double grad_scale = 1.0) {
    return run(BatchInput<T>{nullptr, &ids}, targets, grad_scale, true);
  }
  /// The loss of a batch without backward (evaluation; call train(false) first to turn dropout off).
  double eval_loss(const Tensor<T>& x, const Targets<T>& targets) {
    return run(BatchInput<T>{&x, nullptr}, targets, 1.0, false);
  }
  double eval_loss(const Tensor<std::int32_t>& ids, const Targets<T>& targets) {
    return run(BatchInput<T>{nullptr, &ids}, targets, 1.0, false);
  }

  /// Finishes the gradient sync, steps the optimizer (built on parameters()) and
  /// refreshes what the mode derives from the parameters (FSDP's gathered copies).
  void step(optim::Optimizer<T>& opt) {
    finish_gradient_sync();
    opt.step();
    parameters_changed();
  }

  /// Global-norm clipping (torch.nn.utils.clip_grad_norm_) over the whole model's
  /// gradients, after the sync; collective. Returns the norm before clipping.
  double clip_grad_norm_(double max_norm) {
    finish_gradient_sync();
    return optim::clip_grad_norm_(parameters().grads(), max_norm, [this](double sq) { return sum_over_model(sq); });
  }

  /// While the returned guard lives, forward_backward() accumulates without
  /// communicating where the mode allows it (Note [Engine contract]).
  [[nodiscard]] auto no_sync() {
    sync_ = false;
    auto restore = [this](void*) { sync_ = true; };
    return std::unique_ptr<void, decltype(restore)>(this, restore);
  }

  /// Mean of a scalar (a loss, an accuracy) over the data-parallel replicas; collective.
  double average(double local) {
    if (dist::Communicator* dp = data_parallel_group(); dp && dp->size() > 1)
      dp->all_reduce(&local, 1, DType::F64, dist::ReduceOp::Avg);
    return local;
  }

  /// Training mode (dropout on) or evaluation mode, on this rank's module.
  virtual void train(bool on = true) { local_module().train(on); }

  /// The loss forward_backward() and eval_loss() use; default cross_entropy.
  void set_loss(LossFn<T> loss) { loss_ = std::move(loss); }
  /// Whether set_loss() gave a loss other than the default.
  bool has_loss() const { return static_cast<bool>(loss_); }

  /// Call (collectively) after changing parameters() other than through step(),
  /// e.g. after loading a checkpoint (FSDP gathers or drops its full copies).
  virtual void parameters_changed() {}
  /// Whether this rank has parameters (a pipeline stage may have none: its parameters() are empty).
  virtual bool has_parameters() const { return true; }
  /// The group over which replicas of this rank's parameters are averaged (null: none).
  virtual dist::Communicator* data_parallel_group() { return &communicator(); }

 protected:
  /// One batch: training (forward, loss, backward) or evaluation (forward, loss).
  virtual double run(const BatchInput<T>& in, const Targets<T>& targets, double grad_scale,
                     bool training) = 0;
  /// Sum of a per-rank partial sum of squares over the ranks that hold distinct
  /// parts of the model (FSDP shards, pipeline stages, tensor-parallel shards);
  /// identity for replicas.
  virtual double sum_over_model(double local) { return local; }
  /// False inside no_sync().
  bool syncing() const { return sync_; }

  double loss(const Tensor<T>& out, const Targets<T>& targets, Tensor<T>* dout, double scale) const {
    const auto s = static_cast<acc_t<T>>(scale);
    return loss_ ? loss_(out, targets, dout, s) : cross_entropy<T>(out, targets, dout, s);
  }

  /// run() for engines that hold a whole module: forward, loss, backward.
  double run_module(nn::Module<T>& m, const BatchInput<T>& in, const Targets<T>& targets,
                    double grad_scale, bool training) {
    cache_.clear();
    Tensor<T> out = in.ids ? m.forward_tokens(*in.ids, cache_) : m.forward(*in.x, cache_);
    Tensor<T> dout;
    const double l = loss(out, targets, training ? &dout : nullptr, grad_scale);
    if (training) m.backward(dout, cache_);
    cache_.clear();
    return l;
  }

 private:
  LossFn<T> loss_;
  nn::Cache<T> cache_;
  bool sync_ = true;
};

}  // namespace ptrain::parallel
