#pragma once
// Batch normalisation over the batch (and spatial) dimensions of [N, C, *]
// tensors, optionally synchronised over data-parallel replicas.
//
// Note [Synchronised batch statistics]
// SyncBatchNorm (PyTorch's semantics) normalises with the statistics of the
// global batch, all replicas' samples together. Forward reduces each
// channel's sum, sum of squares and the sample count over the replicas (one
// all-reduce of 2C + 1 doubles) before the mean and variance are formed;
// backward reduces sum(dy) and sum(dy xhat) (2C doubles) before dx is
// formed. The parameter gradients dw = sum(dy xhat), db = sum(dy) stay the
// replica's own (local sums), as in PyTorch: the data-parallel gradient
// average combines them like every other gradient. With replicas holding
// equal batches and a mean loss, training is that of one process holding
// the global batch.

#include <functional>

#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

/// Sums a tensor of doubles elementwise over the data-parallel replicas, in place
/// (an all-reduce; every replica calls it in the same order). Empty: no replicas.
/// The same type as nn::ReplicaSum, which engines hand to modules.
using ReplicaSum = std::function<void(Tensor<double>&)>;

namespace detail {
template <class T>
std::int64_t bn_channels(const Tensor<T>& x, const char* what) {
  PTRAIN_CHECK(x.dim() >= 2 && x.size(0) > 0, ShapeError, "[ptrain.batch_norm.shape] ", what, " ", x.shape(),
               " must be [N, C, ...] with N > 0");
  return x.size(1);
}
}  // namespace detail

/// What batch_norm saves for batch_norm_backward.
template <class T>
struct BatchNormSaved {
  Tensor<acc_t<T>> mean, invstd;  ///< [C]
  double count = 0;               ///< values per channel behind the statistics (all replicas)
  bool batch_stats = false;       ///< statistics of the batch (training), not the running ones
};

/// y = (x - mean) invstd w + b per channel of x [N, C, *]; w, b [C] may be
/// undefined (no affine). With batch_stats the statistics are the batch's
/// (summed over the replicas by sum_replicas when it is set) and running_mean /
/// running_var, when not null, move towards them by `momentum`; otherwise the
/// running statistics normalise (evaluation).
template <class T>
Tensor<T> batch_norm(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& b, Tensor<T>* running_mean,
                     Tensor<T>* running_var, bool batch_stats, double momentum, double eps, BatchNormSaved<T>& saved,
                     const ReplicaSum& sum_replicas = {}) {
  const std::int64_t n = x.size(0), c = detail::bn_channels(x, "input");
  const std::int64_t hw = x.numel() / (n * c);
  const Device dev = x.device();
  if (w.defined()) check_shape(w, {c}, "batch_norm weight");
  if (b.defined()) check_shape(b, {c}, "batch_norm bias");
  PTRAIN_CHECK((running_mean == nullptr) == (running_var == nullptr), ShapeError,
               "[ptrain.batch_norm.running] give both running statistics or neither");
  if (running_mean) {
    check_shape(*running_mean, {c}, "batch_norm running_mean");
    check_shape(*running_var, {c}, "batch_norm running_var");
    detail::check_devices("batch_norm", dev, *running_mean, *running_var);
  }
  PTRAIN_CHECK(batch_stats || running_mean, ShapeError,
               "[ptrain.batch_norm.running] evaluation without running statistics: construct the layer with "
               "track_running_stats, or stay in training mode");
  saved.mean = Tensor<acc_t<T>>::empty({c}, dev);
  saved.invstd = Tensor<acc_t<T>>::empty({c}, dev);
  saved.batch_stats = batch_stats;
  if (batch_stats) {
    auto sums = Tensor<double>::empty({2 * c + 1}, dev);  // sum, sum of squares, count
    PTRAIN_DISPATCH(dev, T, batch_norm_stats, n, c, hw, x.data(), sums.data());
    saved.count = static_cast<double>(n * hw);
    if (sum_replicas) {
      auto count = sums.view(2 * c, {1});
      count.copy_(Tensor<double>::full({1}, saved.count));
      sum_replicas(sums);
      saved.count = count.to(Device::cpu()).data()[0];
    }
    PTRAIN_CHECK(saved.count > 0, ShapeError, "[ptrain.batch_norm.shape] no values per channel in ", x.shape());
    PTRAIN_DISPATCH(dev, T, batch_norm_finalize, c, saved.count, sums.data(), eps, momentum, saved.mean.data(),
                    saved.invstd.data(), running_mean ? running_mean->data() : nullptr,
                    running_var ? running_var->data() : nullptr);
  } else {
    PTRAIN_DISPATCH(dev, T, batch_norm_eval_stats, c, running_mean->data(), running_var->data(), eps,
                    saved.mean.data(), saved.invstd.data());
  }
  if (w.defined()) detail::check_devices("batch_norm", dev, w);
  if (b.defined()) detail::check_devices("batch_norm", dev, b);
  auto y = Tensor<T>::empty(x.shape(), dev);
  PTRAIN_DISPATCH(dev, T, batch_norm_apply, n, c, hw, x.data(), saved.mean.data(), saved.invstd.data(),
                  w.defined() ? w.data() : nullptr, b.defined() ? b.data() : nullptr, y.data());
  return y;
}

/// Backward of batch_norm: returns dx; dw += sum(dy xhat), db += sum(dy) over
/// this replica's batch (dw, db null without affine). sum_replicas as in
/// forward (Note [Synchronised batch statistics]).
template <class T>
Tensor<T> batch_norm_backward(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& dy,
                              const BatchNormSaved<T>& saved, const Tensor<T>* dw, const Tensor<T>* db,
                              const ReplicaSum& sum_replicas = {}) {
  const std::int64_t n = x.size(0), c = detail::bn_channels(x, "input");
  const std::int64_t hw = x.numel() / (n * c);
  const Device dev = x.device();
  check_shape(dy, x.shape(), "batch_norm output gradient");
  check_shape(saved.mean, {c}, "batch_norm saved mean");
  detail::check_devices("batch_norm_backward", dev, dy, saved.mean, saved.invstd);
  auto sums = Tensor<double>::empty({2 * c}, dev);  // sum(dy), sum(dy xhat)
  PTRAIN_DISPATCH(dev, T, batch_norm_backward_reduce, n, c, hw, x.data(), dy.data(), saved.mean.data(),
                  saved.invstd.data(), sums.data());
  if (dw && (dw->defined() || db->defined())) {  // undefined: frozen (Note [Frozen parameters])
    auto gw = detail::grad_or_scratch(*dw, {c}, dev), gb = detail::grad_or_scratch(*db, {c}, dev);
    check_shape(gw, {c}, "batch_norm weight gradient");
    check_shape(gb, {c}, "batch_norm bias gradient");
    detail::check_devices("batch_norm_backward", dev, gw, gb);
    PTRAIN_DISPATCH(dev, T, batch_norm_param_grads, c, sums.data(), gw.data(), gb.data());
  }
  if (saved.batch_stats && sum_replicas) sum_replicas(sums);
  auto dx = Tensor<T>::empty(x.shape(), dev);
  PTRAIN_DISPATCH(dev, T, batch_norm_backward_apply, n, c, hw, x.data(), dy.data(), saved.mean.data(),
                  saved.invstd.data(), w.defined() ? w.data() : nullptr, saved.batch_stats ? sums.data() : nullptr,
                  saved.count, dx.data());
  return dx;
}

}  // namespace ptrain::ops
