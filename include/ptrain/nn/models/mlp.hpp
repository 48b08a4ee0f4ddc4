#pragma once
// Multi-layer perceptron: Linear -> activation -> ... -> Linear.

#include <vector>

#include "ptrain/nn/activation.hpp"
#include "ptrain/nn/linear.hpp"
#include "ptrain/nn/sequential.hpp"

namespace ptrain::nn {

enum class Activation { ReLU, GELU, Tanh, SiLU };

/// MLP(784, {256, 128}, 10): Linear(784,256) ReLU Linear(256,128) ReLU Linear(128,10).
/// Parameter names follow torch.nn.Sequential: "0.weight", "0.bias", "2.weight", ...
template <class T>
class MLP : public Sequential<T> {
 public:
  MLP(std::int64_t in, const std::vector<std::int64_t>& hidden, std::int64_t out,
      Activation act = Activation::ReLU, Generator& gen = default_generator()) {
    std::int64_t width = in;
    for (std::int64_t h : hidden) {
      this->add(std::make_shared<Linear<T>>(width, h, true, gen));
      switch (act) {
        case Activation::ReLU: this->add(std::make_shared<ReLU<T>>()); break;
        case Activation::GELU: this->add(std::make_shared<GELU<T>>()); break;
        case Activation::Tanh: this->add(std::make_shared<Tanh<T>>()); break;
        case Activation::SiLU: this->add(std::make_shared<SiLU<T>>()); break;
      }
      width = h;
    }
    this->add(std::make_shared<Linear<T>>(width, out, true, gen));
  }

  /// When the input is data (the first model of a program, not a pipeline
  /// stage), its gradient is not needed: backward then skips one GEMM and
  /// returns an undefined tensor.
  void set_need_input_grad(bool need) { static_cast<Linear<T>&>((*this)[0]).set_need_input_grad(need); }
};

}  // namespace ptrain::nn
