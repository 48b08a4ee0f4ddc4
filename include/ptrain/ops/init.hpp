#pragma once
// Parameter initialisation. Values are drawn on the host from the counter-based
// generator and copied to the tensor's device, so a model initialised with the
// same seed is identical on every rank and device.

#include <cmath>

#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"

namespace ptrain::ops {

/// Fills t with U[lo, hi).
template <class T>
void uniform_(Tensor<T>& t, double lo, double hi, Generator& gen) {
  auto host = Tensor<T>::empty(t.shape());
  const std::uint64_t start = gen.reserve(static_cast<std::uint64_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i)
    host.data()[i] = static_cast<T>(lo + (hi - lo) * random_uniform(gen.seed(), start + static_cast<std::uint64_t>(i)));
  t.copy_(host);
}

/// Fills t with N(mean, std^2).
template <class T>
void normal_(Tensor<T>& t, double mean, double std, Generator& gen) {
  auto host = Tensor<T>::empty(t.shape());
  const std::uint64_t start = gen.reserve(static_cast<std::uint64_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i)
    host.data()[i] = static_cast<T>(mean + std * random_normal(gen.seed(), start + static_cast<std::uint64_t>(i)));
  t.copy_(host);
}

/// Fills t with a constant.
template <class T>
void fill_(Tensor<T>& t, T value) {
  t.copy_(Tensor<T>::full(t.shape(), value));
}

}  // namespace ptrain::ops
