#pragma once
// Llama in tensor-parallel form: unit by unit, the same units and parameter names
// as nn::Llama ("embed_tokens", "layers.i", "head"), each rank holding its shards.
//
//   unit "embed_tokens"  VocabParallelEmbedding     weight by vocabulary rows
//   unit "layers.i"      TensorParallelLlamaBlock   input_layernorm, post_attention_layernorm replicated;
//                                                   self_attn.q_proj by query heads, k_proj and v_proj
//                                                   by key/value heads, o_proj by rows;
//                                                   mlp.gate_proj and up_proj by columns, down_proj by rows;
//                                                   an MoE block's block_sparse_moe whole, on 1/tp of the
//                                                   tokens, its experts over an expert-parallel group
//                                                   (parallel/tp_moe.hpp)
//   unit "head"          VocabParallelLMHead        norm replicated, the (tied) weight by vocabulary rows
//
// Rank r holds query heads [r H/tp, (r+1) H/tp) and key/value heads
// [r Hkv/tp, (r+1) Hkv/tp): since H/tp = (H/Hkv)(Hkv/tp), the query heads of a rank
// read exactly its key/value heads, and nn::GroupedQueryAttention runs on them
// unchanged (rotary, document masking, sliding window). tp must divide n_kv_head
// (Megatron would replicate key/value heads past that; ptrain refuses).
// q, k and v read the same input, and so do gate and up: each pair of regions
// applies f once (ColumnParallelRegion), not once per layer.

#include <memory>
#include <string>

#include "ptrain/nn/models/llama.hpp"
#include "ptrain/parallel/expert_parallel.hpp"
#include "ptrain/parallel/tp_gpt.hpp"
#include "ptrain/parallel/tp_moe.hpp"

namespace ptrain::parallel {

/// nn::LlamaBlock with head-parallel grouped-query attention and a parallel SwiGLU;
/// the RMSNorms and the residual stream are replicated (cut along the sequence under
/// sequence parallelism, with the RMSNorms' gradients partial). Block `layer` of an MoE
/// model (c.is_moe_layer(layer)) runs a TensorParallelMoE instead of the SwiGLU, its
/// experts split over `experts` (Note [Expert parallelism x TP]).
template <class T>
class TensorParallelLlamaBlock : public nn::PreNormBlock<T>, public ShardedModule {
 public:
  TensorParallelLlamaBlock(const nn::LlamaConfig& c, TensorParallelGroup& group, std::int64_t layer = 0,
                           ExpertMesh* experts = nullptr)
      : group_(group) {
    const int tp = group.size();
    PTRAIN_CHECK(c.n_kv_head % tp == 0, Error, "[ptrain.tp.heads] tp = ", tp, " does not divide the ", c.n_kv_head,
                 " key/value heads (of ", c.n_head, " query heads); choose a tp degree that divides n_kv_head");
    PTRAIN_CHECK(c.is_moe_layer(layer) || c.intermediate_size % tp == 0, Error, "[ptrain.tp.divide] tp = ", tp,
                 " does not divide the MLP width ", c.intermediate_size, "; choose a tp degree that divides "
                 "intermediate_size");
    const std::int64_t D = c.head_dim(), C = c.n_embd;
    Generator scratch(0);  // the values are copied in from the full model
    auto column = [&](std::int64_t out, bool bias) {
      auto l = std::make_shared<ColumnParallelLinear<T>>(group, C, out, bias, 1, scratch);
      l->set_f_outside(true);  // ColumnParallelRegion applies f once for the layers that share the input
      return l;
    };
    attn_ = std::make_shared<nn::GroupedQueryAttention<T>>(
        C, c.n_head / tp, c.n_kv_head / tp, D, c.rope, column(c.n_head * D, c.attention_bias),
        column(c.n_kv_head * D, c.attention_bias), column(c.n_kv_head * D, c.attention_bias),
        std::make_shared<RowParallelLinear<T>>(group, c.n_head * D, C, c.o_proj_bias, scratch));
    attn_->set_document_token(c.document_token);
    attn_->set_sliding_window(c.sliding_window);
    norm_1_ = std::make_shared<nn::RMSNorm<T>>(C, c.rms_norm_eps);
    norm_2_ = std::make_shared<nn::RMSNorm<T>>(C, c.rms_norm_eps);
    if (c.is_moe_layer(layer)) {
      PTRAIN_CHECK(experts != nullptr, Error, "[ptrain.tp.moe] layer ", layer, " is a mixture of experts: build it "
                   "through the TensorParallel engine, which makes its expert-parallel groups");
      auto moe = std::make_shared<nn::MoE<T>>(c.moe_config(), scratch);
      shard_experts(*moe, *experts);
      ffn_ = {"block_sparse_moe", std::make_shared<TensorParallelMoE<T>>(group, moe)};
    } else {
      ffn_ = {"mlp", std::make_shared<ColumnParallelRegion<T>>(group, std::make_shared<nn::SwiGLU<T>>(
          C, c.intermediate_size / tp, column(c.intermediate_size, c.mlp_bias), column(c.intermediate_size, c.mlp_bias),
          std::make_shared<RowParallelLinear<T>>(group, c.intermediate_size, C, c.mlp_bias, scratch)))};
    }
    this->set_parts({"input_layernorm", norm_1_}, {"self_attn", std::make_shared<ColumnParallelRegion<T>>(group, attn_)},
                    {"post_attention_layernorm", norm_2_}, ffn_);
  }
  std::vector<std::pair<std::string, ShardSpec>> shard_specs() const override {
    auto specs = detail::sequence_norm_specs(group_, "input_layernorm", *norm_1_);
    for (auto& s : detail::sequence_norm_specs(group_, "post_attention_layernorm", *norm_2_)) specs.push_back(s);
    return specs;
  }
  std::string describe() const override { return "TensorParallelLlamaBlock(tp=" + std::to_string(group_.size()) + ")"; }
  nn::RMSNorm<T>& input_layernorm() { return *norm_1_; }
  /// The attention of this rank's heads (its q, k, v projections with f outside: the block applies f).
  nn::GroupedQueryAttention<T>& self_attn() { return *attn_; }
  nn::RMSNorm<T>& post_attention_layernorm() { return *norm_2_; }
  /// The feed-forward part: "mlp" (a ColumnParallelRegion) or "block_sparse_moe" (a TensorParallelMoE).
  const typename nn::PreNormBlock<T>::Part& ffn() const { return ffn_; }

 private:
  TensorParallelGroup& group_;
  std::shared_ptr<nn::RMSNorm<T>> norm_1_, norm_2_;
  std::shared_ptr<nn::GroupedQueryAttention<T>> attn_;
  typename nn::PreNormBlock<T>::Part ffn_;
};

namespace detail {

/// Unit u of nn::Llama (embedding, layer u - 1, head) in tensor-parallel form over
/// `group`, holding this rank's shards of `full` (the full unit; null: as built,
/// for a tied head, whose weight is `tied_weight`, the embedding's shard), on the
/// device of full's parameters. The layer is wrapped in nn::Recompute when
/// cfg.recompute is set. An MoE layer's experts are split over `experts`.
template <class T>
std::shared_ptr<nn::Module<T>> tensor_parallel_llama_unit(const nn::LlamaConfig& cfg, std::size_t u,
                                                          TensorParallelGroup& group,
                                                          const std::shared_ptr<nn::Module<T>>& full,
                                                          nn::Parameter<T>* tied_weight = nullptr,
                                                          ExpertMesh* experts = nullptr) {
  std::shared_ptr<nn::Module<T>> unit;
  if (u == 0) {
    unit = std::make_shared<VocabParallelEmbedding<T>>(group, cfg.vocab_size, cfg.n_embd);
  } else if (u <= static_cast<std::size_t>(cfg.n_layer)) {
    unit = std::make_shared<TensorParallelLlamaBlock<T>>(cfg, group, static_cast<std::int64_t>(u) - 1, experts);
    if (cfg.recompute) unit = std::make_shared<nn::Recompute<T>>(unit);
  } else {
    unit = std::make_shared<VocabParallelLMHead<T, nn::RMSNorm<T>>>(
        group, std::make_shared<nn::RMSNorm<T>>(cfg.n_embd, cfg.rms_norm_eps), "norm", cfg.n_embd, cfg.vocab_size,
        tied_weight);
  }
  if (full) copy_shards(*unit, *full, group, u);
  return unit;
}

}  // namespace detail
}  // namespace ptrain::parallel
