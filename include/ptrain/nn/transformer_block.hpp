#pragma once
// Pre-norm residual blocks: PreNormBlock (any norm, attention and MLP) and GPT-2's
// TransformerBlock:
//
//   h = x + attn(ln_1(x))
//   y = h + mlp(ln_2(h)),   mlp = c_fc (C -> 4C) -> GELU -> c_proj (4C -> C) -> dropout
//
// Parameter names follow GPT-2: "ln_1.*", "attn.c_attn.*", "attn.c_proj.*",
// "ln_2.*", "mlp.c_fc.*", "mlp.c_proj.*". A block is a self-contained unit:
// FSDP wraps one block per unit, pipeline stages cut between blocks.

#include <memory>
#include <string>
#include <vector>

#include "ptrain/nn/activation.hpp"
#include "ptrain/nn/attention.hpp"
#include "ptrain/nn/layer_norm.hpp"
#include "ptrain/nn/linear.hpp"

namespace ptrain::nn {

/// GELU feed-forward: x [..., C] -> dropout(c_proj(gelu(c_fc(x)))) [..., C], hidden width 4C.
template <class T>
class FeedForward : public Module<T> {
 public:
  FeedForward(std::int64_t n_embd, double dropout = 0.0, std::uint64_t dropout_seed = 0,
              Generator& gen = default_generator())
      : n_embd_(n_embd) {
    c_fc_ = this->register_module("c_fc", std::make_shared<Linear<T>>(n_embd, 4 * n_embd, true, gen));
    act_ = this->register_module("act", std::make_shared<GELU<T>>());
    c_proj_ = this->register_module("c_proj", std::make_shared<Linear<T>>(4 * n_embd, n_embd, true, gen));
    drop_ = this->register_module("drop", std::make_shared<Dropout<T>>(dropout, dropout_seed));
  }
  /// Over given projections: c_fc [n_embd -> hidden], c_proj [hidden -> n_embd'] (a
  /// tensor-parallel rank's share of the hidden width: parallel/tp_gpt.hpp). Forward
  /// and backward then go through the projections' own forward and backward (a
  /// column- or row-parallel layer adds its collectives there), not the fused ops.
  FeedForward(std::int64_t n_embd, std::shared_ptr<Linear<T>> c_fc, std::shared_ptr<Linear<T>> c_proj,
              double dropout = 0.0, std::uint64_t dropout_seed = 0)
      : n_embd_(n_embd), fused_(false) {
    PTRAIN_CHECK(c_fc && c_proj && c_fc->weight().value.size(0) == c_proj->weight().value.size(1), ShapeError,
                 "[ptrain.feed_forward] c_fc and c_proj must be given and agree on the hidden width");
    c_fc_ = this->register_module("c_fc", std::move(c_fc));
    act_ = this->register_module("act", std::make_shared<GELU<T>>());
    c_proj_ = this->register_module("c_proj", std::move(c_proj));
    drop_ = this->register_module("drop", std::make_shared<Dropout<T>>(dropout, dropout_seed));
  }
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    if (!fused()) {
      auto h = act_->forward(c_fc_->forward(x, cache.child(0)), cache.child(1));
      return drop_->forward(c_proj_->forward(h, cache.child(2)), cache.child(3));
    }
    // c_fc and the GELU as one op (a fused GEMM epilogue on GPUs), leaving in
    // each child's cache what its own forward would have: the input of c_fc,
    // the input of the GELU.
    Tensor<T> pre;
    auto h = ops::linear_gelu(x, c_fc_->weight().value, c_fc_->bias()->value, pre);
    cache.child(0).tensors = {x};
    cache.child(1).tensors = {pre};
    return drop_->forward(c_proj_->forward(h, cache.child(2)), cache.child(3));
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    // c_proj's backward, the GELU's and c_fc's bias gradient as one op (fused
    // GEMM epilogues on GPUs), then c_fc's weight gradient and dx.
    auto g = drop_->backward(dy, cache.child(3));
    if (!fused()) {
      auto dx = c_fc_->backward(act_->backward(c_proj_->backward(g, cache.child(2)), cache.child(1)), cache.child(0));
      cache.clear();
      return dx;
    }
    Parameter<T>& w_proj = c_proj_->weight();
    Parameter<T>& b_proj = *c_proj_->bias();
    Parameter<T>& w_fc = c_fc_->weight();
    Parameter<T>& b_fc = *c_fc_->bias();
    auto dpre = ops::linear_gelu_backward(cache.child(2).tensors.at(0), cache.child(1).tensors.at(0), w_proj.value, g,
                                          w_proj.grad, &b_proj.grad, b_fc.grad);
    w_proj.mark_grad_ready();
    b_proj.mark_grad_ready();
    auto dx = ops::linear_backward(cache.child(0).tensors.at(0), w_fc.value, dpre, w_fc.grad,
                                   static_cast<Tensor<T>*>(nullptr));
    w_fc.mark_grad_ready();
    b_fc.mark_grad_ready();
    cache.clear();
    return dx;
  }
  std::string describe() const override { return "FeedForward(" + std::to_string(n_embd_) + ", GELU, 4x)"; }
  Linear<T>& c_fc() { return *c_fc_; }
  Linear<T>& c_proj() { return *c_proj_; }
  Dropout<T>& dropout() { return *drop_; }

 private:
  // The fused ops read the projections' weights directly, so an adapter (LoRA) on
  // either takes the projections' own forward and backward.
  bool fused() const { return fused_ && !c_fc_->adapter() && !c_proj_->adapter(); }

  std::int64_t n_embd_;
  std::shared_ptr<Linear<T>> c_fc_, c_proj_;
  std::shared_ptr<GELU<T>> act_;
  std::shared_ptr<Dropout<T>> drop_;
  bool fused_ = true;  // c_fc with the GELU, and c_proj's backward with the GELU's, as fused ops
};

/// A pre-norm residual block with its four parts given as modules:
///
///   h = x + attn(norm_1(x))
///   y = h + mlp(norm_2(h))
///
/// GPT-2's TransformerBlock (LayerNorm, attention, GELU MLP) and Llama's block
/// (RMSNorm, grouped-query attention, SwiGLU) are this wiring with other parts; the
/// parts' names are their parameter prefixes. x [B, S, C] -> [B, S, C].
template <class T>
class PreNormBlock : public Module<T> {
 public:
  struct Part {
    std::string name;
    std::shared_ptr<Module<T>> module;
  };
  PreNormBlock(Part norm_1, Part attn, Part norm_2, Part mlp) { set_parts(norm_1, attn, norm_2, mlp); }

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    auto h = parts_[1]->forward(parts_[0]->forward(x, cache.child(0)), cache.child(1));
    ops::axpy_(1, x, h);  // h = x + attn(norm_1(x)); h is a fresh tensor
    auto y = parts_[3]->forward(parts_[2]->forward(h, cache.child(2)), cache.child(3));
    ops::axpy_(1, h, y);
    return y;
  }

  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    // Each residual passes dy through unchanged and adds its branch's gradient.
    auto dh = parts_[2]->backward(parts_[3]->backward(dy, cache.child(3)), cache.child(2));
    ops::axpy_(1, dy, dh);
    auto dx = parts_[0]->backward(parts_[1]->backward(dh, cache.child(1)), cache.child(0));
    ops::axpy_(1, dh, dx);
    cache.clear();
    return dx;
  }

  std::string describe() const override {
    std::string s = "PreNormBlock(";
    for (std::size_t i = 0; i < parts_.size(); ++i) s += (i ? ", " : "") + parts_[i]->describe();
    return s + ")";
  }

 protected:
  /// For blocks that make their parts in their own constructor: call set_parts() there.
  PreNormBlock() = default;
  /// Registers the parts in this order (their names are the parameter prefixes).
  void set_parts(const Part& norm_1, const Part& attn, const Part& norm_2, const Part& mlp) {
    PTRAIN_CHECK(parts_.empty(), Error, "[ptrain.block] the parts of a PreNormBlock are set once");
    for (const Part* p : {&norm_1, &attn, &norm_2, &mlp}) parts_.push_back(this->register_module(p->name, p->module));
  }

 private:
  std::vector<std::shared_ptr<Module<T>>> parts_;
};

/// GPT-2's block: x [B, S, C] -> [B, S, C].
template <class T>
class TransformerBlock : public PreNormBlock<T> {
 public:
  /// dropout_seed keys this block's dropout streams (seed .. seed + 2).
  TransformerBlock(std::int64_t n_embd, std::int64_t n_head, double dropout = 0.0, std::uint64_t dropout_seed = 0,
                   Generator& gen = default_generator())
      : n_embd_(n_embd), n_head_(n_head) {
    ln_1_ = std::make_shared<LayerNorm<T>>(n_embd);
    attn_ = std::make_shared<CausalSelfAttention<T>>(n_embd, n_head, dropout, dropout_seed, gen);
    ln_2_ = std::make_shared<LayerNorm<T>>(n_embd);
    mlp_ = std::make_shared<FeedForward<T>>(n_embd, dropout, dropout_seed + 2, gen);
    this->set_parts({"ln_1", ln_1_}, {"attn", attn_}, {"ln_2", ln_2_}, {"mlp", mlp_});
  }

  /// PreNormBlock's wiring with the first residual add fused into ln_2
  /// (ops::residual_layer_norm: h = x + attn(...) and ln_2(h) in one kernel) where the
  /// fused op runs (ops::residual_layer_norm_usable: the CPU, where the bits are those of
  /// the add followed by the norm, and CUDA once the gate lets its kernels run);
  /// PreNormBlock's otherwise. ln_2's cache holds what its own forward keeps, so either
  /// backward follows either forward.
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    if (!ops::residual_layer_norm_usable<T>(x.device())) return PreNormBlock<T>::forward(x, cache);
    auto a = attn_->forward(ln_1_->forward(x, cache.child(0)), cache.child(1));
    Tensor<T> h;
    Tensor<acc_t<T>> mean, rstd;
    auto n2 = ops::residual_layer_norm(x, a, ln_2_->weight().value, ln_2_->bias().value, ln_2_->eps(), h, mean, rstd);
    Cache<T>& norm_cache = cache.child(2);
    norm_cache.tensors = {h};
    norm_cache.stats = {mean, rstd};
    auto y = mlp_->forward(n2, cache.child(3));
    ops::axpy_(1, h, y);
    return y;
  }

  /// The residual stream's gradient dy joins ln_2's in one kernel
  /// (ops::residual_layer_norm_backward: dh = ln_2'(dmlp) + dy) where the fused op runs.
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    if (!ops::residual_layer_norm_usable<T>(dy.device())) return PreNormBlock<T>::backward(dy, cache);
    Cache<T>& norm_cache = cache.child(2);
    PTRAIN_CHECK(norm_cache.tensors.size() == 1 && norm_cache.stats.size() == 2, Error,
                 "[ptrain.backward] TransformerBlock::backward without a forward");
    auto dn2 = mlp_->backward(dy, cache.child(3));
    Parameter<T>& w = ln_2_->weight();
    Parameter<T>& b = ln_2_->bias();
    auto dh = ops::residual_layer_norm_backward(norm_cache.tensors[0], norm_cache.stats[0], norm_cache.stats[1],
                                                w.value, dn2, dy, w.grad, b.grad);
    w.mark_grad_ready();
    b.mark_grad_ready();
    norm_cache.clear();
    auto dx = ln_1_->backward(attn_->backward(dh, cache.child(1)), cache.child(0));
    ops::axpy_(1, dh, dx);
    cache.clear();
    return dx;
  }

  std::string describe() const override {
    return "TransformerBlock(" + std::to_string(n_embd_) + ", heads=" + std::to_string(n_head_) + ")";
  }
  LayerNorm<T>& ln_1() { return *ln_1_; }
  LayerNorm<T>& ln_2() { return *ln_2_; }
  CausalSelfAttention<T>& attn() { return *attn_; }
  FeedForward<T>& mlp() { return *mlp_; }

 private:
  std::int64_t n_embd_, n_head_;
  std::shared_ptr<LayerNorm<T>> ln_1_, ln_2_;
  std::shared_ptr<CausalSelfAttention<T>> attn_;
  std::shared_ptr<FeedForward<T>> mlp_;
};

}  // namespace ptrain::nn
