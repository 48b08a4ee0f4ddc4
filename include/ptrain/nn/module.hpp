#pragma once
// Module, Parameter and Cache: explicit forward and backward passes.
//
// forward(x, cache) stores what backward needs in a Cache that the caller owns;
// backward(dy, cache) returns dx and accumulates (+=) parameter gradients. No
// global tape: several micro-batches can be in flight at once, each with its
// own cache (pipeline 1F1B), and a cache is freed as soon as its backward ran.
//
// Gradient-ready hook: as soon as a parameter's gradient for this backward pass
// is final, the module calls param.mark_grad_ready(), which runs the
// parameter's on_grad_ready callback. DDP uses it to start bucket all-reduces
// while backward goes on.
//
// Buffers are tensors a module keeps beside its parameters that training
// changes without gradients (BatchNorm's running statistics): named like
// parameters, moved by to(), saved and loaded by checkpoints, never handed to
// an optimizer nor all-reduced as gradients.

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/nn/batch_context.hpp"

namespace ptrain::nn {

/// A tensor and its gradient (same shape and device). A frozen parameter
/// (requires_grad false) has no gradient: `grad` is empty, modules skip its
/// gradient in backward, and optimizers, DDP and FSDP keep nothing for it
/// (Note [Frozen parameters] in nn/flat_parameters.hpp).
template <class T>
struct Parameter {
  Tensor<T> value;
  Tensor<T> grad;
  bool requires_grad = true;
  /// Called by mark_grad_ready(); set by wrappers such as DDP.
  std::function<void(Parameter&)> on_grad_ready;

  void mark_grad_ready() {
    if (on_grad_ready) on_grad_ready(*this);
  }
  /// Freezes (releases the gradient) or unfreezes (a zero gradient) this parameter.
  void set_requires_grad(bool on) {
    if (on && !requires_grad) grad = Tensor<T>::zeros(value.shape(), value.device());
    if (!on) grad = Tensor<T>();
    requires_grad = on;
  }
};

/// What one forward call saved for its backward call. Modules with children
/// give each child its own sub-cache (child(i)). The batch's context (token ids,
/// position ids) rides along and reaches every sub-cache (Note [Batch context]).
template <class T>
class Cache {
 public:
  std::vector<Tensor<T>> tensors;
  /// Statistics kept in the arithmetic type (float for bf16): LayerNorm's mean and rstd, a loss's log-sum-exp.
  std::vector<Tensor<acc_t<T>>> stats;
  std::vector<Tensor<std::int32_t>> indices;
  std::vector<std::uint64_t> values;

  /// Sub-cache i, created on first use (references stay valid).
  Cache& child(std::size_t i) {
    while (children_.size() <= i) children_.emplace_back();
    children_[i].context_ = context_;
    return children_[i];
  }
  void clear() {
    tensors.clear();
    stats.clear();
    indices.clear();
    values.clear();
    children_.clear();
    context_.reset();
  }
  /// The batch's context, or null; set by whoever feeds the batch (Note [Batch context]).
  const BatchContext* context() const { return context_.get(); }
  const std::shared_ptr<const BatchContext>& shared_context() const { return context_; }
  void set_context(std::shared_ptr<const BatchContext> context) { context_ = std::move(context); }
  bool empty() const {
    return tensors.empty() && stats.empty() && indices.empty() && values.empty() && children_.empty();
  }

 private:
  std::deque<Cache> children_;
  std::shared_ptr<const BatchContext> context_;
};

template <class T>
struct NamedParameter {
  std::string name;  ///< dotted path, e.g. "layers.0.weight"
  Parameter<T>* param;
};

template <class T>
struct NamedBuffer {
  std::string name;  ///< dotted path, e.g. "features.1.running_mean"
  Tensor<T>* buffer;
};

/// Sums a tensor of doubles elementwise over the data-parallel replicas, in place
/// (an all-reduce that every replica calls in the same order); what an engine
/// hands to modules that need batch-wide statistics (set_replica_sum()).
using ReplicaSum = std::function<void(Tensor<double>&)>;

/// Base of every layer and model.
template <class T>
class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  virtual Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) = 0;
  /// forward() from int32 token ids, for modules that look tokens up (embeddings,
  /// language models, wrappers of them): the form for every T, and the only one for
  /// bf16, which holds integers exactly only up to 256. Other modules refuse.
  virtual Tensor<T> forward_tokens(const Tensor<std::int32_t>& ids, Cache<T>& cache) {
    (void)ids;
    (void)cache;
    PTRAIN_THROW(ShapeError, "[ptrain.module.tokens] ", describe(), " does not take token ids; call forward()");
  }
  /// Returns dx for the forward call that filled `cache`; accumulates parameter gradients.
  virtual Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) = 0;
  /// Short description, e.g. "Linear(784, 256)".
  virtual std::string describe() const = 0;

  /// All parameters of this module and its children, depth-first in registration order.
  std::vector<NamedParameter<T>> named_parameters(const std::string& prefix = "") {
    std::vector<NamedParameter<T>> out;
    collect(prefix, out);
    return out;
  }
  /// All buffers of this module and its children, depth-first in registration order.
  std::vector<NamedBuffer<T>> named_buffers(const std::string& prefix = "") {
    std::vector<NamedBuffer<T>> out;
    collect_buffers(prefix, out);
    return out;
  }
  /// The parameters that train (requires_grad), in named_parameters() order.
  std::vector<NamedParameter<T>> named_trainable_parameters(const std::string& prefix = "") {
    std::vector<NamedParameter<T>> out;
    for (auto& p : named_parameters(prefix))
      if (p.param->requires_grad) out.push_back(p);
    return out;
  }
  std::int64_t num_parameters() {
    std::int64_t n = 0;
    for (auto& p : named_parameters()) n += p.param->value.numel();
    return n;
  }
  std::int64_t num_trainable_parameters() {
    std::int64_t n = 0;
    for (auto& p : named_trainable_parameters()) n += p.param->value.numel();
    return n;
  }
  /// Freezes (false) or unfreezes (true) every parameter of this module and its children.
  void requires_grad_(bool on) {
    for (auto& p : named_parameters()) p.param->set_requires_grad(on);
  }
  void zero_grad() {
    for (auto& p : named_trainable_parameters()) p.param->grad.zero_();
  }
  /// Training mode (dropout active) or evaluation mode, recursively.
  void train(bool on = true) {
    training_ = on;
    for (auto& c : children_) c.second->train(on);
  }
  bool training() const { return training_; }
  /// Moves parameters, gradients and buffers to a device, recursively.
  void to(Device device) {
    for (auto& p : named_parameters()) {
      p.param->value = p.param->value.to(device);
      if (p.param->requires_grad) p.param->grad = p.param->grad.to(device);
    }
    for (auto& b : named_buffers()) *b.buffer = b.buffer->to(device);
  }
  /// Hands every module of the tree that reduces statistics over the
  /// data-parallel replicas (SyncBatchNorm) the engine's all-reduce; an empty
  /// function detaches them (one replica). Engines call this (Note
  /// [Synchronised batch statistics] in ops/batch_norm.hpp).
  void set_replica_sum(const ReplicaSum& sum) {
    use_replica_sum(sum);
    for (auto& c : children_) c.second->set_replica_sum(sum);
  }
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const { return children_; }

  /// The random streams this module and its children draw from in forward (dropout
  /// masks), depth-first. Recompute sets their offsets back to replay a forward.
  std::vector<Generator*> random_streams() {
    std::vector<Generator*> out;
    collect_streams(out);
    return out;
  }

  /// Scalars this module and its children report (an MoE layer: its routing over the
  /// training forwards since its window was last reset, Note [MoE metrics window]),
  /// depth-first, each named by its module's path as parameters are (e.g. an MoE
  /// layer's "layers.1.block_sparse_moe.aux_loss"); empty for most models. The
  /// Trainer and gpt_char add them to their metrics records (and TensorBoard).
  std::vector<std::pair<std::string, double>> named_metrics(const std::string& prefix = "") {
    std::vector<std::pair<std::string, double>> out;
    collect_metrics(prefix, out);
    return out;
  }

  /// Parameters this module (or a child) uses without owning them, e.g. an LM
  /// head tied to the token embedding. Wrappers that place or shard parameters
  /// per module (FSDP units, pipeline stages) use this to keep them together.
  virtual std::vector<Parameter<T>*> borrowed_parameters() {
    std::vector<Parameter<T>*> out;
    for (auto& c : children_)
      for (auto* p : c.second->borrowed_parameters()) out.push_back(p);
    return out;
  }

 protected:
  /// Registers a parameter with a zero gradient of the same shape.
  Parameter<T>& register_parameter(const std::string& name, Tensor<T> value) {
    auto p = std::make_unique<Parameter<T>>();
    p->grad = Tensor<T>::zeros(value.shape(), value.device());
    p->value = std::move(value);
    params_.emplace_back(name, std::move(p));
    return *params_.back().second;
  }
  /// Registers a buffer (Module's header comment); the reference stays valid.
  Tensor<T>& register_buffer(const std::string& name, Tensor<T> value) {
    buffers_.emplace_back(name, std::make_unique<Tensor<T>>(std::move(value)));
    return *buffers_.back().second;
  }
  /// Registers a child; an empty name adds no level to its parameters' names (a wrapper).
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    children_.emplace_back(name, m);
    return m;
  }
  /// Replaces the child registered as `name` (its parameters take the new child's).
  template <class M>
  std::shared_ptr<M> replace_module(const std::string& name, std::shared_ptr<M> m) {
    for (auto& c : children_)
      if (c.first == name) {
        c.second = m;
        return m;
      }
    PTRAIN_THROW(Error, "[ptrain.module.child] no child named '", name, "' to replace");
  }
  /// This module's own random streams, not its children's (see random_streams()).
  virtual void own_random_streams(std::vector<Generator*>& out) { (void)out; }
  /// This module's own scalars for named_metrics(), each name prefixed by `prefix`.
  virtual void own_metrics(const std::string& prefix, std::vector<std::pair<std::string, double>>& out) {
    (void)prefix;
    (void)out;
  }
  /// This module's own use of set_replica_sum(); most modules ignore it.
  virtual void use_replica_sum(const ReplicaSum& sum) { (void)sum; }

 private:
  void collect(const std::string& prefix, std::vector<NamedParameter<T>>& out) {
    for (auto& [name, p] : params_) out.push_back({prefix + name, p.get()});
    for (auto& [name, child] : children_) child->collect(name.empty() ? prefix : prefix + name + ".", out);
  }
  void collect_buffers(const std::string& prefix, std::vector<NamedBuffer<T>>& out) {
    for (auto& [name, b] : buffers_) out.push_back({prefix + name, b.get()});
    for (auto& [name, child] : children_) child->collect_buffers(name.empty() ? prefix : prefix + name + ".", out);
  }
  void collect_metrics(const std::string& prefix, std::vector<std::pair<std::string, double>>& out) {
    own_metrics(prefix, out);
    for (auto& [name, child] : children_) child->collect_metrics(name.empty() ? prefix : prefix + name + ".", out);
  }
  void collect_streams(std::vector<Generator*>& out) {
    own_random_streams(out);
    for (auto& c : children_) c.second->collect_streams(out);
  }

  std::vector<std::pair<std::string, std::unique_ptr<Parameter<T>>>> params_;
  std::vector<std::pair<std::string, std::unique_ptr<Tensor<T>>>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

}  // namespace ptrain::nn
