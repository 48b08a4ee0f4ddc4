#pragma once
// Causal grouped-query self-attention with rotary positions (Llama's LlamaAttention):
//
//   x [B, S, C] -> q_proj (C -> H*D), k_proj and v_proj (C -> Hkv*D), D = C / H
//               -> rotary on q and k (ops/rotary.hpp)
//               -> per query head h: softmax(q k^T / sqrt(D), causal) v with the
//                  key/value head h / (H / Hkv) (ops/gqa_attention.hpp)
//               -> o_proj (H*D -> C)
//
// n_kv_head divides n_head: n_kv_head == n_head is multi-head attention, 1 is
// multi-query. Parameter names follow Hugging Face: "q_proj.weight" [H*D, C],
// "k_proj.weight" and "v_proj.weight" [Hkv*D, C], "o_proj.weight" [C, H*D]; no
// biases by default (Llama, Mistral), qkv_bias for Qwen2's q/k/v biases, out_bias
// for an o_proj bias. Positions come from the cache's batch context (explicit
// position ids, or restarting at each document with set_document_token(); Note
// [Batch context]), else 0..S-1; the three-argument forward takes int32 position ids
// ([S] or [B, S]) directly. set_sliding_window(W): each query sees its last W keys,
// itself included (Mistral's sliding window, Hugging Face's mask). No dropout. Runs
// on the device of its parameters: the CPU (float, double, bf16) or CUDA (float and
// bf16: flash attention, ops/gqa_attention.hpp).

#include <cstdint>
#include <memory>
#include <string>

#include "ptrain/nn/batch_context.hpp"
#include "ptrain/nn/linear.hpp"
#include "ptrain/ops/gqa_attention.hpp"
#include "ptrain/ops/rotary.hpp"

namespace ptrain::nn {

/// The keys and values of the tokens seen so far, for generation
/// (GroupedQueryAttention::decode): [1, capacity, Hkv, D] each, the first `length`
/// positions filled; rotated keys, so a step only computes the new tokens'.
template <class T>
struct KVCache {
  Tensor<T> k, v;
  std::int64_t length = 0;
};

template <class T>
class GroupedQueryAttention : public Module<T> {
 public:
  GroupedQueryAttention(std::int64_t n_embd, std::int64_t n_head, std::int64_t n_kv_head, ops::RotaryConfig rope = {},
                        bool qkv_bias = false, bool out_bias = false, Generator& gen = default_generator())
      : n_embd_(n_embd), n_head_(n_head), n_kv_head_(n_kv_head), rope_(rope) {
    PTRAIN_CHECK(n_head > 0 && n_embd > 0 && n_embd % n_head == 0, ShapeError, "[ptrain.gqa_attention] n_embd ", n_embd,
                 " is not divisible by n_head ", n_head);
    PTRAIN_CHECK(n_kv_head > 0 && n_head % n_kv_head == 0, ShapeError, "[ptrain.gqa_attention] n_kv_head ", n_kv_head,
                 " must divide n_head ", n_head, " (1 for multi-query attention)");
    head_dim_ = n_embd / n_head;
    ops::rotary_inv_freq(head_dim_, rope_);  // checks the head width and the rotary config now, not at forward
    q_ = this->register_module("q_proj", std::make_shared<Linear<T>>(n_embd, n_head * head_dim_, qkv_bias, gen));
    k_ = this->register_module("k_proj", std::make_shared<Linear<T>>(n_embd, n_kv_head * head_dim_, qkv_bias, gen));
    v_ = this->register_module("v_proj", std::make_shared<Linear<T>>(n_embd, n_kv_head * head_dim_, qkv_bias, gen));
    o_ = this->register_module("o_proj", std::make_shared<Linear<T>>(n_head * head_dim_, n_embd, out_bias, gen));
  }
  /// The attention of n_head query and n_kv_head key/value heads of width head_dim
  /// over given projections: q [C -> n_head * head_dim], k and v [C -> n_kv_head *
  /// head_dim], o [n_head * head_dim -> C'] (a tensor-parallel rank's share of the
  /// heads: parallel/tp_llama.hpp).
  GroupedQueryAttention(std::int64_t n_embd, std::int64_t n_head, std::int64_t n_kv_head, std::int64_t head_dim,
                        ops::RotaryConfig rope, std::shared_ptr<Linear<T>> q, std::shared_ptr<Linear<T>> k,
                        std::shared_ptr<Linear<T>> v, std::shared_ptr<Linear<T>> o)
      : n_embd_(n_embd), n_head_(n_head), n_kv_head_(n_kv_head), head_dim_(head_dim), rope_(rope) {
    PTRAIN_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0 && head_dim > 0, ShapeError,
                 "[ptrain.gqa_attention] ", n_kv_head, " key/value heads must divide ", n_head, " query heads");
    ops::rotary_inv_freq(head_dim_, rope_);
    q_ = this->register_module("q_proj", std::move(q));
    k_ = this->register_module("k_proj", std::move(k));
    v_ = this->register_module("v_proj", std::move(v));
    o_ = this->register_module("o_proj", std::move(o));
  }

  /// Positions and document masking from the cache's batch context (Note [Batch
  /// context]): explicit position ids if it has them; with a document token, each
  /// query sees its own document only and positions restart there; else 0..S-1.
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    const BatchContext* ctx = cache.context();
    Tensor<std::int32_t> positions = ctx ? ctx->position_ids : Tensor<std::int32_t>();
    Tensor<std::int32_t> starts;
    if (document_token_ >= 0) {
      PTRAIN_CHECK(ctx && ctx->ids.defined(), Error, "[ptrain.gqa_attention.documents] document masking (token ",
                   document_token_, ") needs the batch's token ids: feed the model with forward_tokens(ids, cache), or "
                   "set a BatchContext with the ids on the cache");
      PTRAIN_CHECK(ctx->ids.dim() == 2 && ctx->ids.size(0) == x.size(0) && ctx->ids.size(1) == x.size(1), ShapeError,
                   "[ptrain.gqa_attention.documents] the context's token ids ", ctx->ids.shape(),
                   " do not match the input ", x.shape(), "; they must be [B, S]");
      starts = document_starts(ctx->ids, document_token_);
      if (!positions.defined()) positions = document_positions(starts);
      if (!x.device().is_cpu()) starts = starts.to(x.device());
    }
    return attend(x, positions, starts, cache);
  }

  /// position_ids: int32 [S] or [B, S] on the CPU; undefined means 0..S-1. No document masking.
  Tensor<T> forward(const Tensor<T>& x, const Tensor<std::int32_t>& position_ids, Cache<T>& cache) {
    return attend(x, position_ids, {}, cache);
  }

  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 5 && cache.stats.size() == 1 && cache.indices.size() == 2 &&
                     cache.values.size() == 1,
                 Error, "[ptrain.backward] GroupedQueryAttention::backward without a forward");
    const Tensor<T>&q = cache.tensors[0], &k = cache.tensors[1], &v = cache.tensors[2];
    const std::int64_t B = q.size(0), S = q.size(1);
    ops::GqaSaved<T> saved{cache.tensors[3], cache.tensors[4], cache.stats[0], cache.indices[1],
                           static_cast<std::int64_t>(cache.values[0])};
    auto dy_heads = o_->backward(dy, cache.child(3)).reshape(q.shape());
    Tensor<T> dq, dk, dv;
    ops::gqa_attention_backward(q, k, v, saved, dy_heads, dq, dk, dv);
    ops::rotary_backward_(dq, rope_, cache.indices[0]);
    ops::rotary_backward_(dk, rope_, cache.indices[0]);
    auto dx = q_->backward(dq.reshape({B, S, n_head_ * head_dim_}), cache.child(0));
    ops::axpy_(acc_t<T>(1), k_->backward(dk.reshape({B, S, n_kv_head_ * head_dim_}), cache.child(1)), dx);
    ops::axpy_(acc_t<T>(1), v_->backward(dv.reshape({B, S, n_kv_head_ * head_dim_}), cache.child(2)), dx);
    cache.clear();
    return dx;
  }

  std::string describe() const override {
    return "GroupedQueryAttention(" + std::to_string(n_embd_) + ", heads=" + std::to_string(n_head_) +
           ", kv_heads=" + std::to_string(n_kv_head_) + ")";
  }
  Linear<T>& q_proj() { return *q_; }
  Linear<T>& k_proj() { return *k_; }
  Linear<T>& v_proj() { return *v_; }
  Linear<T>& o_proj() { return *o_; }
  std::int64_t n_head() const { return n_head_; }
  std::int64_t n_kv_head() const { return n_kv_head_; }
  std::int64_t head_dim() const { return head_dim_; }
  const ops::RotaryConfig& rotary() const { return rope_; }

  /// Generation with a KV cache: x [1, s, C] are the next s tokens, at positions
  /// kv.length .. kv.length + s - 1; their rotated keys and values are appended to kv
  /// (capacity: the first call's `capacity` positions) and the output [1, s, C] is
  /// what forward() gives those tokens after the kv.length before them (with the
  /// sliding window, each sees its last `window` positions). One sequence, no
  /// document masking, no backward. The cache lives on x's device.
  Tensor<T> decode(const Tensor<T>& x, KVCache<T>& kv, std::int64_t capacity) {
    PTRAIN_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(2) == n_embd_, ShapeError,
                 "[ptrain.gqa_attention.decode] input must be [1, s, ", n_embd_, "], got ", x.shape());
    const std::int64_t s = x.size(1), past = kv.length, H = n_head_, Hkv = n_kv_head_, D = head_dim_;
    if (!kv.k.defined()) {
      kv.k = Tensor<T>::zeros({1, capacity, Hkv, D}, x.device());
      kv.v = Tensor<T>::zeros({1, capacity, Hkv, D}, x.device());
    }
    PTRAIN_CHECK(past + s <= kv.k.size(1), ShapeError, "[ptrain.gqa_attention.decode] ", past + s,
                 " positions exceed the KV cache's ", kv.k.size(1), "; start a new cache");
    Cache<T> scratch;  // the projections' saved inputs, not needed without backward
    auto q = q_->forward(x, scratch.child(0)).reshape({1, s, H, D});
    auto k = k_->forward(x, scratch.child(1)).reshape({1, s, Hkv, D});
    auto v = v_->forward(x, scratch.child(2)).reshape({1, s, Hkv, D});
    auto positions = Tensor<std::int32_t>::empty({s});
    for (std::int64_t i = 0; i < s; ++i) positions.data()[i] = static_cast<std::int32_t>(past + i);
    ops::rotary_(q, rope_, positions);
    ops::rotary_(k, rope_, positions);
    kv.k.view(past * Hkv * D, k.shape()).copy_(k);
    kv.v.view(past * Hkv * D, v.shape()).copy_(v);
    kv.length = past + s;
    // Token i (position past + i) attends to positions 0 .. past + i (the last window of them).
    auto y = ops::gqa_attention_decode(q, kv.k, kv.v, kv.length, window_).reshape({1, s, H * D});
    return o_->forward(y, scratch.child(3));
  }

  /// Tokens of the document_token start a new document: attention stays inside a
  /// document and positions restart (Note [Batch context]); -1 (default): no masking.
  void set_document_token(std::int32_t token) { document_token_ = token; }
  std::int32_t document_token() const { return document_token_; }
  /// Mistral's sliding window: each query sees its last `window` keys, itself
  /// included (Note [Sliding window] in kernels/cpu/gqa_attention.hpp); 0 (default): none.
  void set_sliding_window(std::int64_t window) {
    PTRAIN_CHECK(window >= 0, Error, "[ptrain.gqa_attention.window] sliding window ", window, " must be >= 0 (0: none)");
    window_ = window;
  }
  std::int64_t sliding_window() const { return window_; }

 private:
  Tensor<T> attend(const Tensor<T>& x, const Tensor<std::int32_t>& position_ids, const Tensor<std::int32_t>& starts,
                   Cache<T>& cache) {
    PTRAIN_CHECK(x.dim() == 3 && x.size(2) == n_embd_, ShapeError, "[ptrain.gqa_attention] input must be [B, S, ",
                 n_embd_, "], got ", x.shape());
    const std::int64_t B = x.size(0), S = x.size(1);
    // The projections' outputs are fresh tensors (Linear keeps only its input), so rotating in place is safe.
    auto q = q_->forward(x, cache.child(0)).reshape({B, S, n_head_, head_dim_});
    auto k = k_->forward(x, cache.child(1)).reshape({B, S, n_kv_head_, head_dim_});
    auto v = v_->forward(x, cache.child(2)).reshape({B, S, n_kv_head_, head_dim_});
    ops::rotary_(q, rope_, position_ids);
    ops::rotary_(k, rope_, position_ids);
    ops::GqaSaved<T> saved;
    auto y = ops::gqa_attention(q, k, v, saved, starts, window_);
    cache.tensors = {q, k, v, saved.probs, saved.out};
    cache.stats = {saved.lse};
    cache.indices = {position_ids, saved.starts};
    cache.values = {static_cast<std::uint64_t>(window_)};
    return o_->forward(y.reshape({B, S, n_head_ * head_dim_}), cache.child(3));
  }

  std::int64_t n_embd_, n_head_, n_kv_head_, head_dim_ = 0;
  std::int32_t document_token_ = -1;
  std::int64_t window_ = 0;
  ops::RotaryConfig rope_;
  std::shared_ptr<Linear<T>> q_, k_, v_, o_;
};

}  // namespace ptrain::nn
