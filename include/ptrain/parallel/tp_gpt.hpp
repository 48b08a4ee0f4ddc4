#pragma once
// GPT in tensor-parallel form: unit by unit, the same units and parameter names
// as nn::GPT ("embed", "h.i", "head"), each rank holding its shards.
//
//   unit "embed"  VocabParallelEmbedding     wte by vocabulary rows, wpe replicated
//   unit "h.i"    TensorParallelBlock        ln_1, ln_2 replicated;
//                                            attn.c_attn by heads (q|k|v rows), attn.c_proj by rows;
//                                            mlp.c_fc by columns, mlp.c_proj by rows
//   unit "head"   VocabParallelLMHead        ln_f replicated, the (tied) weight by vocabulary rows
//
// The output is this rank's slice of the logits; train it with
// VocabParallelCrossEntropy (the TensorParallel engine, parallel/tensor_parallel.hpp,
// builds the units with detail::tensor_parallel_gpt_unit and does).

#include <functional>
#include <string>

#include "ptrain/nn/models/gpt.hpp"
#include "ptrain/nn/recompute.hpp"
#include "ptrain/ops/attention.hpp"
#include "ptrain/parallel/tp_linear.hpp"
#include "ptrain/parallel/tp_vocab.hpp"

namespace ptrain::parallel {

/// Causal self-attention split by heads: c_attn (C -> 3C, q|k|v) column-parallel
/// in 3 blocks, so each rank gets q, k and v of n_head / tp heads; c_proj (C -> C)
/// row-parallel. Names as nn::CausalSelfAttention.
template <class T>
class HeadParallelAttention : public nn::Module<T> {
 public:
  HeadParallelAttention(TensorParallelGroup& group, std::int64_t n_embd, std::int64_t n_head, double dropout = 0.0,
                        std::uint64_t dropout_seed = 0)
      : n_embd_(n_embd), n_head_(n_head), local_heads_(n_head / group.size()), p_(dropout),
        // Each rank draws the attention masks of its own heads: a stream per tp rank.
        attn_gen_(dropout_seed ^ (0xA5A5A5A5ull * static_cast<std::uint64_t>(group.rank()))) {
    PTRAIN_CHECK(n_head > 0 && n_embd % n_head == 0 && n_head % group.size() == 0, ShapeError, "[ptrain.tp.heads] ",
                 n_head, " heads (of width ", n_embd, ") do not split over ", group.size(),
                 " tensor-parallel ranks; choose a tp degree that divides n_head");
    Generator scratch(0);  // the real values are copied in (detail::copy_shards)
    c_attn_ = this->register_module("c_attn",
                                    std::make_shared<ColumnParallelLinear<T>>(group, n_embd, 3 * n_embd, true, 3, scratch));
    c_proj_ = this->register_module("c_proj", std::make_shared<RowParallelLinear<T>>(group, n_embd, n_embd, true, scratch));
    resid_drop_ = this->register_module(
        "resid_drop", std::make_shared<nn::Dropout<T>>(dropout, detail::residual_dropout_seed(dropout_seed + 1, group)));
  }
  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    PTRAIN_CHECK(x.dim() == 3 && x.size(2) == n_embd_, ShapeError, "[ptrain.attention] input must be [B, S, ",
                 n_embd_, "], got ", x.shape());
    auto qkv = c_attn_->forward(x, cache.child(0));
    auto y = nn::detail::heads_forward(qkv, local_heads_, this->training() ? p_ : 0.0, attn_gen_, cache);
    return resid_drop_->forward(c_proj_->forward(y, cache.child(1)), cache.child(2));
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    auto g = c_proj_->backward(resid_drop_->backward(dy, cache.child(2)), cache.child(1));
    auto dx = c_attn_->backward(nn::detail::heads_backward(g, local_heads_, p_, attn_gen_, cache, "HeadParallelAttention"),
                                cache.child(0));
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    return "HeadParallelAttention(" + std::to_string(n_embd_) + ", heads=" + std::to_string(n_head_) +
           ", local heads=" + std::to_string(local_heads_) + ")";
  }
  Generator& attn_dropout_generator() { return attn_gen_; }
  nn::Dropout<T>& resid_dropout() { return *resid_drop_; }

 protected:
  void own_random_streams(std::vector<Generator*>& out) override { out.push_back(&attn_gen_); }

 private:
  std::int64_t n_embd_, n_head_, local_heads_;
  double p_;
  Generator attn_gen_;
  std::shared_ptr<ColumnParallelLinear<T>> c_attn_;
  std::shared_ptr<RowParallelLinear<T>> c_proj_;
  std::shared_ptr<nn::Dropout<T>> resid_drop_;
};

/// GELU MLP with c_fc (C -> 4C) column-parallel and c_proj (4C -> C) row-parallel:
/// the GELU runs on each rank's 4C / tp columns. Names as nn::FeedForward.
template <class T>
class ParallelFeedForward : public nn::Module<T> {
 public:
  ParallelFeedForward(TensorParallelGroup& group, std::int64_t n_embd, double dropout = 0.0,
                      std::uint64_t dropout_seed = 0)
      : n_embd_(n_embd) {
    Generator scratch(0);
    c_fc_ = this->register_module("c_fc", std::make_shared<ColumnParallelLinear<T>>(group, n_embd, 4 * n_embd, true, 1,
                                                                                    scratch));
    act_ = this->register_module("act", std::make_shared<nn::GELU<T>>());
    c_proj_ = this->register_module("c_proj",
                                    std::make_shared<RowParallelLinear<T>>(group, 4 * n_embd, n_embd, true, scratch));
    drop_ = this->register_module(
        "drop", std::make_shared<nn::Dropout<T>>(dropout, detail::residual_dropout_seed(dropout_seed, group)));
  }
  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    auto h = act_->forward(c_fc_->forward(x, cache.child(0)), cache.child(1));
    return drop_->forward(c_proj_->forward(h, cache.child(2)), cache.child(3));
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    auto g = c_proj_->backward(drop_->backward(dy, cache.child(3)), cache.child(2));
    auto dx = c_fc_->backward(act_->backward(g, cache.child(1)), cache.child(0));
    cache.clear();
    return dx;
  }
  std::string describe() const override { return "ParallelFeedForward(" + std::to_string(n_embd_) + ", GELU, 4x)"; }
  nn::Dropout<T>& dropout() { return *drop_; }

 private:
  std::int64_t n_embd_;
  std::shared_ptr<ColumnParallelLinear<T>> c_fc_;
  std::shared_ptr<nn::GELU<T>> act_;
  std::shared_ptr<RowParallelLinear<T>> c_proj_;
  std::shared_ptr<nn::Dropout<T>> drop_;
};

/// nn::TransformerBlock with head-parallel attention and a parallel MLP; the
/// LayerNorms and the residual stream are replicated (cut along the sequence under
/// sequence parallelism, with the LayerNorms' gradients partial).
template <class T>
class TensorParallelBlock : public nn::PreNormBlock<T>, public ShardedModule {
 public:
  TensorParallelBlock(TensorParallelGroup& group, std::int64_t n_embd, std::int64_t n_head, double dropout = 0.0,
                      std::uint64_t dropout_seed = 0)
      : group_(group), n_embd_(n_embd), n_head_(n_head) {
    attn_ = std::make_shared<HeadParallelAttention<T>>(group, n_embd, n_head, dropout, dropout_seed);
    mlp_ = std::make_shared<ParallelFeedForward<T>>(group, n_embd, dropout, dropout_seed + 2);
    ln_1_ = std::make_shared<nn::LayerNorm<T>>(n_embd);
    ln_2_ = std::make_shared<nn::LayerNorm<T>>(n_embd);
    this->set_parts({"ln_1", ln_1_}, {"attn", attn_}, {"ln_2", ln_2_}, {"mlp", mlp_});
  }
  std::vector<std::pair<std::string, ShardSpec>> shard_specs() const override {
    auto specs = detail::sequence_norm_specs(group_, "ln_1", *ln_1_);
    for (auto& s : detail::sequence_norm_specs(group_, "ln_2", *ln_2_)) specs.push_back(s);
    return specs;
  }
  std::string describe() const override {
    return "TensorParallelBlock(" + std::to_string(n_embd_) + ", heads=" + std::to_string(n_head_) + ")";
  }
  HeadParallelAttention<T>& attn() { return *attn_; }
  ParallelFeedForward<T>& mlp() { return *mlp_; }

 private:
  TensorParallelGroup& group_;
  std::int64_t n_embd_, n_head_;
  std::shared_ptr<nn::LayerNorm<T>> ln_1_, ln_2_;
  std::shared_ptr<HeadParallelAttention<T>> attn_;
  std::shared_ptr<ParallelFeedForward<T>> mlp_;
};

namespace detail {

/// Copies this rank's shards of the parameters of `full` (a unit of the full
/// model) into `unit`, its tensor-parallel form; `u` names the unit in errors.
template <class T>
void copy_shards(nn::Module<T>& unit, nn::Module<T>& full, TensorParallelGroup& group, std::size_t u) {
  std::vector<std::pair<std::string, ShardSpec>> specs;
  collect_shard_specs(unit, "", specs);
  auto src = full.named_parameters();
  for (auto& p : unit.named_parameters()) {
    ShardSpec spec;
    for (const auto& [n, sp] : specs)
      if (n == p.name) spec = sp;
    auto it = std::find_if(src.begin(), src.end(), [&](const auto& q) { return q.name == p.name; });
    PTRAIN_CHECK(it != src.end(), Error, "[ptrain.tp.model] unit ", u, " of the full model has no parameter ", p.name,
                 "; build the tensor-parallel model from the same model config");
    p.param->value.copy_(shard_of(it->param->value, spec, group.rank(), group.size()));
  }
}

/// Unit u of nn::GPT (embedding, block u - 1, head) in tensor-parallel form over
/// `group`, holding this rank's shards of `full` (the full unit; null: as built,
/// for a tied head, whose weight is `tied_wte`, the embedding's shard). The block
/// is wrapped in nn::Recompute when cfg.recompute is set.
template <class T>
std::shared_ptr<nn::Module<T>> tensor_parallel_gpt_unit(const nn::GPTConfig& cfg, std::size_t u,
                                                        TensorParallelGroup& group,
                                                        const std::shared_ptr<nn::Module<T>>& full,
                                                        nn::Parameter<T>* tied_wte = nullptr) {
  PTRAIN_CHECK(cfg.n_head % group.size() == 0, Error, "[ptrain.tp.heads] n_head ", cfg.n_head,
               " does not split over ", group.size(), " tensor-parallel ranks; choose a tp degree that divides it");
  std::shared_ptr<nn::Module<T>> unit;
  if (u == 0) {
    unit = std::make_shared<VocabParallelEmbedding<T>>(group, cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.dropout,
                                                       nn::detail::gpt_dropout_site(cfg, 0));
  } else if (u <= static_cast<std::size_t>(cfg.n_layer)) {
    unit = std::make_shared<TensorParallelBlock<T>>(group, cfg.n_embd, cfg.n_head, cfg.dropout,
                                                    nn::detail::gpt_dropout_site(cfg, u));
    if (cfg.recompute) unit = std::make_shared<nn::Recompute<T>>(unit);
  } else {
    unit = std::make_shared<VocabParallelLMHead<T>>(group, cfg.n_embd, cfg.vocab_size, tied_wte);
  }
  if (full) copy_shards(*unit, *full, group, u);
  return unit;
}

}  // namespace detail

}  // namespace ptrain::parallel
