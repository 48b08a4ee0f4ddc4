#pragma once
// Parameter-free activations: ReLU, GELU, Tanh, Sigmoid, SiLU, LeakyReLU,
// Softmax and LogSoftmax over the last dimension, Identity; and Dropout.

#include <sstream>

#include "ptrain/nn/module.hpp"
#include "ptrain/ops/activation.hpp"
#include "ptrain/ops/loss.hpp"

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

namespace detail {
/// An activation whose backward needs only the forward's input or only its output:
/// apply(x) gives y, apply_backward(saved, dy) gives dx; the cache keeps y when
/// SaveOutput, else x.
template <class T, bool SaveOutput>
class SavingActivation : public Module<T> {
 public:
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    Tensor<T> y = apply(x);
    cache.tensors = {SaveOutput ? y : x};
    return y;
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 1, Error, "[ptrain.backward] ", this->describe(),
                 "::backward without a forward in this cache");
    auto dx = apply_backward(cache.tensors[0], dy);
    cache.clear();
    return dx;
  }

 protected:
  virtual Tensor<T> apply(const Tensor<T>& x) const = 0;
  virtual Tensor<T> apply_backward(const Tensor<T>& saved, const Tensor<T>& dy) const = 0;
};
}  // namespace detail

/// tanh(x) (torch.nn.Tanh).
template <class T>
class Tanh : public detail::SavingActivation<T, true> {
 public:
  std::string describe() const override { return "Tanh()"; }

 protected:
  Tensor<T> apply(const Tensor<T>& x) const override { return ops::tanh(x); }
  Tensor<T> apply_backward(const Tensor<T>& y, const Tensor<T>& dy) const override {
    return ops::tanh_backward(y, dy);
  }
};

/// 1 / (1 + exp(-x)) (torch.nn.Sigmoid).
template <class T>
class Sigmoid : public detail::SavingActivation<T, true> {
 public:
  std::string describe() const override { return "Sigmoid()"; }

 protected:
  Tensor<T> apply(const Tensor<T>& x) const override { return ops::sigmoid(x); }
  Tensor<T> apply_backward(const Tensor<T>& y, const Tensor<T>& dy) const override {
    return ops::sigmoid_backward(y, dy);
  }
};

/// x * sigmoid(x) (torch.nn.SiLU).
template <class T>
class SiLU : public detail::SavingActivation<T, false> {
 public:
  std::string describe() const override { return "SiLU()"; }

 protected:
  Tensor<T> apply(const Tensor<T>& x) const override { return ops::silu(x); }
  Tensor<T> apply_backward(const Tensor<T>& x, const Tensor<T>& dy) const override {
    return ops::silu_backward(x, dy);
  }
};

/// x for x > 0, negative_slope * x otherwise (torch.nn.LeakyReLU).
template <class T>
class LeakyReLU : public detail::SavingActivation<T, false> {
 public:
  explicit LeakyReLU(double negative_slope = 0.01) : slope_(negative_slope) {}
  std::string describe() const override {
    std::ostringstream s;
    s << "LeakyReLU(negative_slope=" << slope_ << ")";
    return s.str();
  }
  double negative_slope() const { return slope_; }

 protected:
  Tensor<T> apply(const Tensor<T>& x) const override { return ops::leaky_relu(x, slope_); }
  Tensor<T> apply_backward(const Tensor<T>& x, const Tensor<T>& dy) const override {
    return ops::leaky_relu_backward(x, dy, slope_);
  }

 private:
  double slope_;
};

/// Softmax over the last dimension (torch.nn.Softmax(dim=-1)).
template <class T>
class Softmax : public detail::SavingActivation<T, true> {
 public:
  std::string describe() const override { return "Softmax(dim=-1)"; }

 protected:
  Tensor<T> apply(const Tensor<T>& x) const override { return ops::softmax(x); }
  Tensor<T> apply_backward(const Tensor<T>& y, const Tensor<T>& dy) const override {
    return ops::softmax_backward(y, dy);
  }
};

/// Log-softmax over the last dimension (torch.nn.LogSoftmax(dim=-1)); pairs with NLLLoss.
template <class T>
class LogSoftmax : public detail::SavingActivation<T, true> {
 public:
  std::string describe() const override { return "LogSoftmax(dim=-1)"; }

 protected:
  Tensor<T> apply(const Tensor<T>& x) const override { return ops::log_softmax(x); }
  Tensor<T> apply_backward(const Tensor<T>& y, const Tensor<T>& dy) const override {
    return ops::log_softmax_backward(y, dy);
  }
};

/// y = x, dx = dy (torch.nn.Identity): a placeholder where a model takes a module.
template <class T>
class Identity : public Module<T> {
 public:
  Tensor<T> forward(const Tensor<T>& x, Cache<T>&) override { return x; }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>&) override { return dy; }
  std::string describe() const override { return "Identity()"; }
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
