#pragma once
// RMSNorm over the last dimension with a learned scale (Llama's LlamaRMSNorm):
//   y = x / sqrt(mean(x^2) + eps) * weight
// No mean subtraction and no bias. Parameter "weight" [d], initialised to ones.
// CPU and CUDA, float, double and bf16 (ops::rms_norm).

#include <sstream>

#include "ptrain/nn/module.hpp"
#include "ptrain/ops/norm.hpp"

namespace ptrain::nn {

template <class T>
class RMSNorm : public Module<T> {
 public:
  /// eps defaults to LlamaRMSNorm's 1e-6; Hugging Face configs give it as rms_norm_eps.
  explicit RMSNorm(std::int64_t d, double eps = 1e-6) : d_(d), eps_(eps) {
    PTRAIN_CHECK(d > 0 && eps >= 0, ShapeError, "[ptrain.rms_norm] width ", d, " must be positive and eps ", eps,
                 " non-negative");
    weight_ = &this->register_parameter("weight", Tensor<T>::full({d}, T(1)));
  }
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    PTRAIN_CHECK(x.dim() >= 1 && x.size(-1) == d_, ShapeError, "[ptrain.rms_norm] input ", x.shape(),
                 " does not end in ", d_);
    Tensor<acc_t<T>> rstd;
    auto y = ops::rms_norm(x, weight_->value, static_cast<acc_t<T>>(eps_), rstd);
    cache.tensors = {x};
    cache.stats = {rstd};
    return y;
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 1 && cache.stats.size() == 1, Error,
                 "[ptrain.backward] RMSNorm::backward without a forward");
    auto dx = ops::rms_norm_backward(cache.tensors[0], cache.stats[0], weight_->value, dy, weight_->grad);
    weight_->mark_grad_ready();
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    std::ostringstream s;
    s << "RMSNorm(" << d_ << ", eps=" << eps_ << ")";
    return s.str();
  }
  Parameter<T>& weight() { return *weight_; }
  double eps() const { return eps_; }

 private:
  std::int64_t d_;
  double eps_;
  Parameter<T>* weight_;
};

}  // namespace ptrain::nn
