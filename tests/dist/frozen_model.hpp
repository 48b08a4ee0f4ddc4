#pragma once
// A small model with frozen parameters for the engines' tests (Note [Frozen
// parameters] in nn/flat_parameters.hpp): an MLP whose first layer and the last
// layer of its middle unit are frozen. Units: Linear (frozen), GELU,
// {Linear, GELU, Linear (frozen)}, GELU, Linear; so FSDP sees a wholly frozen
// group, a mixed one and a trainable one, and a pipeline cut after unit 1 a
// stage of frozen units.
#include <memory>

#include <ptrain/nn/activation.hpp>
#include <ptrain/nn/linear.hpp>
#include <ptrain/nn/sequential.hpp>

namespace ptrain::testing {

template <class T>
std::shared_ptr<nn::Sequential<T>> frozen_mlp(Generator& g, std::int64_t in = 10, std::int64_t classes = 4) {
  auto m = std::make_shared<nn::Sequential<T>>();
  m->add(std::make_shared<nn::Linear<T>>(in, 16, true, g))->requires_grad_(false);
  m->add(std::make_shared<nn::GELU<T>>());
  auto mid = std::make_shared<nn::Sequential<T>>();
  mid->add(std::make_shared<nn::Linear<T>>(16, 12, true, g));
  mid->add(std::make_shared<nn::GELU<T>>());
  mid->add(std::make_shared<nn::Linear<T>>(12, 12, true, g))->requires_grad_(false);
  m->add(mid);
  m->add(std::make_shared<nn::GELU<T>>());
  m->add(std::make_shared<nn::Linear<T>>(12, classes, true, g));
  return m;
}

}  // namespace ptrain::testing
