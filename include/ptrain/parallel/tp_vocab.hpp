#pragma once
// The vocabulary, split over the tensor-parallel group: the token embedding's
// rows, the LM head's rows (tied or not) and the cross-entropy over logits of
// which each rank holds a contiguous slice of the vocabulary. The full logits
// [B, S, V] are never gathered (Note [Vocabulary-parallel cross-entropy]).
//
// Rank r holds vocabulary rows [r * Vl, (r + 1) * Vl), Vl = ceil(V / tp); the
// rows past V are padding (Note [Tensor parallel shards] in tp_group.hpp).
//
// The masked lookups and the loss statistics are ops (ops/vocab_parallel.hpp), so
// these units run on any device whose tensors the group's communicator serves
// (the CPU with MPI or Gloo, a GPU with NCCL).

#include <algorithm>
#include <functional>
#include <string>
#include <type_traits>

#include "ptrain/nn/activation.hpp"
#include "ptrain/nn/layer_norm.hpp"
#include "ptrain/nn/targets.hpp"
#include "ptrain/ops/embedding.hpp"
#include "ptrain/ops/linear.hpp"
#include "ptrain/ops/vocab_parallel.hpp"
#include "ptrain/parallel/tp_group.hpp"

namespace ptrain::parallel {

namespace detail {
/// The vocabulary rows of tp rank `rank`: [lo, lo + Vl), of which [lo, min(lo + Vl, V)) are real.
struct VocabRange {
  std::int64_t lo, local, vocab;
  VocabRange(std::int64_t vocab, int rank, int tp)
      : lo(rank * ((vocab + tp - 1) / tp)), local((vocab + tp - 1) / tp), vocab(vocab) {}
  bool owns(std::int64_t id) const { return id >= lo && id < lo + local; }
  std::int64_t real() const { return std::max<std::int64_t>(0, std::min(local, vocab - lo)); }
};
}  // namespace detail

/// The input unit with the token table split by vocabulary rows: ids [B, S] ->
/// dropout(wte[ids] + wpe[0..S)) [B, S, C] (GPT), or wte[ids] (Llama), replicated
/// (under sequence parallelism, this rank's slice [B, S / tp, C]). Each rank looks
/// up the ids it owns (zeros elsewhere) and tp rank 0 adds the positions; g (an
/// all-reduce, or a reduce-scatter along the sequence) sums them. GPT's parameters
/// are "wte.weight" [V, C] (sharded by rows) and "wpe.weight" [block_size, C]
/// (replicated), as nn::TokenPositionEmbedding; Llama's "weight", as nn::Embedding.
template <class T>
class VocabParallelEmbedding : public nn::Module<T>, public ShardedModule {
 public:
  /// GPT's token and position embedding with dropout.
  VocabParallelEmbedding(TensorParallelGroup& group, std::int64_t vocab, std::int64_t block_size, std::int64_t dim,
                         double dropout = 0.0, std::uint64_t dropout_seed = 0)
      : VocabParallelEmbedding(group, vocab, dim, "wte.weight") {
    block_size_ = block_size;
    wpe_ = &this->register_parameter("wpe.weight", Tensor<T>::zeros({block_size, dim}));
    drop_ = this->register_module(
        "drop", std::make_shared<nn::Dropout<T>>(dropout, detail::residual_dropout_seed(dropout_seed, group)));
  }
  /// A token table alone, named `weight_name` (Llama's "weight").
  VocabParallelEmbedding(TensorParallelGroup& group, std::int64_t vocab, std::int64_t dim,
                         const std::string& weight_name = "weight")
      : group_(group), range_(vocab, group.rank(), group.size()), dim_(dim), weight_name_(weight_name) {
    wte_ = &this->register_parameter(weight_name, Tensor<T>::zeros({range_.local, dim}));
  }
  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    return lookup(ops::token_ids(x, range_.vocab), cache);
  }
  Tensor<T> forward_tokens(const Tensor<std::int32_t>& ids, nn::Cache<T>& cache) override {
    return lookup(ops::token_ids(ids, range_.vocab), cache);
  }
  /// Adds this rank's rows of the wte gradient and the (replicated) wpe gradient; announces both.
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    PTRAIN_CHECK(!cache.indices.empty(), Error, "[ptrain.backward] VocabParallelEmbedding::backward without a forward");
    const auto g = group_.whole(drop_ ? drop_->backward(dy, cache.child(0)) : dy);  // g's backward
    // Frozen parameters get no gradient (Note [Frozen parameters] in nn/flat_parameters.hpp). A
    // frozen table with trainable positions: a one-row scratch table that no id falls in
    // (lo = vocab), so that only the positions' gradient is written.
    const bool global = cache.indices.size() == 2;  // positions from set_positions()
    Tensor<T>* dpos = wpe_ && wpe_->requires_grad && !global ? &wpe_->grad : nullptr;
    if (global && wpe_->requires_grad)
      ops::embedding_backward(cache.indices[1], g, wpe_->grad, static_cast<Tensor<T>*>(nullptr));
    if (wte_->requires_grad) {
      ops::vocab_parallel_embedding_backward(cache.indices[0], range_.lo, g, wte_->grad, dpos);
    } else if (dpos) {
      auto scratch = Tensor<T>::zeros({1, dim_}, g.device());
      ops::vocab_parallel_embedding_backward(cache.indices[0], range_.vocab, g, scratch, dpos);
    }
    if (wpe_) wpe_->mark_grad_ready();
    wte_->mark_grad_ready();
    cache.clear();
    return {};
  }
  std::string describe() const override {
    return "VocabParallelEmbedding(" + std::to_string(range_.vocab) + ", " + std::to_string(dim_) + ", tp=" +
           std::to_string(group_.size()) + ")";
  }
  std::vector<std::pair<std::string, ShardSpec>> shard_specs() const override {
    return {{weight_name_, ShardSpec{0, 1, range_.vocab}}};
  }
  nn::Parameter<T>& wte() { return *wte_; }
  /// GPT's positions (wpe's rows), 0 for a token table alone.
  std::int64_t block_size() const { return block_size_; }
  /// GPT's positions under context parallelism (parallel/cp_engine.hpp): `positions()`
  /// gives each token's position [B, S] in its whole sequence at every forward, instead of 0..S-1.
  void set_positions(std::function<Tensor<std::int32_t>()> positions) { positions_ = std::move(positions); }

 private:
  Tensor<T> lookup(Tensor<std::int32_t> ids, nn::Cache<T>& cache) {
    PTRAIN_CHECK(ids.dim() == 2, ShapeError, "[ptrain.embedding.input] expected token ids [batch, seq], got ",
                 ids.shape());
    const bool global = wpe_ && positions_;
    PTRAIN_CHECK(!wpe_ || global || ids.size(1) <= block_size_, ShapeError, "[ptrain.embedding.positions] sequence "
                 "of ", ids.size(1), " tokens exceeds block_size ", block_size_, "; crop the context to the last "
                 "block_size tokens");
    // The rows this rank owns (zeros elsewhere), and tp rank 0 adds the positions.
    auto out = ops::vocab_parallel_embedding(ids, range_.lo, wte_->value,
                                             wpe_ && !global && group_.rank() == 0 ? wpe_->value : Tensor<T>());
    const auto pos =
        global ? ops::token_ids(positions_().to(wpe_->value.device()), block_size_) : Tensor<std::int32_t>();
    if (global && group_.rank() == 0) ops::axpy_(acc_t<T>(1), ops::embedding(pos, wpe_->value, Tensor<T>()), out);
    out = group_.sum_partials(out);  // g: the owner's row plus rank 0's position, on every rank (for its tokens)
    cache.indices = {ids};
    if (global) cache.indices.push_back(pos);
    return drop_ ? drop_->forward(out, cache.child(0)) : out;
  }

  TensorParallelGroup& group_;
  detail::VocabRange range_;
  std::int64_t block_size_ = 0, dim_;
  std::string weight_name_;
  nn::Parameter<T>* wte_;
  nn::Parameter<T>* wpe_ = nullptr;
  std::shared_ptr<nn::Dropout<T>> drop_;
  std::function<Tensor<std::int32_t>()> positions_;
};

/// The last unit (nn::LMHead) with the output projection split by vocabulary rows:
/// x [B, S, C] -> this rank's logits [B, S, Vl] = norm(x) W_r^T, W_r the tied wte
/// shard or an own "lm_head.weight" shard. f in front of the projection: backward
/// all-reduces the gradient of the norm's output before the norm's own backward,
/// so the norm stays replicated. Under sequence parallelism x is this rank's slice
/// of the sequence: the norm runs on it, f gathers its output and reduce-scatters
/// the gradient, and the norm's parameters are partial (Note [Sequence parallelism]).
template <class T, class Norm = nn::LayerNorm<T>>
class VocabParallelLMHead : public nn::Module<T>, public ShardedModule {
 public:
  /// GPT's head with LayerNorm "ln_f". `tied`: the embedding's wte shard, or null for
  /// an own weight (zeros; the model initialises it).
  VocabParallelLMHead(TensorParallelGroup& group, std::int64_t n_embd, std::int64_t vocab,
                      nn::Parameter<T>* tied = nullptr)
    requires std::is_same_v<Norm, nn::LayerNorm<T>>
      : VocabParallelLMHead(group, std::make_shared<Norm>(n_embd), "ln_f", n_embd, vocab, tied) {}
  /// Any norm, registered under norm_name (Llama's RMSNorm "norm"), as nn::LMHead.
  VocabParallelLMHead(TensorParallelGroup& group, std::shared_ptr<Norm> norm, const std::string& norm_name,
                      std::int64_t n_embd, std::int64_t vocab, nn::Parameter<T>* tied = nullptr)
      : group_(group), n_embd_(n_embd), vocab_(vocab), tied_(tied), norm_name_(norm_name) {
    norm_ = this->register_module(norm_name, std::move(norm));
    const detail::VocabRange range(vocab, group.rank(), group.size());
    if (!tied_) own_ = &this->register_parameter("lm_head.weight", Tensor<T>::zeros({range.local, n_embd}));
    else check_shape(tied_->value, {range.local, n_embd}, "tied vocabulary-parallel LM head weight");
  }
  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    auto h = norm_->forward(x, cache.child(0));
    cache.tensors = {h};
    return ops::linear(group_.whole(h), weight().value, Tensor<T>());
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 1, Error, "[ptrain.backward] VocabParallelLMHead::backward without a forward");
    nn::Parameter<T>& w = weight();
    auto dh = ops::linear_backward(group_.whole(cache.tensors[0]), w.value, dy, w.grad,
                                   static_cast<Tensor<T>*>(nullptr));
    if (!tied_) w.mark_grad_ready();  // a tied weight is announced by the embedding (Note [Weight tying] in gpt.hpp)
    auto dx = norm_->backward(group_.sum_partials(dh), cache.child(0));  // f's backward first
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    return "VocabParallelLMHead(" + std::to_string(n_embd_) + " -> " + std::to_string(vocab_) +
           (tied_ ? ", tied" : "") + ", tp=" + std::to_string(group_.size()) + ")";
  }
  std::vector<std::pair<std::string, ShardSpec>> shard_specs() const override {
    auto specs = detail::sequence_norm_specs(group_, norm_name_, *norm_);
    if (!tied_) specs.push_back({"lm_head.weight", ShardSpec{0, 1, vocab_}});
    return specs;
  }
  std::vector<nn::Parameter<T>*> borrowed_parameters() override {
    auto out = nn::Module<T>::borrowed_parameters();
    if (tied_) out.push_back(tied_);
    return out;
  }
  nn::Parameter<T>& weight() { return tied_ ? *tied_ : *own_; }
  Norm& norm() { return *norm_; }

 private:
  TensorParallelGroup& group_;
  std::int64_t n_embd_, vocab_;
  nn::Parameter<T>* tied_;
  nn::Parameter<T>* own_ = nullptr;
  std::string norm_name_;
  std::shared_ptr<Norm> norm_;
};

/// Mean cross-entropy over rows of vocabulary-parallel logits [..., Vl] against
/// class ids in [0, V) (or ignore_index), equal to nn::CrossEntropyLoss on the
/// full logits.
///
/// Note [Vocabulary-parallel cross-entropy]
/// For row i with target t and logits x split over the ranks:
///   M_i = max_j x_ij                   all-reduce (max) of each rank's max
///   Z_i = sum_j exp(x_ij - M_i)        all-reduce (sum) of each rank's partial sum,
///   x_it - M_i                         taken from the one rank that owns t (0 elsewhere)
///                                      and summed in the same all-reduce as Z
///   loss_i = log Z_i - (x_it - M_i)
/// so the forward sends 3 values per row instead of V, and backward needs no
/// communication: d loss_i / d x_ij = exp(x_ij - M_i) / Z_i - [j == t] on the
/// rank's own columns. Padding columns take no part (their gradient is 0).
/// The per-rank parts are ops (ops/vocab_parallel.hpp) on the logits' device; the
/// targets are checked by the loss op after the two all-reduces, and since the tp
/// ranks hold the same targets, all of them throw [ptrain.tp.target] together.
template <class T>
class VocabParallelCrossEntropy {
 public:
  VocabParallelCrossEntropy(TensorParallelGroup& group, std::int64_t vocab, std::int32_t ignore_index = -100)
      : group_(group), range_(vocab, group.rank(), group.size()), ignore_index_(ignore_index) {}

  double forward(const Tensor<T>& logits, const nn::Targets<T>& targets, nn::Cache<T>& cache) {
    const Tensor<std::int32_t>& ids = targets.ids("VocabParallelCrossEntropy");
    const std::int64_t Vl = range_.local, real = range_.real();
    PTRAIN_CHECK(logits.dim() >= 1 && logits.size(-1) == Vl && ids.numel() * Vl == logits.numel(), ShapeError,
                 "[ptrain.tp.logits] vocabulary-parallel logits ", logits.shape(), " do not hold ", Vl,
                 " vocabulary columns for each of the ", ids.numel(), " targets");
    const std::int64_t N = ids.numel();
    auto stats = ops::vocab_parallel_row_max(logits, real);  // M | Z | x_t - M
    auto max_part = stats.view(0, {N});
    group_.all_reduce(max_part, dist::ReduceOp::Max);
    ops::vocab_parallel_row_sums(logits, ids, range_.lo, real, ignore_index_, stats);
    auto sum_part = stats.view(N, {2 * N});
    group_.all_reduce(sum_part);
    std::int64_t valid = 0;
    const double loss = ops::vocab_parallel_loss<T>(stats, ids, range_.vocab, ignore_index_, valid);
    cache.tensors = {logits};
    cache.stats = {stats};
    cache.indices = {ids};
    cache.values = {static_cast<std::uint64_t>(valid)};
    return loss;
  }
  /// Gradient of `dloss * loss` with respect to this rank's logits; no communication.
  Tensor<T> backward(nn::Cache<T>& cache, acc_t<T> dloss = 1) {
    PTRAIN_CHECK(cache.tensors.size() == 1 && cache.stats.size() == 1, Error,
                 "[ptrain.backward] VocabParallelCrossEntropy::backward without a forward");
    auto d = ops::vocab_parallel_loss_backward(cache.tensors[0], cache.stats[0], cache.indices[0], range_.lo,
                                               range_.real(), static_cast<std::int64_t>(cache.values[0]), dloss,
                                               ignore_index_);
    cache.clear();
    return d;
  }

 private:
  TensorParallelGroup& group_;
  detail::VocabRange range_;
  std::int32_t ignore_index_;
};

}  // namespace ptrain::parallel
