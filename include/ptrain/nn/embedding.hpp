#pragma once
// Embedding tables and the first unit of a GPT (token + position + dropout).
//
// Token ids enter as a Tensor<T> of integral values, so that every unit of a
// model is a Module<T> and a pipeline can send T activations between stages;
// ops::token_ids() validates them (ShapeError names the position and value).
// The input has no gradient: backward returns an undefined tensor.

#include <string>

#include "ptrain/nn/activation.hpp"
#include "ptrain/nn/module.hpp"
#include "ptrain/ops/embedding.hpp"
#include "ptrain/ops/init.hpp"

namespace ptrain::nn {

/// ids [...] (integral T values) -> [..., dim]; weight [num, dim] ~ N(0, 1) as torch.nn.Embedding.
template <class T>
class Embedding : public Module<T> {
 public:
  Embedding(std::int64_t num, std::int64_t dim, Generator& gen = default_generator()) : num_(num), dim_(dim) {
    PTRAIN_CHECK(num > 0 && dim > 0, ShapeError, "[ptrain.embedding] sizes must be positive, got ", num, " x ", dim);
    auto w = Tensor<T>::empty({num, dim});
    ops::normal_(w, 0.0, 1.0, gen);
    weight_ = &this->register_parameter("weight", w);
  }

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override { return lookup(x, cache); }
  Tensor<T> forward_tokens(const Tensor<std::int32_t>& ids, Cache<T>& cache) override { return lookup(ids, cache); }
  /// Accumulates the weight gradient; returns an undefined tensor (ids have no gradient).
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.indices.size() == 1, Error, "[ptrain.backward] Embedding::backward without a forward");
    ops::embedding_backward(cache.indices[0], dy, weight_->grad, static_cast<Tensor<T>*>(nullptr));
    weight_->mark_grad_ready();
    cache.clear();
    return {};
  }
  std::string describe() const override {
    return "Embedding(" + std::to_string(num_) + ", " + std::to_string(dim_) + ")";
  }
  Parameter<T>& weight() { return *weight_; }
  std::int64_t num_embeddings() const { return num_; }
  std::int64_t dim() const { return dim_; }

 private:
  template <class I>
  Tensor<T> lookup(const Tensor<I>& x, Cache<T>& cache) {
    auto ids = ops::token_ids(x, num_);
    cache.indices = {ids};
    return ops::embedding(ids, weight_->value, Tensor<T>());
  }
  std::int64_t num_, dim_;
  Parameter<T>* weight_;
};

/// GPT input unit: ids [B, S] -> dropout(wte[ids] + wpe[0..S)) [B, S, C].
/// Parameters: "wte.weight" [vocab, C], "wpe.weight" [block_size, C].
///
/// With weight tying the LM head reads wte's Parameter and adds its part of
/// the gradient during its own backward, which runs first. This unit's
/// backward runs last and adds the lookup part, so it is the one that calls
/// mark_grad_ready() on wte: exactly once, with the final gradient.
template <class T>
class TokenPositionEmbedding : public Module<T> {
 public:
  TokenPositionEmbedding(std::int64_t vocab, std::int64_t block_size, std::int64_t dim, double dropout = 0.0,
                         std::uint64_t dropout_seed = 0, Generator& gen = default_generator())
      : block_size_(block_size) {
    wte_ = this->register_module("wte", std::make_shared<Embedding<T>>(vocab, dim, gen));
    wpe_ = this->register_module("wpe", std::make_shared<Embedding<T>>(block_size, dim, gen));
    drop_ = this->register_module("drop", std::make_shared<Dropout<T>>(dropout, dropout_seed));
  }

  /// x: token ids [batch, seq] as integral values of T (float or double; bf16 cannot hold them).
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override { return lookup(x, cache); }
  /// The same with int32 token ids, for every T (bf16 models take their ids this way).
  Tensor<T> forward_tokens(const Tensor<std::int32_t>& ids, Cache<T>& cache) override { return lookup(ids, cache); }
  /// Accumulates wte and wpe gradients and announces both; returns an undefined tensor.
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.indices.size() == 1, Error,
                 "[ptrain.backward] TokenPositionEmbedding::backward without a forward");
    auto g = drop_->backward(dy, cache.child(0));
    ops::embedding_backward(cache.indices[0], g, wte_->weight().grad, &wpe_->weight().grad);
    wpe_->weight().mark_grad_ready();
    wte_->weight().mark_grad_ready();
    cache.clear();
    return {};
  }
  std::string describe() const override {
    return "TokenPositionEmbedding(" + wte_->describe() + ", " + wpe_->describe() + ")";
  }
  Embedding<T>& wte() { return *wte_; }
  Embedding<T>& wpe() { return *wpe_; }
  Dropout<T>& dropout() { return *drop_; }

 private:
  template <class I>
  Tensor<T> lookup(const Tensor<I>& x, Cache<T>& cache) {
    PTRAIN_CHECK(x.dim() == 2, ShapeError, "[ptrain.embedding.input] expected token ids [batch, seq], got ",
                 x.shape());
    PTRAIN_CHECK(x.size(1) <= block_size_, ShapeError, "[ptrain.embedding.positions] sequence of ", x.size(1),
                 " tokens exceeds block_size ", block_size_, "; crop the context to the last block_size tokens");
    auto ids = ops::token_ids(x, wte_->num_embeddings());
    cache.indices = {ids};
    return drop_->forward(ops::embedding(ids, wte_->weight().value, wpe_->weight().value), cache.child(0));
  }

  std::int64_t block_size_;
  std::shared_ptr<Embedding<T>> wte_, wpe_;
  std::shared_ptr<Dropout<T>> drop_;
};

}  // namespace ptrain::nn
