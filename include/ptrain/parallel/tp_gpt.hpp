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
#include "ptrain/parallel/tp_linear.hpp"
#include "ptrain/parallel/tp_vocab.hpp"

namespace ptrain::parallel {

/// nn::TransformerBlock with its attention and MLP split over the group, built from
/// the stock layers: nn::CausalSelfAttention of n_head / tp local heads over a
/// column-parallel c_attn (C -> 3C, cut in 3 blocks, so each rank holds q, k and v
/// of its own heads: [q_local | k_local | v_local]) and a row-parallel c_proj
/// (C -> C); nn::FeedForward over a column-parallel c_fc (C -> 4C) and a
/// row-parallel c_proj (4C -> C), the GELU on each rank's 4C / tp columns. The
/// LayerNorms and the residual stream are replicated (cut along the sequence under
/// sequence parallelism, with the LayerNorms' gradients partial). Names as
/// nn::TransformerBlock.
template <class T>
class TensorParallelBlock : public nn::PreNormBlock<T>, public ShardedModule {
 public:
  TensorParallelBlock(TensorParallelGroup& group, std::int64_t n_embd, std::int64_t n_head, double dropout = 0.0,
                      std::uint64_t dropout_seed = 0)
      : group_(group), n_embd_(n_embd), n_head_(n_head) {
    PTRAIN_CHECK(n_head > 0 && n_embd % n_head == 0 && n_head % group.size() == 0, ShapeError, "[ptrain.tp.heads] ",
                 n_head, " heads (of width ", n_embd, ") do not split over ", group.size(),
                 " tensor-parallel ranks; choose a tp degree that divides n_head");
    Generator scratch(0);  // the real values are copied in (detail::copy_shards)
    auto c_attn = std::make_shared<ColumnParallelLinear<T>>(group, n_embd, 3 * n_embd, true, 3, scratch);
    auto c_proj = std::make_shared<RowParallelLinear<T>>(group, n_embd, n_embd, true, scratch);
    // Each rank draws the attention masks of its own heads: a stream per tp rank.
    attn_ = std::make_shared<nn::CausalSelfAttention<T>>(
        n_embd, n_head / group.size(), c_attn, c_proj, dropout,
        dropout_seed ^ (0xA5A5A5A5ull * static_cast<std::uint64_t>(group.rank())),
        detail::residual_dropout_seed(dropout_seed + 1, group));
    auto c_fc = std::make_shared<ColumnParallelLinear<T>>(group, n_embd, 4 * n_embd, true, 1, scratch);
    auto mlp_proj = std::make_shared<RowParallelLinear<T>>(group, 4 * n_embd, n_embd, true, scratch);
    mlp_ = std::make_shared<nn::FeedForward<T>>(n_embd, c_fc, mlp_proj, dropout,
                                                detail::residual_dropout_seed(dropout_seed + 2, group));
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
  nn::LayerNorm<T>& ln_1() { return *ln_1_; }
  nn::LayerNorm<T>& ln_2() { return *ln_2_; }
  nn::CausalSelfAttention<T>& attn() { return *attn_; }
  nn::FeedForward<T>& mlp() { return *mlp_; }

 private:
  TensorParallelGroup& group_;
  std::int64_t n_embd_, n_head_;
  std::shared_ptr<nn::LayerNorm<T>> ln_1_, ln_2_;
  std::shared_ptr<nn::CausalSelfAttention<T>> attn_;
  std::shared_ptr<nn::FeedForward<T>> mlp_;
};

namespace detail {

/// Moves `unit` to the device of the parameters of `full` (a unit of the full
/// model, all on one device) and copies this rank's shards of them into it; `u`
/// names the unit in errors.
template <class T>
void copy_shards(nn::Module<T>& unit, nn::Module<T>& full, TensorParallelGroup& group, std::size_t u) {
  const auto full_params = full.named_parameters();
  if (!full_params.empty() && !full_params.front().param->value.device().is_cpu())
    unit.to(full_params.front().param->value.device());
  std::vector<std::pair<std::string, ShardSpec>> specs;
  collect_shard_specs(unit, "", specs);
  const auto& src = full_params;
  for (auto& p : unit.named_parameters()) {
    ShardSpec spec;
    for (const auto& [n, sp] : specs)
      if (n == p.name) spec = sp;
    auto it = std::find_if(src.begin(), src.end(), [&](const auto& q) { return q.name == p.name; });
    PTRAIN_CHECK(it != src.end(), Error, "[ptrain.tp.model] unit ", u, " of the full model has no parameter ", p.name,
                 "; build the tensor-parallel model from the same model config");
    p.param->value.copy_(shard_of(it->param->value, spec, group.rank(), group.size()));
    p.param->set_requires_grad(it->param->requires_grad);  // a frozen parameter's shards are frozen
  }
}

/// Unit u of nn::GPT (embedding, block u - 1, head) in tensor-parallel form over
/// `group`, holding this rank's shards of `full` (the full unit; null: as built,
/// for a tied head, whose weight is `tied_wte`, the embedding's shard), on the
/// device of full's parameters. The block is wrapped in nn::Recompute when
/// cfg.recompute is set.
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
