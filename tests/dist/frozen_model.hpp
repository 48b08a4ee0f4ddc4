#pragma once
// A small model with frozen parameters for the engines' tests (Note [Frozen
// parameters] in nn/flat_parameters.hpp): an MLP whose first layer and the last
// layer of its middle unit are frozen. Units: Linear (frozen), GELU,
// {Linear, GELU, Linear (frozen)}, GELU, Linear; so FSDP sees a wholly frozen
// group, a mixed one and a trainable one.
#include <memory>
#include <string>

#include <ptrain/nn/activation.hpp>
#include <ptrain/nn/linear.hpp>
#include <ptrain/nn/sequential.hpp>

namespace ptrain::testing {

/// nn::Linear whose backward, once it is frozen (weight and bias), only returns dx.
template <class T>
class FreezableLinear : public nn::Linear<T> {
 public:
  using nn::Linear<T>::Linear;
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    if (this->weight().requires_grad) return nn::Linear<T>::backward(dy, cache);
    auto dx = ops::matmul(dy, this->weight().value);
    cache.clear();
    return dx;
  }
};

template <class T>
std::shared_ptr<nn::Sequential<T>> frozen_mlp(Generator& g, std::int64_t in = 10, std::int64_t classes = 4) {
  auto m = std::make_shared<nn::Sequential<T>>();
  m->add(std::make_shared<FreezableLinear<T>>(in, 16, true, g))->requires_grad_(false);
  m->add(std::make_shared<nn::GELU<T>>());
  auto mid = std::make_shared<nn::Sequential<T>>();
  mid->add(std::make_shared<FreezableLinear<T>>(16, 12, true, g));
  mid->add(std::make_shared<nn::GELU<T>>());
  mid->add(std::make_shared<FreezableLinear<T>>(12, 12, true, g))->requires_grad_(false);
  m->add(mid);
  m->add(std::make_shared<nn::GELU<T>>());
  m->add(std::make_shared<FreezableLinear<T>>(12, classes, true, g));
  return m;
}

}  // namespace ptrain::testing
