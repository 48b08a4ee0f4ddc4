#pragma once
// Dataset: samples 0 .. size() - 1 that a training loop reads in batches of
// indices (from a DistributedSampler); TensorDataset holds them in memory.
//
//   TensorDataset<float> train(images, labels);   // images [N, 784], labels [N]
//   Batch<float> b = train.get({3, 14, 15});       // b.x [3, 784], b.targets [3]

#include <cstdint>
#include <vector>

#include "ptrain/core/tensor.hpp"
#include "ptrain/data/batches.hpp"

namespace ptrain {

/// One batch: the input (features x, or int32 token ids) and the targets.
template <class T>
struct Batch {
  Tensor<T> x;                    ///< [B, ...] features, or undefined when the input is ids
  Tensor<std::int32_t> ids;       ///< [B, ...] token ids, or undefined
  Tensor<std::int32_t> targets;   ///< [B, ...] class or next-token ids

  std::int64_t rows() const { return targets.size(0); }
  /// Rows [start, start + n): a micro-batch (a view, no copy).
  Batch narrow(std::int64_t start, std::int64_t n) const {
    return {x.defined() ? x.narrow(start, n) : Tensor<T>(), ids.defined() ? ids.narrow(start, n) : ids,
            targets.narrow(start, n)};
  }
};

/// Samples by index; get() is called with a rank's indices of one step.
template <class T>
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::int64_t size() const = 0;
  virtual Batch<T> get(const std::vector<std::int64_t>& indices) = 0;
};

/// A data set held in memory: row i of `inputs` (features) and of `targets`.
template <class T>
class TensorDataset : public Dataset<T> {
 public:
  TensorDataset(Tensor<T> inputs, Tensor<std::int32_t> targets)
      : inputs_(std::move(inputs)), targets_(std::move(targets)) {
    PTRAIN_CHECK(inputs_.dim() >= 1 && targets_.dim() >= 1 && inputs_.size(0) == targets_.size(0), ShapeError,
                 "[ptrain.data.dataset] inputs ", inputs_.shape(), " and targets ", targets_.shape(),
                 " need the same number of rows");
  }
  std::int64_t size() const override { return inputs_.size(0); }
  Batch<T> get(const std::vector<std::int64_t>& idx) override {
    const auto n = static_cast<std::int64_t>(idx.size());
    Batch<T> b{Tensor<T>::empty(with_rows(inputs_.shape(), n)), {},
               Tensor<std::int32_t>::empty(with_rows(targets_.shape(), n))};
    gather_rows(inputs_, idx.data(), n, b.x);
    gather_rows(targets_, idx.data(), n, b.targets);
    return b;
  }

 private:
  static Shape with_rows(Shape s, std::int64_t rows) {
    s[0] = rows;
    return s;
  }
  Tensor<T> inputs_;
  Tensor<std::int32_t> targets_;
};

}  // namespace ptrain
