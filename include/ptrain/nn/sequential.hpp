#pragma once
// Sequential: children run in order; backward runs them in reverse, so the
// last layer's gradients are ready (and announced) first.

#include <memory>
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
/// The first unit looks the ids up (Module::forward_tokens); the rest run forward.
template <class T>
Tensor<T> forward_units_tokens(const Units<T>& units, const Tensor<std::int32_t>& ids, Cache<T>& cache) {
  PTRAIN_CHECK(!units.empty(), ShapeError, "[ptrain.module.tokens] a chain without units takes no token ids");
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

template <class T>
class Sequential : public Module<T> {
 public:
  Sequential() = default;

  /// Appends a module; its parameters are named "<index>.<name>".
  template <class M>
  std::shared_ptr<M> add(std::shared_ptr<M> m) {
    layers_.push_back(m);
    return this->register_module(std::to_string(layers_.size() - 1), std::move(m));
  }

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override { return detail::forward_units(layers_, x, cache); }
  /// forward() whose first layer takes token ids (an Embedding, say).
  Tensor<T> forward_tokens(const Tensor<std::int32_t>& ids, Cache<T>& cache) override {
    return detail::forward_units_tokens(layers_, ids, cache);
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    return detail::backward_units(layers_, dy, cache);
  }
  std::string describe() const override {
    std::string s = "Sequential(";
    for (std::size_t i = 0; i < layers_.size(); ++i) s += (i ? ", " : "") + layers_[i]->describe();
    return s + ")";
  }
  std::size_t size() const { return layers_.size(); }
  /// The layers in order (what FSDP wraps and pipelines cut between, as GPT::units()).
  const std::vector<std::shared_ptr<Module<T>>>& units() const { return layers_; }
  /// Name prefix of each unit's parameters ("0", "1", ...), as GPT::unit_names().
  std::vector<std::string> unit_names() const {
    std::vector<std::string> names;
    for (std::size_t i = 0; i < layers_.size(); ++i) names.push_back(std::to_string(i));
    return names;
  }
  Module<T>& operator[](std::size_t i) { return *layers_.at(i); }

 private:
  std::vector<std::shared_ptr<Module<T>>> layers_;
};

}  // namespace ptrain::nn
