#pragma once
// Linear: y = x W^T + b over the last dimension.

#include <cmath>

#include "ptrain/nn/module.hpp"
#include "ptrain/ops/init.hpp"
#include "ptrain/ops/linear.hpp"

namespace ptrain::nn {

namespace detail {
/// A tensor of `shape` ~ U(-1/sqrt(in), 1/sqrt(in)): torch.nn.Linear's init for fan-in `in`.
template <class T>
Tensor<T> fan_in_uniform(const Shape& shape, std::int64_t in, Generator& gen) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  auto t = Tensor<T>::empty(shape);
  ops::uniform_(t, -bound, bound, gen);
  return t;
}
}  // namespace detail

/// x [..., in] -> y [..., out]; weight [out, in], bias [out] (PyTorch's layout and init).
template <class T>
class Linear : public Module<T> {
 public:
  /// Weights and bias ~ U(-1/sqrt(in), 1/sqrt(in)), as torch.nn.Linear.
  Linear(std::int64_t in, std::int64_t out, bool bias = true, Generator& gen = default_generator())
      : in_(in), out_(out) {
    PTRAIN_CHECK(in > 0 && out > 0, ShapeError, "[ptrain.linear] features must be positive, got ", in, " -> ", out);
    weight_ = &this->register_parameter("weight", detail::fan_in_uniform<T>({out, in}, in, gen));
    if (bias) bias_ = &this->register_parameter("bias", detail::fan_in_uniform<T>({out}, in, gen));
  }

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    cache.tensors = {x};
    auto y = ops::linear(x, weight_->value, bias_ ? bias_->value : Tensor<T>());
    if (adapter_)
      if (auto delta = adapter_->forward(x, cache.child(0)); delta.defined()) ops::axpy_(acc_t<T>(1), delta, y);
    return y;
  }

  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(!cache.tensors.empty(), Error, "[ptrain.backward] Linear::backward without a forward in this cache");
    auto dx = ops::linear_backward(cache.tensors[0], weight_->value, dy, weight_->grad, bias_ ? &bias_->grad : nullptr,
                                   need_input_grad_);
    weight_->mark_grad_ready();
    if (bias_) bias_->mark_grad_ready();
    if (adapter_)
      if (auto ddx = adapter_->backward(dy, cache.child(0)); ddx.defined() && need_input_grad_)
        ops::axpy_(acc_t<T>(1), ddx, dx);
    cache.clear();
    return dx;
  }

  /// Adds `adapter`'s output to this layer's: y = x W^T + b + adapter(x), and its dx to
  /// dx (a LoRA update, nn/lora.hpp). It is registered as a child without a name, so its
  /// parameters are named "<this layer>.<theirs>". An adapter whose forward returns an
  /// undefined tensor adds nothing (a LoRA merged into the weight); its backward then
  /// returns an undefined tensor too. Set once, before the model is packed for training.
  void set_adapter(std::shared_ptr<Module<T>> adapter) {
    PTRAIN_CHECK(!adapter_ && adapter, Error, "[ptrain.linear.adapter] ", describe(),
                 adapter_ ? " already has an adapter" : ": the adapter is null");
    adapter_ = this->register_module("", std::move(adapter));
  }
  /// The adapter, or null.
  Module<T>* adapter() const { return adapter_.get(); }

  /// The first layer of a model needs no dx; skipping it saves one GEMM.
  void set_need_input_grad(bool need) { need_input_grad_ = need; }
  bool need_input_grad() const { return need_input_grad_; }

  std::string describe() const override {
    return "Linear(" + std::to_string(in_) + ", " + std::to_string(out_) + (bias_ ? ")" : ", bias=false)");
  }
  Parameter<T>& weight() { return *weight_; }
  Parameter<T>* bias() { return bias_; }

 private:
  std::int64_t in_, out_;
  Parameter<T>* weight_ = nullptr;
  Parameter<T>* bias_ = nullptr;
  bool need_input_grad_ = true;
  std::shared_ptr<Module<T>> adapter_;
};

}  // namespace ptrain::nn
