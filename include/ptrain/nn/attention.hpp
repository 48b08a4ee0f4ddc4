#pragma once
// Causal multi-head self-attention, GPT-2 style.
//
//   x [B, S, C] -> c_attn (C -> 3C) -> per head: softmax(q k^T / sqrt(C/H), causal) v
//               -> c_proj (C -> C) -> dropout
//
// Parameter names follow GPT-2: "c_attn.weight" [3C, C], "c_attn.bias",
// "c_proj.weight" [C, C], "c_proj.bias". Dropout acts on the attention
// probabilities (attn_drop, a counter-based stream owned here) and on the
// output (resid_drop); both are identity in evaluation mode.

#include <string>

#include "ptrain/nn/activation.hpp"
#include "ptrain/nn/linear.hpp"
#include "ptrain/ops/attention.hpp"

namespace ptrain::nn {

namespace detail {
/// The heads of causal attention on qkv [B, S, 3 * n_head * d] (q | k | v), with
/// dropout p on the probabilities drawn from `gen` (p 0: none); saves what
/// heads_backward needs in cache's own slots (tensors, stats, values). Shared by
/// every attention module, whole or split by heads.
template <class T>
Tensor<T> heads_forward(const Tensor<T>& qkv, std::int64_t n_head, double p, Generator& gen, Cache<T>& cache) {
  const bool drop = p > 0;
  const std::uint64_t offset =
      drop ? gen.reserve(static_cast<std::uint64_t>(qkv.size(0) * n_head * qkv.size(1) * qkv.size(1))) : 0;
  ops::AttentionSaved<T> saved;
  auto y = ops::causal_attention(qkv, n_head, p, gen.seed(), offset, saved);
  cache.tensors = {qkv, saved.probs, saved.probs_drop, saved.out};
  cache.stats = {saved.lse};
  cache.values = {drop ? 1u : 0u, offset};
  return y;
}
/// dqkv of the heads_forward() whose saved values `cache` holds (dropout p, as in forward when it was on).
template <class T>
Tensor<T> heads_backward(const Tensor<T>& dy, std::int64_t n_head, double p, Generator& gen, Cache<T>& cache,
                         const char* who) {
  PTRAIN_CHECK(cache.tensors.size() == 4 && cache.stats.size() == 1, Error, "[ptrain.backward] ", who,
               "::backward without a forward");
  ops::AttentionSaved<T> saved{cache.tensors[1], cache.tensors[2], cache.values[0] ? p : 0.0, gen.seed(),
                               cache.values[1], cache.tensors[3], cache.stats[0]};
  return ops::causal_attention_backward(cache.tensors[0], saved, n_head, dy);
}
}  // namespace detail

template <class T>
class CausalSelfAttention : public Module<T> {
 public:
  /// dropout_seed keys the two dropout streams (attn_drop: seed, resid_drop: seed + 1).
  CausalSelfAttention(std::int64_t n_embd, std::int64_t n_head, double dropout = 0.0, std::uint64_t dropout_seed = 0,
                      Generator& gen = default_generator())
      : n_embd_(n_embd), n_head_(n_head), p_(dropout), attn_gen_(dropout_seed) {
    PTRAIN_CHECK(n_head > 0 && n_embd % n_head == 0, ShapeError, "[ptrain.attention] n_embd ", n_embd,
                 " is not divisible by n_head ", n_head);
    PTRAIN_CHECK(dropout >= 0.0 && dropout < 1.0, Error, "[ptrain.dropout] probability ", dropout,
                 " must be in [0, 1)");
    c_attn_ = this->register_module("c_attn", std::make_shared<Linear<T>>(n_embd, 3 * n_embd, true, gen));
    c_proj_ = this->register_module("c_proj", std::make_shared<Linear<T>>(n_embd, n_embd, true, gen));
    resid_drop_ = this->register_module("resid_drop", std::make_shared<Dropout<T>>(dropout, dropout_seed + 1));
  }
  /// Over given projections: c_attn [n_embd -> 3 * n_head * d] (q | k | v of n_head
  /// heads of width d), c_proj [n_head * d -> n_embd'] (a tensor-parallel rank's
  /// share of the heads: parallel/tp_gpt.hpp). attn_seed keys the attention
  /// dropout's stream, resid_seed resid_drop's.
  CausalSelfAttention(std::int64_t n_embd, std::int64_t n_head, std::shared_ptr<Linear<T>> c_attn,
                      std::shared_ptr<Linear<T>> c_proj, double dropout = 0.0, std::uint64_t attn_seed = 0,
                      std::uint64_t resid_seed = 1)
      : n_embd_(n_embd), n_head_(n_head), p_(dropout), attn_gen_(attn_seed) {
    PTRAIN_CHECK(c_attn && c_proj, Error, "[ptrain.attention] CausalSelfAttention needs both projections");
    const std::int64_t qkv = c_attn->weight().value.size(0);
    PTRAIN_CHECK(n_head > 0 && qkv % (3 * n_head) == 0 && c_proj->weight().value.size(1) == qkv / 3, ShapeError,
                 "[ptrain.attention] c_attn ", c_attn->weight().value.shape(), " and c_proj ",
                 c_proj->weight().value.shape(), " do not hold q, k and v of ", n_head, " heads and their projection");
    PTRAIN_CHECK(dropout >= 0.0 && dropout < 1.0, Error, "[ptrain.dropout] probability ", dropout,
                 " must be in [0, 1)");
    c_attn_ = this->register_module("c_attn", std::move(c_attn));
    c_proj_ = this->register_module("c_proj", std::move(c_proj));
    resid_drop_ = this->register_module("resid_drop", std::make_shared<Dropout<T>>(dropout, resid_seed));
  }

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    PTRAIN_CHECK(x.dim() == 3 && x.size(2) == n_embd_, ShapeError, "[ptrain.attention] input must be [B, S, ",
                 n_embd_, "], got ", x.shape());
    auto qkv = c_attn_->forward(x, cache.child(0));
    auto y = detail::heads_forward(qkv, n_head_, this->training() ? p_ : 0.0, attn_gen_, cache);
    auto out = c_proj_->forward(y, cache.child(1));
    return resid_drop_->forward(out, cache.child(2));
  }

  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    auto g = resid_drop_->backward(dy, cache.child(2));
    g = c_proj_->backward(g, cache.child(1));
    auto dx = c_attn_->backward(detail::heads_backward(g, n_head_, p_, attn_gen_, cache, "CausalSelfAttention"),
                                cache.child(0));
    cache.clear();
    return dx;
  }

  std::string describe() const override {
    return "CausalSelfAttention(" + std::to_string(n_embd_) + ", heads=" + std::to_string(n_head_) + ")";
  }
  Linear<T>& c_attn() { return *c_attn_; }
  Linear<T>& c_proj() { return *c_proj_; }
  /// Stream of the attention-probability dropout masks (its offset goes into checkpoints).
  Generator& attn_dropout_generator() { return attn_gen_; }
  Dropout<T>& resid_dropout() { return *resid_drop_; }
  std::int64_t n_head() const { return n_head_; }

 protected:
  void own_random_streams(std::vector<Generator*>& out) override { out.push_back(&attn_gen_); }

 private:
  std::int64_t n_embd_, n_head_;
  double p_;
  Generator attn_gen_;
  std::shared_ptr<Linear<T>> c_attn_, c_proj_;
  std::shared_ptr<Dropout<T>> resid_drop_;
};

}  // namespace ptrain::nn
