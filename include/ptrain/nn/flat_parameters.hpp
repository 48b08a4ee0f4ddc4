#pragma once
// Flat parameter storage: every parameter of a module tree becomes a view into
// one values buffer, and every gradient a view into one grads buffer, at the
// same offsets. The optimizer updates the whole model in one pass, DDP buckets
// are ranges of the grads buffer and FSDP shards ranges of the values buffer.
//
// Each parameter starts at a multiple of `align` elements (64 bytes for float)
// so that vector loads in kernels stay aligned; the gaps hold zeros in both
// buffers and stay zero under SGD and AdamW.
//
// Note [Frozen parameters]
// A frozen parameter (Parameter::requires_grad false: a LoRA base weight, a
// frozen embedding) has no gradient and no optimizer state. FlatParameters
// packs the trainable parameters into values() and grads(), which optimizers,
// DDP buckets and FSDP's gradient shards cover, and the frozen ones into a
// third buffer, frozen_values(), with no gradient beside it; entries() names
// the trainable ranges and frozen_entries() the frozen ones (their offsets
// index frozen_values()). Whoever saves or loads the whole model (checkpoints,
// broadcasts of the initial weights) visits both lists; whoever touches
// gradients or optimizer state visits entries() only.

#include <string>
#include <vector>

#include "ptrain/nn/module.hpp"

namespace ptrain::nn {

template <class T>
struct FlatEntry {
  std::string name;
  std::int64_t offset;  ///< first element in the flat buffers
  Shape shape;
  Parameter<T>* param;  ///< the module's parameter bound to this range; null for a piece of one (FSDP shard)
  std::int64_t numel() const { return shape.numel(); }
};

/// Throws unless every entry's parameter is still the view into `values` and `grads` it was bound to,
/// and every frozen entry's the view into `frozen_values`. A later module.to() or an assignment to a
/// parameter's value replaces the view with a tensor an optimizer (or a checkpoint) of the flat buffers
/// never sees; optimizers built on FlatParameters check this every step.
template <class T>
void check_bound(const std::vector<FlatEntry<T>>& entries, const Tensor<T>& values, const Tensor<T>& grads,
                 const std::vector<FlatEntry<T>>& frozen = {}, const Tensor<T>& frozen_values = {}) {
  auto check = [](const FlatEntry<T>& e, bool bound) {
    PTRAIN_CHECK(!e.param || bound, Error, "[ptrain.flat.unbound] parameter ", e.name,
                 " is no longer a view into the flat parameter buffers, so the optimizer would update a copy "
                 "the model does not use (module.to() or an assignment after FlatParameters was built); move "
                 "the module before building FlatParameters, and change values in place with copy_()");
  };
  for (const auto& e : entries)
    check(e, e.param && e.param->value.data() == values.data() + e.offset &&
                 e.param->grad.data() == grads.data() + e.offset);
  for (const auto& e : frozen) check(e, e.param && e.param->value.data() == frozen_values.data() + e.offset);
}

template <class T>
class FlatParameters {
 public:
  /// Packs the parameters of `module` (in named_parameters() order) and rebinds
  /// them to views. Values are copied in; gradients start at zero. Frozen
  /// parameters go to frozen_values() (Note [Frozen parameters]).
  explicit FlatParameters(Module<T>& module, std::int64_t align = 16) {
    auto params = module.named_parameters();
    PTRAIN_CHECK(!params.empty(), Error, "[ptrain.flat] module ", module.describe(), " has no parameters");
    const Device device = params.front().param->value.device();
    std::int64_t total = 0, frozen_total = 0;
    for (auto& p : params) {
      PTRAIN_CHECK(p.param->value.device() == device, Error, "[ptrain.flat] parameter ", p.name, " is on ",
                   p.param->value.device(), " but the first parameter is on ", device, "; move the module with to()");
      std::int64_t& end = p.param->requires_grad ? total : frozen_total;
      (p.param->requires_grad ? entries_ : frozen_entries_).push_back({p.name, end, p.param->value.shape(), p.param});
      end += (p.param->value.numel() + align - 1) / align * align;
    }
    buffers_ = module.named_buffers();
    values_ = Tensor<T>::zeros({total}, device);
    grads_ = Tensor<T>::zeros({total}, device);
    frozen_values_ = Tensor<T>::zeros({frozen_total}, device);
    for (auto& e : entries_) {
      auto v = values_.view(e.offset, e.shape);
      v.copy_(e.param->value);
      e.param->value = v;
      e.param->grad = grads_.view(e.offset, e.shape);
    }
    for (auto& e : frozen_entries_) {
      auto v = frozen_values_.view(e.offset, e.shape);
      v.copy_(e.param->value);
      e.param->value = v;
    }
  }

  /// Flat buffers owned elsewhere, e.g. an FSDP rank's shard: `entries` name the
  /// pieces of parameters they hold (param null: no module parameter is bound to them).
  FlatParameters(Tensor<T> values, Tensor<T> grads, std::vector<FlatEntry<T>> entries)
      : values_(std::move(values)), grads_(std::move(grads)), entries_(std::move(entries)) {
    PTRAIN_CHECK(values_.numel() == grads_.numel(), ShapeError, "[ptrain.flat] values ", values_.shape(),
                 " and grads ", grads_.shape(), " differ");
  }
  FlatParameters(const FlatParameters&) = delete;
  FlatParameters& operator=(const FlatParameters&) = delete;

  Tensor<T>& values() { return values_; }
  Tensor<T>& grads() { return grads_; }
  /// The trainable parameters' ranges of values() and grads().
  const std::vector<FlatEntry<T>>& entries() const { return entries_; }
  /// The frozen parameters' ranges of frozen_values() (Note [Frozen parameters]).
  const std::vector<FlatEntry<T>>& frozen_entries() const { return frozen_entries_; }
  Tensor<T>& frozen_values() { return frozen_values_; }
  /// Every parameter, trainable then frozen: what a checkpoint saves.
  std::vector<FlatEntry<T>> all_entries() const {
    auto all = entries_;
    all.insert(all.end(), frozen_entries_.begin(), frozen_entries_.end());
    return all;
  }
  std::int64_t numel() const { return values_.numel(); }
  /// The module's buffers (BatchNorm's running statistics): not packed, not
  /// optimised, but saved and loaded by checkpoints beside the parameters.
  const std::vector<NamedBuffer<T>>& buffers() const { return buffers_; }
  void set_buffers(std::vector<NamedBuffer<T>> buffers) { buffers_ = std::move(buffers); }
  void zero_grad() { grads_.zero_(); }

 private:
  Tensor<T> values_, grads_, frozen_values_;
  std::vector<FlatEntry<T>> entries_, frozen_entries_;
  std::vector<NamedBuffer<T>> buffers_;
};

}  // namespace ptrain::nn
