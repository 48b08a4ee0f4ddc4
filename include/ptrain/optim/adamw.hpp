#pragma once
// AdamW: Adam with decoupled weight decay, torch.optim.AdamW's semantics and
// defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01).
//
// bf16 parameters (mixed precision): the optimizer keeps an fp32 master copy
// of the parameters (state "master", copied from the parameters when the
// optimizer is made) and fp32 moments; each step updates the master copy from
// the bf16 gradients and writes its bf16 rounding to the parameters. Make the
// optimizer after loading weights into the model.
//
// Note [AdamW in one launch]
// step() updates the flat buffer range by range (weight decay on or off), one
// kernel call per range. kernels::cpu/cuda::adamw_update_ranges does the same
// arithmetic over all ranges in one call, and adds two options:
// stochastic_rounding (bf16 parameters: the master value rounds to bf16 at
// random, unbiased, hashed from (seed, step, index)) and max_grad_norm
// (global-norm clipping inside the update, the norm computed where the
// gradients live: on a GPU neither the norm nor the coefficient visits the
// host). On the CPU step() takes it when either option is set (without them
// the range-by-range results are unchanged, bit for bit). On a GPU it takes it
// whenever the kernel may run (Note [The verification gate]); while it is
// gated, step() launches per range, clips with clip_grad_norm_ (a host read),
// and refuses stochastic_rounding. max_grad_norm sees only this optimizer's
// gradients: right for Local and DDP (whole, synchronised gradients), wrong
// for FSDP, pipeline and tensor parallelism, where the norm spans ranks (use
// Engine::clip_grad_norm_ there).

#include <cstdint>
#include <vector>

#include "ptrain/ops/optimizer.hpp"
#include "ptrain/ops/vector.hpp"
#include "ptrain/optim/clip.hpp"
#include "ptrain/optim/optimizer.hpp"

namespace ptrain::optim {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  /// Global-norm clipping inside the update (> 0), as clip_grad_norm_(grads, max_grad_norm)
  /// before step() but without a host read on a GPU (Note [AdamW in one launch]); 0: off.
  double max_grad_norm = 0;
  /// bf16 parameters: round the fp32 master copy to bf16 stochastically (Note [AdamW in one launch]).
  bool stochastic_rounding = false;
  std::uint64_t seed = 0;  ///< stochastic rounding's stream
};

template <class T>
class AdamW : public Optimizer<T> {
 public:
  AdamW(nn::FlatParameters<T>& params, AdamWOptions opt, DecayFilter decay = {})
      : AdamW(params.values(), params.grads(), params.entries(), opt, std::move(decay)) {
    this->bind(params);
  }
  AdamW(Tensor<T> values, Tensor<T> grads, std::vector<nn::FlatEntry<T>> entries, AdamWOptions opt,
        DecayFilter decay = {})
      : Optimizer<T>(std::move(values), std::move(grads), std::move(entries), opt.lr, std::move(decay)), opt_(opt) {
    this->check_option("AdamW", "beta1", opt.beta1, 0, 1, true);
    this->check_option("AdamW", "beta2", opt.beta2, 0, 1, true);
    this->check_option("AdamW", "eps", opt.eps, 0, HUGE_VAL, true);
    this->check_option("AdamW", "weight_decay", opt.weight_decay, 0, HUGE_VAL, true);
    this->check_option("AdamW", "max_grad_norm", opt.max_grad_norm, 0, HUGE_VAL, true);
    PTRAIN_CHECK(!opt.stochastic_rounding || (std::is_same_v<T, bf16>), Error, "[ptrain.optim.options] AdamW "
                 "stochastic_rounding rounds bf16 parameters; these are ", dtype_name(dtype_of<T>()),
                 ": leave it off");
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
    if (one_launch()) {
      step_ranges();
      return;
    }
    if (opt_.stochastic_rounding)  // throws [ptrain.cuda.unverified] (or unsupported): only that kernel rounds so
      (void)kernels::cuda_kernel<T>(&kernels::CudaKernels<T>::adamw_update_ranges, "adamw_update_ranges");
    if (opt_.max_grad_norm > 0) clip_grad_norm_(this->grads_, opt_.max_grad_norm);
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

  /// Note [CUDA graphs of the step]: only the one-launch update on a GPU reads its scalars
  /// from device memory.
  bool use_device_scalars(bool on) override {
    if (on && !(this->values_.device().is_cuda() && one_launch())) return false;
    device_scalars_ = on;
    return true;
  }
  void stage_device_scalars() override {
    PTRAIN_CHECK(device_scalars_, Error, "[ptrain.optim.graph] stage_device_scalars() before use_device_scalars(true)");
    const Device d = this->values_.device();
    if (!lr_step_.defined()) lr_step_ = Tensor<double>::zeros({2}, d);
    const double v[2] = {this->lr_, static_cast<double>(this->steps_ + 1)};
    kernels::cuda_graph_calls().upload(lr_step_.data(), v, sizeof v, d.index);
  }

  /// The sum of squares of the gradients that the last step clipped with (max_grad_norm
  /// through the one-launch update; undefined otherwise), one double on the parameters'
  /// device: sqrt of its value is the norm before clipping. Reading it waits for the device.
  const Tensor<double>& grad_sumsq() const { return grad_sumsq_; }

 private:
  // Whether step() runs adamw_update_ranges (Note [AdamW in one launch]).
  bool one_launch() const {
    if (this->values_.device().is_cpu()) return opt_.stochastic_rounding || opt_.max_grad_norm > 0;
    return kernels::cuda_kernel_usable(&kernels::CudaKernels<T>::adamw_update_ranges, "adamw_update_ranges") &&
           (opt_.max_grad_norm == 0 ||
            kernels::cuda_kernel_usable(&kernels::CudaKernels<T>::sum_squares_to, "sum_squares_to"));
  }

  void step_ranges() {
    const Device d = this->values_.device();
    if (!range_ends_.defined()) {
      std::vector<std::int64_t> ends;
      std::vector<std::uint8_t> flags;
      for (const auto& r : this->ranges_) {
        ends.push_back(r.end);
        flags.push_back(r.decay ? 1 : 0);
      }
      const auto k = static_cast<std::int64_t>(ends.size());
      range_ends_ = Tensor<std::int64_t>::from(ends, {k}).to(d);
      range_decay_ = Tensor<std::uint8_t>::from(flags, {k}).to(d);
    }
    kernels::AdamWStep s;
    s.lr = this->lr_;
    s.beta1 = opt_.beta1;
    s.beta2 = opt_.beta2;
    s.eps = opt_.eps;
    s.weight_decay = opt_.weight_decay;
    s.step = this->steps_;
    s.stochastic_rounding = opt_.stochastic_rounding;
    s.seed = opt_.seed;
    if (device_scalars_) {
      PTRAIN_CHECK(lr_step_.defined(), Error, "[ptrain.optim.graph] AdamW with device scalars stepped before "
                   "stage_device_scalars()");
      s.lr_step = lr_step_.data();
    }
    if (opt_.max_grad_norm > 0) {
      if (!grad_sumsq_.defined()) grad_sumsq_ = Tensor<double>::zeros({1}, d);
      ops::sum_squares_into(this->grads_, grad_sumsq_);
      s.grad_sumsq = grad_sumsq_.data();
      s.max_norm = opt_.max_grad_norm;
    }
    if constexpr (std::is_same_v<T, bf16>)
      ops::adamw_update_ranges_(*master_, this->grads_, *exp_avg_, *exp_avg_sq_, &this->values_, range_ends_,
                                range_decay_, s);
    else
      ops::adamw_update_ranges_(this->values_, this->grads_, *exp_avg_, *exp_avg_sq_, nullptr, range_ends_,
                                range_decay_, s);
  }

  AdamWOptions opt_;
  Tensor<acc_t<T>>* exp_avg_ = nullptr;
  Tensor<acc_t<T>>* exp_avg_sq_ = nullptr;
  Tensor<float>* master_ = nullptr;  // bf16 parameters only
  Tensor<std::int64_t> range_ends_;   // ranges_ on the parameters' device, for adamw_update_ranges
  Tensor<std::uint8_t> range_decay_;
  Tensor<double> grad_sumsq_;
  bool device_scalars_ = false;
  Tensor<double> lr_step_;  // {lr, step} for AdamWStep::lr_step
};

}  // namespace ptrain::optim
