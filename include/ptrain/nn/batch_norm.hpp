#pragma once
// BatchNorm1d, BatchNorm2d and SyncBatchNorm: per-channel normalisation over
// the batch (and spatial) dimensions, with learned scale and shift and running
// statistics that follow train() / eval, as torch.nn.BatchNorm*d.
//
// The running statistics are buffers (Module's header comment) named as in
// PyTorch's state_dict: running_mean, running_var and num_batches_tracked
// (stored in the element type T, not int64). SyncBatchNorm takes its
// statistics over the whole data-parallel batch through the all-reduce that
// an engine hands it (Module::set_replica_sum; Note [Synchronised batch
// statistics] in ops/batch_norm.hpp).

#include <sstream>
#include <string>

#include "ptrain/nn/module.hpp"
#include "ptrain/ops/batch_norm.hpp"
#include "ptrain/ops/vector.hpp"

namespace ptrain::nn {

/// torch.nn.BatchNorm*d's keywords. momentum None (a cumulative average) has no equivalent.
struct BatchNormOptions {
  double eps = 1e-5;
  double momentum = 0.1;
  bool affine = true;               ///< learned weight (init 1) and bias (init 0)
  bool track_running_stats = true;  ///< keep running statistics and normalise with them in eval mode
};

/// The common body of BatchNorm1d, BatchNorm2d and SyncBatchNorm over [N, C, *] inputs.
template <class T>
class BatchNorm : public Module<T> {
 public:
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    check_input(x);
    PTRAIN_CHECK(x.size(1) == c_, ShapeError, "[ptrain.batch_norm.shape] input ", x.shape(), " has ", x.size(1),
                 " channels but ", describe(), " expects ", c_);
    const bool batch_stats = this->training() || !track_;
    const bool update = this->training() && track_;
    ops::BatchNormSaved<T> saved;
    auto y = ops::batch_norm(x, weight_ ? weight_->value : Tensor<T>(), bias_ ? bias_->value : Tensor<T>(),
                             running_mean_, running_var_,
                             batch_stats, o_.momentum, o_.eps, saved, sum_);
    if (update) count_batch();
    cache.tensors = {x};
    cache.stats = {saved.mean, saved.invstd};
    cache.values = {static_cast<std::uint64_t>(saved.count), saved.batch_stats ? 1u : 0u};
    return y;
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 1 && cache.stats.size() == 2 && cache.values.size() == 2, Error,
                 "[ptrain.backward] ", describe(), "::backward without a forward in this cache");
    ops::BatchNormSaved<T> saved{cache.stats[0], cache.stats[1], static_cast<double>(cache.values[0]),
                                 cache.values[1] != 0};
    auto dx = ops::batch_norm_backward(cache.tensors[0], weight_ ? weight_->value : Tensor<T>(), dy, saved,
                                       weight_ ? &weight_->grad : nullptr, bias_ ? &bias_->grad : nullptr, sum_);
    if (weight_) {
      weight_->mark_grad_ready();
      bias_->mark_grad_ready();
    }
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    std::ostringstream s;
    s << name_ << "(" << c_ << ", eps=" << o_.eps << ", momentum=" << o_.momentum << (o_.affine ? "" : ", affine=False")
      << (track_ ? "" : ", track_running_stats=False") << ")";
    return s.str();
  }
  Parameter<T>* weight() { return weight_; }
  Parameter<T>* bias() { return bias_; }
  /// Null without track_running_stats.
  Tensor<T>* running_mean() { return running_mean_; }
  Tensor<T>* running_var() { return running_var_; }
  Tensor<T>* num_batches_tracked() { return num_batches_; }

 protected:
  BatchNorm(std::string name, std::int64_t features, const BatchNormOptions& o)
      : name_(std::move(name)), c_(features), o_(o), track_(o.track_running_stats) {
    PTRAIN_CHECK(features > 0 && o.eps >= 0 && o.momentum >= 0 && o.momentum <= 1, ShapeError, "[ptrain.",
                 name_, ".args] features ", features, " must be positive, eps ", o.eps,
                 " non-negative and momentum ", o.momentum, " in [0, 1]");
    if (o.affine) {
      weight_ = &this->register_parameter("weight", Tensor<T>::full({features}, T(1)));
      bias_ = &this->register_parameter("bias", Tensor<T>::zeros({features}));
    }
    if (track_) {
      running_mean_ = &this->register_buffer("running_mean", Tensor<T>::zeros({features}));
      running_var_ = &this->register_buffer("running_var", Tensor<T>::full({features}, T(1)));
      num_batches_ = &this->register_buffer("num_batches_tracked", Tensor<T>::zeros({}));
    }
  }
  /// Throws unless x has the dimensions this kind of layer takes.
  virtual void check_input(const Tensor<T>& x) const = 0;
  ops::ReplicaSum sum_;  ///< set for SyncBatchNorm by use_replica_sum()

 private:
  // num_batches_tracked += 1 on the buffer's device.
  void count_batch() {
    if (!one_.defined() || one_.device() != num_batches_->device())
      one_ = Tensor<T>::full({}, T(1)).to(num_batches_->device());
    ops::axpy_(acc_t<T>(1), one_, *num_batches_);
  }

  std::string name_;
  std::int64_t c_;
  BatchNormOptions o_;
  bool track_;
  Parameter<T>* weight_ = nullptr;
  Parameter<T>* bias_ = nullptr;
  Tensor<T>* running_mean_ = nullptr;
  Tensor<T>* running_var_ = nullptr;
  Tensor<T>* num_batches_ = nullptr;
  Tensor<T> one_;
};

/// [N, C] or [N, C, L], statistics per channel over N (and L).
template <class T>
class BatchNorm1d : public BatchNorm<T> {
 public:
  explicit BatchNorm1d(std::int64_t features, const BatchNormOptions& o = {})
      : BatchNorm<T>("BatchNorm1d", features, o) {}

 protected:
  void check_input(const Tensor<T>& x) const override {
    PTRAIN_CHECK(x.dim() == 2 || x.dim() == 3, ShapeError, "[ptrain.batch_norm.shape] BatchNorm1d takes [N, C] or "
                 "[N, C, L], got ", x.shape(), "; use BatchNorm2d for [N, C, H, W]");
  }
};

/// [N, C, H, W], statistics per channel over N, H and W.
template <class T>
class BatchNorm2d : public BatchNorm<T> {
 public:
  explicit BatchNorm2d(std::int64_t features, const BatchNormOptions& o = {})
      : BatchNorm<T>("BatchNorm2d", features, o) {}

 protected:
  void check_input(const Tensor<T>& x) const override {
    PTRAIN_CHECK(x.dim() == 4, ShapeError, "[ptrain.batch_norm.shape] BatchNorm2d takes [N, C, H, W], got ",
                 x.shape(), "; use BatchNorm1d for [N, C] or [N, C, L]");
  }
};

/// BatchNorm over [N, C, *] whose training statistics (and their gradients)
/// span every data-parallel replica's batch; the engine (DDP, FSDP, the
/// pipeline's data-parallel group) hands it the all-reduce. Without one (one
/// process, parallel::Local) it is BatchNorm over the local batch.
template <class T>
class SyncBatchNorm : public BatchNorm<T> {
 public:
  explicit SyncBatchNorm(std::int64_t features, const BatchNormOptions& o = {})
      : BatchNorm<T>("SyncBatchNorm", features, o) {}
  /// True once an engine has attached it to a group of more than one replica.
  bool synchronised() const { return static_cast<bool>(this->sum_); }

 protected:
  void check_input(const Tensor<T>& x) const override {
    PTRAIN_CHECK(x.dim() >= 2, ShapeError, "[ptrain.batch_norm.shape] SyncBatchNorm takes [N, C, *], got ",
                 x.shape());
  }
  void use_replica_sum(const ops::ReplicaSum& sum) override { this->sum_ = sum; }
};

}  // namespace ptrain::nn
