#pragma once
// AdamW: Adam with decoupled weight decay, torch.optim.AdamW's semantics and
// defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01).

#include "ptrain/ops/dispatch.hpp"
#include "ptrain/optim/optimizer.hpp"

namespace ptrain::optim {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

template <class T>
class AdamW : public Optimizer<T> {
 public:
  AdamW(nn::FlatParameters<T>& params, AdamWOptions opt, DecayFilter decay = {})
      : AdamW(params.values(), params.grads(), params.entries(), opt, std::move(decay)) {}
  AdamW(Tensor<T> values, Tensor<T> grads, std::vector<nn::FlatEntry<T>> entries, AdamWOptions opt,
        DecayFilter decay = {})
      : Optimizer<T>(std::move(values), std::move(grads), std::move(entries), opt.lr, std::move(decay)), opt_(opt) {
    exp_avg_ = &this->add_state("exp_avg");
    exp_avg_sq_ = &this->add_state("exp_avg_sq");
  }

  void step() override {
    ++this->steps_;
    const Device dev = this->values_.device();
    for (const auto& r : this->ranges_)
      PTRAIN_DISPATCH(dev, adamw_update, r.end - r.begin, this->values_.data() + r.begin,
                      static_cast<const T*>(this->grads_.data() + r.begin), exp_avg_->data() + r.begin,
                      exp_avg_sq_->data() + r.begin, static_cast<T>(this->lr_), static_cast<T>(opt_.beta1),
                      static_cast<T>(opt_.beta2), static_cast<T>(opt_.eps),
                      static_cast<T>(r.decay ? opt_.weight_decay : 0.0), this->steps_);
  }

 private:
  AdamWOptions opt_;
  Tensor<T>* exp_avg_ = nullptr;
  Tensor<T>* exp_avg_sq_ = nullptr;
};

}  // namespace ptrain::optim
