#pragma once
// Dataset: samples 0 .. size() - 1 that a training loop reads in batches of
// indices (from a DistributedSampler); TensorDataset holds them in memory.
//
//   TensorDataset<float> train(images, labels);   // images [N, 784], labels [N] (int32 class ids)
//   Batch<float> b = train.get({3, 14, 15});       // b.x [3, 784], b.targets [3]
//   TensorDataset<float> fit(x, y);               // x [N, 1], y [N, 1] (float values: regression)

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ptrain/core/tensor.hpp"
#include "ptrain/data/batches.hpp"
#include "ptrain/nn/targets.hpp"

namespace ptrain {

/// One batch: the input (features x, or int32 token ids) and the targets.
template <class T>
struct Batch {
  Tensor<T> x;                    ///< [B, ...] features, or undefined when the input is ids
  Tensor<std::int32_t> ids;       ///< [B, ...] token ids, or undefined
  nn::Targets<T> targets;         ///< [B, ...] class or next-token ids, or values of T (nn/targets.hpp)

  std::int64_t rows() const { return targets.size(0); }
  /// Rows [start, start + n): a micro-batch (a view, no copy).
  Batch narrow(std::int64_t start, std::int64_t n) const {
    return {x.defined() ? x.narrow(start, n) : Tensor<T>(), ids.defined() ? ids.narrow(start, n) : ids,
            targets.narrow(start, n)};
  }
};

/// Samples by index; get() is called with a rank's indices of one step and returns host
/// tensors. The Trainer's DataLoader calls get() from worker threads, several at once: it
/// must be safe to call concurrently and depend only on its indices (Note [Prefetching
/// loader] in data/loader.hpp); a data set that cannot be runs with loader_workers = 0.
template <class T>
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::int64_t size() const = 0;
  virtual Batch<T> get(const std::vector<std::int64_t>& indices) = 0;
  /// Whether some targets may be the ignore index -100 (masked prompts, padding): the
  /// Trainer then weighs each micro-batch by the targets that count (Note [Token-weighted
  /// loss] in train/trainer.hpp).
  virtual bool masks_targets() const { return false; }
};

/// A data set held in memory: row i of `inputs` (features) and of `targets`
/// (int32 class ids or values of T).
/// get() reads the tensors and allocates the batch: safe from several threads at once.
template <class T>
class TensorDataset : public Dataset<T> {
 public:
  TensorDataset(Tensor<T> inputs, nn::Targets<T> targets) : inputs_(std::move(inputs)), targets_(std::move(targets)) {
    PTRAIN_CHECK(inputs_.dim() >= 1 && targets_.defined() && targets_.dim() >= 1 &&
                     inputs_.size(0) == targets_.size(0),
                 ShapeError, "[ptrain.data.dataset] inputs ", inputs_.shape(), " and targets ",
                 targets_.defined() ? targets_.shape() : Shape{}, " need the same number of rows");
    if (targets_.is_ids()) {
      const Tensor<std::int32_t> ids = targets_.ids().to(Device::cpu());
      masks_ = std::find(ids.data(), ids.data() + ids.numel(), -100) != ids.data() + ids.numel();
    }
  }
  std::int64_t size() const override { return inputs_.size(0); }
  Batch<T> get(const std::vector<std::int64_t>& idx) override {
    Batch<T> b{gathered(inputs_, idx), {}, {}};
    if (targets_.is_ids()) b.targets = gathered(targets_.ids(), idx);
    else b.targets = gathered(targets_.values(), idx);
    return b;
  }
  /// True when a class-id target is -100.
  bool masks_targets() const override { return masks_; }

 private:
  template <class E>
  static Tensor<E> gathered(const Tensor<E>& src, const std::vector<std::int64_t>& idx) {
    Shape s = src.shape();
    s[0] = static_cast<std::int64_t>(idx.size());
    auto out = Tensor<E>::empty(s);
    gather_rows(src, idx.data(), s[0], out);
    return out;
  }
  Tensor<T> inputs_;
  nn::Targets<T> targets_;
  bool masks_ = false;
};

}  // namespace ptrain
