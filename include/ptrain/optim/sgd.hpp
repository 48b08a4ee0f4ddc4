#pragma once
// SGD with momentum, dampening, Nesterov and (coupled) weight decay, with
// torch.optim.SGD's semantics.

#include "ptrain/ops/optimizer.hpp"
#include "ptrain/optim/optimizer.hpp"

namespace ptrain::optim {

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;
};

template <class T>
class SGD : public Optimizer<T> {
  static_assert(!std::is_same_v<T, bf16>, "ptrain::optim::SGD: bf16 parameters need AdamW (fp32 master weights)");

 public:
  SGD(nn::FlatParameters<T>& params, SGDOptions opt, DecayFilter decay = {})
      : SGD(params.values(), params.grads(), params.entries(), opt, std::move(decay)) {
    this->bind(params);
  }
  SGD(Tensor<T> values, Tensor<T> grads, std::vector<nn::FlatEntry<T>> entries, SGDOptions opt,
      DecayFilter decay = {})
      : Optimizer<T>(std::move(values), std::move(grads), std::move(entries), opt.lr, std::move(decay)), opt_(opt) {
    this->check_option("SGD", "momentum", opt.momentum, 0, HUGE_VAL, true);
    this->check_option("SGD", "dampening", opt.dampening, 0, 1, false);
    this->check_option("SGD", "weight_decay", opt.weight_decay, 0, HUGE_VAL, true);
    PTRAIN_CHECK(!opt.nesterov || (opt.momentum > 0 && opt.dampening == 0), Error,
                 "[ptrain.optim.sgd] Nesterov momentum needs momentum > 0 and dampening = 0");
    if (opt.momentum != 0) momentum_ = &this->add_state("momentum_buffer");
  }

  void step() override {
    this->check_bound();
    for (const auto& r : this->ranges_) {
      const Shape range{r.end - r.begin};
      auto p = this->values_.view(r.begin, range);
      auto buf = momentum_ ? momentum_->view(r.begin, range) : Tensor<T>();
      ops::sgd_update_(p, this->grads_.view(r.begin, range), buf, static_cast<T>(this->lr_),
                       static_cast<T>(opt_.momentum), static_cast<T>(opt_.dampening), opt_.nesterov,
                       static_cast<T>(r.decay ? opt_.weight_decay : 0.0), this->steps_ == 0);
    }
    ++this->steps_;
  }

 private:
  SGDOptions opt_;
  Tensor<acc_t<T>>* momentum_ = nullptr;
};

}  // namespace ptrain::optim
