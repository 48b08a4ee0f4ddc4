#pragma once
// AdamW: Adam with decoupled weight decay, torch.optim.AdamW's semantics and
// defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01).
//
// bf16 parameters (mixed precision): the optimizer keeps an fp32 master copy
// of the parameters (state "master", copied from the parameters when the
// optimizer is made) and fp32 moments; each step updates the master copy from
// the bf16 gradients and writes its bf16 rounding to the parameters. Make the
// optimizer after loading weights into the model.

#include "ptrain/ops/optimizer.hpp"
#include "ptrain/ops/vector.hpp"
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
      : AdamW(params.values(), params.grads(), params.entries(), opt, std::move(decay)) {
    this->bound_ = true;
  }
  AdamW(Tensor<T> values, Tensor<T> grads, std::vector<nn::FlatEntry<T>> entries, AdamWOptions opt,
        DecayFilter decay = {})
      : Optimizer<T>(std::move(values), std::move(grads), std::move(entries), opt.lr, std::move(decay)), opt_(opt) {
    this->check_option("AdamW", "beta1", opt.beta1, 0, 1, true);
    this->check_option("AdamW", "beta2", opt.beta2, 0, 1, true);
    this->check_option("AdamW", "eps", opt.eps, 0, HUGE_VAL, true);
    this->check_option("AdamW", "weight_decay", opt.weight_decay, 0, HUGE_VAL, true);
    exp_avg_ = &this->add_state("exp_avg");
    exp_avg_sq_ = &this->add_state("exp_avg_sq");
    if constexpr (std::is_same_v<T, bf16>) {
      master_ = &this->add_state("master");
      ops::cast_into(this->values_, *master_);
    }
  }

  void step() override {
    using A = acc_t<T>;
    this->check_bound();
    ++this->steps_;
    for (const auto& r : this->ranges_) {
      const Shape range{r.end - r.begin};
      const A lr = static_cast<A>(this->lr_), b1 = static_cast<A>(opt_.beta1), b2 = static_cast<A>(opt_.beta2),
              eps = static_cast<A>(opt_.eps), wd = static_cast<A>(r.decay ? opt_.weight_decay : 0.0);
      const auto g = this->grads_.view(r.begin, range);
      auto m = exp_avg_->view(r.begin, range), v = exp_avg_sq_->view(r.begin, range);
      auto p = this->values_.view(r.begin, range);
      if constexpr (std::is_same_v<T, bf16>) {
        auto master = master_->view(r.begin, range);
        ops::adamw_update_mixed_(master, g, m, v, lr, b1, b2, eps, wd, this->steps_, p);
      } else {
        ops::adamw_update_(p, g, m, v, lr, b1, b2, eps, wd, this->steps_);
      }
    }
  }

 private:
  AdamWOptions opt_;
  Tensor<acc_t<T>>* exp_avg_ = nullptr;
  Tensor<acc_t<T>>* exp_avg_sq_ = nullptr;
  Tensor<float>* master_ = nullptr;  // bf16 parameters only
};

}  // namespace ptrain::optim
