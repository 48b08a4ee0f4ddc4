#pragma once
// Parameter-free activations.

#include "ptrain/nn/module.hpp"
#include "ptrain/ops/activation.hpp"

namespace ptrain::nn {

template <class T>
class ReLU : public Module<T> {
 public:
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    cache.tensors = {x};
    return ops::relu(x);
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    auto dx = ops::relu_backward(cache.tensors.at(0), dy);
    cache.clear();
    return dx;
  }
  std::string describe() const override { return "ReLU()"; }
};

/// GELU, tanh approximation.
template <class T>
class GELU : public Module<T> {
 public:
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    cache.tensors = {x};
    return ops::gelu(x);
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    auto dx = ops::gelu_backward(cache.tensors.at(0), dy);
    cache.clear();
    return dx;
  }
  std::string describe() const override { return "GELU(tanh)"; }
};

/// Inverted dropout; identity in evaluation mode. Masks come from a
/// counter-based stream (seed, position), so a run is reproducible and a
/// checkpoint restores the stream with one number (position()).
template <class T>
class Dropout : public Module<T> {
 public:
  explicit Dropout(double p, std::uint64_t seed = 0) : p_(p), gen_(seed) {
    PTRAIN_CHECK(p >= 0.0 && p < 1.0, Error, "[ptrain.dropout] probability ", p, " must be in [0, 1)");
  }
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    if (!this->training() || p_ == 0.0) {
      cache.values = {0};
      return x;
    }
    const std::uint64_t offset = gen_.reserve(static_cast<std::uint64_t>(x.numel()));
    cache.values = {1, offset};
    return ops::dropout(x, p_, gen_.seed(), offset);
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(!cache.values.empty(), Error, "[ptrain.backward] Dropout::backward without a forward in this cache");
    Tensor<T> dx = cache.values[0] ? ops::dropout(dy, p_, gen_.seed(), cache.values[1]) : dy;
    cache.clear();
    return dx;
  }
  std::string describe() const override { return "Dropout(" + std::to_string(p_) + ")"; }
  Generator& generator() { return gen_; }

 protected:
  void own_random_streams(std::vector<Generator*>& out) override { out.push_back(&gen_); }

 private:
  double p_;
  Generator gen_;
};

}  // namespace ptrain::nn
