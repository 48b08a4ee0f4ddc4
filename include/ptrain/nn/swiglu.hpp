#pragma once
// SwiGLU feed-forward (Llama's LlamaMLP):
//
//   x [..., C] -> down_proj(silu(gate_proj(x)) * up_proj(x)) [..., C]
//
// gate_proj and up_proj are C -> hidden, down_proj hidden -> C, without biases by
// default (Llama, Mistral, Qwen2); bias = true gives all three a bias. Parameter
// names follow Hugging Face: "gate_proj.weight", "up_proj.weight",
// "down_proj.weight". CPU and CUDA (ops::swiglu).

#include <string>

#include "ptrain/nn/linear.hpp"
#include "ptrain/ops/activation.hpp"

namespace ptrain::nn {

template <class T>
class SwiGLU : public Module<T> {
 public:
  SwiGLU(std::int64_t n_embd, std::int64_t hidden, bool bias = false, Generator& gen = default_generator())
      : n_embd_(n_embd), hidden_(hidden) {
    PTRAIN_CHECK(n_embd > 0 && hidden > 0, ShapeError, "[ptrain.swiglu] widths must be positive, got n_embd ", n_embd,
                 " and hidden ", hidden);
    gate_ = this->register_module("gate_proj", std::make_shared<Linear<T>>(n_embd, hidden, bias, gen));
    up_ = this->register_module("up_proj", std::make_shared<Linear<T>>(n_embd, hidden, bias, gen));
    down_ = this->register_module("down_proj", std::make_shared<Linear<T>>(hidden, n_embd, bias, gen));
  }
  /// Over given projections: gate and up [n_embd -> hidden], down [hidden -> n_embd']
  /// (a tensor-parallel rank's share of the hidden width: parallel/tp_llama.hpp).
  SwiGLU(std::int64_t n_embd, std::int64_t hidden, std::shared_ptr<Linear<T>> gate, std::shared_ptr<Linear<T>> up,
         std::shared_ptr<Linear<T>> down)
      : n_embd_(n_embd), hidden_(hidden) {
    gate_ = this->register_module("gate_proj", std::move(gate));
    up_ = this->register_module("up_proj", std::move(up));
    down_ = this->register_module("down_proj", std::move(down));
  }

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    PTRAIN_CHECK(x.dim() >= 1 && x.size(-1) == n_embd_, ShapeError, "[ptrain.swiglu] input ", x.shape(),
                 " does not end in ", n_embd_);
    auto gate = gate_->forward(x, cache.child(0));
    auto up = up_->forward(x, cache.child(1));
    cache.tensors = {gate, up};
    return down_->forward(ops::swiglu(gate, up), cache.child(2));
  }

  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 2, Error, "[ptrain.backward] SwiGLU::backward without a forward");
    auto dh = down_->backward(dy, cache.child(2));
    Tensor<T> dgate, dup;
    ops::swiglu_backward(cache.tensors[0], cache.tensors[1], dh, dgate, dup);
    auto dx = gate_->backward(dgate, cache.child(0));
    ops::axpy_(acc_t<T>(1), up_->backward(dup, cache.child(1)), dx);
    cache.clear();
    return dx;
  }

  std::string describe() const override {
    return "SwiGLU(" + std::to_string(n_embd_) + ", hidden=" + std::to_string(hidden_) +
           (gate_->bias() ? ", bias)" : ")");
  }
  Linear<T>& gate_proj() { return *gate_; }
  Linear<T>& up_proj() { return *up_; }
  Linear<T>& down_proj() { return *down_; }

 private:
  std::int64_t n_embd_, hidden_;
  std::shared_ptr<Linear<T>> gate_, up_, down_;
};

}  // namespace ptrain::nn
