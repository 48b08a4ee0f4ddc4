#pragma once
// UnitChain: named units run in order, backward in reverse; Sequential is a chain
// whose units are numbered.

#include <memory>
#include <string>
#include <vector>

#include "ptrain/nn/module.hpp"

namespace ptrain::nn {

// A chain of units, each with its own child cache: Sequential, GPT and a pipeline
// stage run their units through these.
namespace detail {
template <class T>
using Units = std::vector<std::shared_ptr<Module<T>>>;
template <class T>
Tensor<T> forward_units(const Units<T>& units, Tensor<T> h, Cache<T>& cache, std::size_t first = 0) {
  for (std::size_t i = first; i < units.size(); ++i) h = units[i]->forward(h, cache.child(i));
  return h;
}
/// Puts token ids into the cache's context for the layers below (Note [Batch
/// context]), keeping explicit position ids the caller set there. The ids are
/// shared, not copied: a layer that reads them on the host needs them there.
template <class T>
void set_batch_ids(Cache<T>& cache, const Tensor<std::int32_t>& ids) {
  BatchContext ctx = cache.context() ? *cache.context() : BatchContext{};
  ctx.ids = ids;
  cache.set_context(std::make_shared<const BatchContext>(std::move(ctx)));
}
/// The first unit looks the ids up (Module::forward_tokens); the rest run forward.
template <class T>
Tensor<T> forward_units_tokens(const Units<T>& units, const Tensor<std::int32_t>& ids, Cache<T>& cache) {
  PTRAIN_CHECK(!units.empty(), ShapeError, "[ptrain.module.tokens] a chain without units takes no token ids");
  set_batch_ids(cache, ids);
  return forward_units(units, units[0]->forward_tokens(ids, cache.child(0)), cache, 1);
}
/// The units' backward in reverse order; clears the cache.
template <class T>
Tensor<T> backward_units(const Units<T>& units, Tensor<T> g, Cache<T>& cache) {
  for (std::size_t i = units.size(); i-- > 0;) g = units[i]->backward(g, cache.child(i));
  cache.clear();
  return g;
}
}  // namespace detail

/// An ordered chain of named units, each a Module with its own child cache: the
/// base of Sequential, GPT, Llama and a pipeline stage. Forward runs the units in
/// order, backward in reverse, so the last unit's gradients are ready (and
/// announced) first. units() and unit_names() are what FSDP wraps and pipelines cut
/// between; a unit's name is the prefix of its parameters' names.
template <class T>
class UnitChain : public Module<T> {
 public:
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override { return detail::forward_units(units_, x, cache); }
  /// forward() whose first unit looks token ids up (an embedding): int32 ids [B, S].
  Tensor<T> forward_tokens(const Tensor<std::int32_t>& ids, Cache<T>& cache) override {
    return detail::forward_units_tokens(units_, ids, cache);
  }
  /// The units' backward in reverse; the first unit's dx (undefined after token ids).
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    return detail::backward_units(units_, dy, cache);
  }
  std::string describe() const override { return describe_units("UnitChain"); }

  /// The units in order.
  const std::vector<std::shared_ptr<Module<T>>>& units() const { return units_; }
  /// Parameter-name prefix of each unit.
  const std::vector<std::string>& unit_names() const { return unit_names_; }
  std::size_t size() const { return units_.size(); }
  Module<T>& unit(std::size_t i) { return *units_.at(i); }

 protected:
  /// Appends a unit; its parameters are named "<name>.<parameter>".
  void add_unit(const std::string& name, std::shared_ptr<Module<T>> unit) {
    units_.push_back(unit);
    unit_names_.push_back(name);
    this->register_module(name, std::move(unit));
  }
  std::string describe_units(const std::string& kind) const {
    std::string s = kind + "(";
    for (std::size_t i = 0; i < units_.size(); ++i) s += (i ? ", " : "") + units_[i]->describe();
    return s + ")";
  }

 private:
  std::vector<std::shared_ptr<Module<T>>> units_;
  std::vector<std::string> unit_names_;
};

template <class T>
class Sequential : public UnitChain<T> {
 public:
  Sequential() = default;

  /// Appends a module; its parameters are named "<index>.<name>".
  template <class M>
  std::shared_ptr<M> add(std::shared_ptr<M> m) {
    this->add_unit(std::to_string(this->size()), m);
    return m;
  }
  std::string describe() const override { return this->describe_units("Sequential"); }
  Module<T>& operator[](std::size_t i) { return this->unit(i); }
};

}  // namespace ptrain::nn
