#pragma once
// LayerNorm over the last dimension with learned scale and shift.

#include "ptrain/nn/module.hpp"
#include "ptrain/ops/init.hpp"
#include "ptrain/ops/norm.hpp"

namespace ptrain::nn {

template <class T>
class LayerNorm : public Module<T> {
 public:
  explicit LayerNorm(std::int64_t d, double eps = 1e-5) : d_(d), eps_(static_cast<acc_t<T>>(eps)) {
    PTRAIN_CHECK(d > 0 && eps >= 0, ShapeError, "[ptrain.layer_norm] width ", d, " must be positive and eps ", eps,
                 " non-negative");
    weight_ = &this->register_parameter("weight", Tensor<T>::full({d}, T(1)));
    bias_ = &this->register_parameter("bias", Tensor<T>::zeros({d}));
  }
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    PTRAIN_CHECK(x.dim() >= 1 && x.size(-1) == d_, ShapeError, "[ptrain.layer_norm] input ", x.shape(),
                 " does not end in ", d_);
    Tensor<acc_t<T>> mean, rstd;
    auto y = ops::layer_norm(x, weight_->value, bias_->value, eps_, mean, rstd);
    cache.tensors = {x};
    cache.stats = {mean, rstd};
    return y;
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 1 && cache.stats.size() == 2, Error,
                 "[ptrain.backward] LayerNorm::backward without a forward");
    auto dx = ops::layer_norm_backward(cache.tensors[0], cache.stats[0], cache.stats[1], weight_->value, dy,
                                       weight_->grad, bias_->grad);
    weight_->mark_grad_ready();
    bias_->mark_grad_ready();
    cache.clear();
    return dx;
  }
  std::string describe() const override { return "LayerNorm(" + std::to_string(d_) + ")"; }
  Parameter<T>& weight() { return *weight_; }
  Parameter<T>& bias() { return *bias_; }
  acc_t<T> eps() const { return eps_; }

 private:
  std::int64_t d_;
  acc_t<T> eps_;
  Parameter<T>* weight_;
  Parameter<T>* bias_;
};

}  // namespace ptrain::nn
