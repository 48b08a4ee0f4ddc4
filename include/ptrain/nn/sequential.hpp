#pragma once
// Sequential: children run in order; backward runs them in reverse, so the
// last layer's gradients are ready (and announced) first.

#include "ptrain/nn/module.hpp"

namespace ptrain::nn {

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

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    Tensor<T> h = x;
    for (std::size_t i = 0; i < layers_.size(); ++i) h = layers_[i]->forward(h, cache.child(i));
    return h;
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    Tensor<T> g = dy;
    for (std::size_t i = layers_.size(); i-- > 0;) g = layers_[i]->backward(g, cache.child(i));
    cache.clear();
    return g;
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
