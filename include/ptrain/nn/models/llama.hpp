#pragma once
// Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) as an ordered list of
// units, like nn::GPT:
//
//   unit 0        "embed_tokens"  Embedding               ids [B, S] -> [B, S, C]
//   unit 1..L     "layers.i"      LlamaBlock              [B, S, C] -> [B, S, C]
//                                 (in a Recompute wrapper with cfg.recompute)
//   unit L+1      "head"          LMHead (norm + lm_head)  [B, S, C] -> logits [B, S, V]
//
//   LlamaBlock:  h = x + self_attn(input_layernorm(x))        RMSNorm, grouped-query attention
//               y = h + mlp(post_attention_layernorm(h))      with rotary positions, SwiGLU
//
// With cfg.num_experts > 0, every cfg.moe_every-th block's MLP is a mixture of
// experts, nn::MoE, named "block_sparse_moe" as in Mixtral (docs/moe.md).
//
// Parameter names are Hugging Face's without the "model." prefix ("embed_tokens.weight",
// "layers.0.self_attn.q_proj.weight", ...), but for the head's "head.norm.weight" and
// "head.lm_head.weight" (HF: "model.norm.weight", "lm_head.weight");
// nn/models/llama_weights.hpp maps the two ways. Every unit is a Module<T>, so DDP,
// FSDP (a unit per block), the pipeline and activation checkpointing take the model
// as they take GPT. Packed documents (cfg.document_token) and positions reach the
// attention through the cache's batch context (Note [Batch context]). CPU only, float
// or double (the grouped-query attention kernels).
//
//   nn::LlamaConfig cfg = nn::LlamaConfig::from_hf_config_file("SmolLM-135M/config.json");
//   auto model = std::make_shared<nn::Llama<float>>(cfg);
//   nn::Cache<float> cache;
//   auto logits = model->forward_tokens(ids, cache);    // ids int32 [B, S]

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "ptrain/nn/embedding.hpp"
#include "ptrain/nn/gqa_attention.hpp"
#include "ptrain/nn/models/gpt.hpp"
#include "ptrain/nn/moe.hpp"
#include "ptrain/nn/recompute.hpp"
#include "ptrain/nn/rms_norm.hpp"
#include "ptrain/nn/sequential.hpp"
#include "ptrain/nn/swiglu.hpp"
#include "ptrain/nn/transformer_block.hpp"

namespace ptrain::nn {

/// Llama-family hyperparameters; from_hf_config() reads a Hugging Face config.json.
struct LlamaConfig {
  std::int64_t vocab_size = 32000;
  std::int64_t n_layer = 2;
  std::int64_t n_head = 4;
  std::int64_t n_kv_head = 4;            ///< key/value heads; divides n_head (1: multi-query)
  std::int64_t n_embd = 256;             ///< hidden_size
  std::int64_t intermediate_size = 688;  ///< SwiGLU hidden width
  std::int64_t max_seq_len = 2048;       ///< max_position_embeddings: the longest context generate() feeds
  double rms_norm_eps = 1e-5;
  ops::RotaryConfig rope = {};           ///< rope_theta and Llama 3's rope_scaling
  bool tie_weights = false;              ///< tie_word_embeddings (Note [Weight tying] in gpt.hpp)
  bool attention_bias = false;           ///< q/k/v (and Llama's o_proj) biases: Qwen2 has q/k/v biases
  bool o_proj_bias = false;              ///< Llama's attention_bias also gives o_proj a bias
  bool mlp_bias = false;
  std::int64_t sliding_window = 0;       ///< Mistral's: sequences up to it only (0: none; see from_hf_config)
  std::int32_t document_token = -1;      ///< a token that starts each packed document (-1: none; Note [Batch context])
  double init_std = 0.02;                ///< initializer_range
  bool recompute = false;                ///< activation checkpointing per block (nn/recompute.hpp)
  // Mixture of experts (docs/moe.md): with num_experts > 0, layer l's MLP is an nn::MoE
  // when (l + 1) % moe_every == 0 (every layer for 1, every second for 2: Qwen2-MoE's
  // decoder_sparse_step); its router and experts come from these fields (moe_config()).
  std::int64_t num_experts = 0;            ///< 0: dense MLPs only
  std::int64_t top_k = 2;                  ///< experts per token (num_experts_per_tok)
  std::int64_t moe_every = 1;
  std::int64_t moe_intermediate_size = 0;  ///< each expert's SwiGLU width; 0: intermediate_size
  std::int64_t moe_shared_size = 0;        ///< the shared experts' width; 0: none
  double moe_capacity_factor = 0;          ///< 0: dropless
  double moe_aux_loss_coef = 0;            ///< router_aux_loss_coef
  double moe_z_loss_coef = 0;

  std::int64_t head_dim() const { return n_embd / n_head; }
  bool is_moe_layer(std::int64_t l) const { return num_experts > 0 && (l + 1) % moe_every == 0; }
  std::int64_t moe_layers() const {
    std::int64_t n = 0;
    for (std::int64_t l = 0; l < n_layer; ++l) n += is_moe_layer(l) ? 1 : 0;
    return n;
  }
  /// The nn::MoE of an MoE layer (softmax, top-k, renormalised: Mixtral's router).
  MoeConfig moe_config() const {
    MoeConfig m;
    m.n_embd = n_embd;
    m.num_experts = num_experts;
    m.top_k = top_k;
    m.expert_hidden = moe_intermediate_size > 0 ? moe_intermediate_size : intermediate_size;
    m.capacity_factor = moe_capacity_factor;
    m.aux_loss_coef = moe_aux_loss_coef;
    m.z_loss_coef = moe_z_loss_coef;
    m.shared_hidden = moe_shared_size;
    return m;
  }

  /// Parameters of the model built from this config (a tied weight counted once).
  std::int64_t num_parameters() const {
    const std::int64_t C = n_embd, D = head_dim(), F = intermediate_size;
    const std::int64_t attn = C * n_head * D + 2 * C * n_kv_head * D + n_head * D * C +
                              (attention_bias ? n_head * D + 2 * n_kv_head * D : 0) + (o_proj_bias ? C : 0);
    const std::int64_t mlp = 3 * C * F + (mlp_bias ? 2 * F + C : 0);
    const std::int64_t Fm = num_experts > 0 ? moe_config().expert_hidden : 0;
    const std::int64_t moe = num_experts * C + 3 * num_experts * C * Fm + 3 * C * moe_shared_size;
    const std::int64_t L_moe = moe_layers();
    return vocab_size * C + n_layer * (attn + 2 * C) + (n_layer - L_moe) * mlp + L_moe * moe + C +
           (tie_weights ? 0 : vocab_size * C);
  }
  /// Training FLOPs per token (forward + backward) of the matrix products, counting the
  /// causal attention products at full S x S (the usual convention, as GPTConfig's).
  double flops_per_token(std::int64_t seq) const {
    const double C = static_cast<double>(n_embd), D = static_cast<double>(head_dim()), L = static_cast<double>(n_layer);
    const double H = static_cast<double>(n_head), Hkv = static_cast<double>(n_kv_head);
    const double per_layer = C * H * D * 2 + 2 * C * Hkv * D + 3 * C * static_cast<double>(intermediate_size);
    // An MoE layer's token runs the router and k experts (and the shared ones) instead of the MLP.
    const double L_moe = static_cast<double>(moe_layers());
    const double moe_mlp = num_experts > 0 ? C * static_cast<double>(num_experts) +
                                                 3 * C * static_cast<double>(top_k * moe_config().expert_hidden +
                                                                             moe_shared_size) -
                                                 3 * C * static_cast<double>(intermediate_size)
                                           : 0.0;
    const double matmul = L * per_layer + L_moe * moe_mlp + C * static_cast<double>(vocab_size);
    return 6.0 * matmul + 6.0 * L * 2.0 * static_cast<double>(seq) * H * D;
  }

  /// A Hugging Face config.json of LlamaForCausalLM, MistralForCausalLM,
  /// MixtralForCausalLM or Qwen2ForCausalLM; what the layers cannot do is refused by name.
  static LlamaConfig from_hf_config(const nlohmann::json& j);
  static LlamaConfig from_hf_config_file(const std::filesystem::path& path);
  /// config.json for LlamaForCausalLM (Qwen2ForCausalLM when q/k/v have biases and
  /// o_proj has none, MistralForCausalLM with a sliding window, MixtralForCausalLM with
  /// experts: Note [Mixtral configs]), which transformers' from_pretrained reads.
  nlohmann::json to_hf_config() const;
};

/// Llama's decoder layer: h = x + self_attn(input_layernorm(x)),
/// y = h + mlp(post_attention_layernorm(h)).
template <class T>
class LlamaBlock : public PreNormBlock<T> {
 public:
  /// Block `layer` of the model (its MLP is an nn::MoE when c.is_moe_layer(layer)).
  LlamaBlock(const LlamaConfig& c, Generator& gen = default_generator(), std::int64_t layer = 0) {
    input_norm_ = std::make_shared<RMSNorm<T>>(c.n_embd, c.rms_norm_eps);
    attn_ = std::make_shared<GroupedQueryAttention<T>>(c.n_embd, c.n_head, c.n_kv_head, c.rope, c.attention_bias,
                                                       c.o_proj_bias, gen);
    attn_->set_document_token(c.document_token);
    attn_->set_sliding_window(c.sliding_window);
    post_norm_ = std::make_shared<RMSNorm<T>>(c.n_embd, c.rms_norm_eps);
    if (c.is_moe_layer(layer)) {
      ffn_ = moe_ = std::make_shared<MoE<T>>(c.moe_config(), gen);
    } else {
      ffn_ = mlp_ = std::make_shared<SwiGLU<T>>(c.n_embd, c.intermediate_size, c.mlp_bias, gen);
    }
    this->set_parts({"input_layernorm", input_norm_}, {"self_attn", attn_},
                    {"post_attention_layernorm", post_norm_}, {moe_ ? "block_sparse_moe" : "mlp", ffn_});
  }

  /// PreNormBlock's wiring with the first residual add fused into the second norm
  /// (ops::residual_rms_norm: h = x + attn(...) and post_attention_layernorm(h) in one
  /// kernel); on the CPU the same bits as the add followed by the norm.
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    auto a = attn_->forward(input_norm_->forward(x, cache.child(0)), cache.child(1));
    Tensor<T> h;
    Tensor<acc_t<T>> rstd;
    auto n2 = ops::residual_rms_norm(x, a, post_norm_->weight().value, static_cast<acc_t<T>>(post_norm_->eps()), h,
                                     rstd);
    Cache<T>& norm_cache = cache.child(2);  // what post_attention_layernorm's own forward keeps
    norm_cache.tensors = {h};
    norm_cache.stats = {rstd};
    auto y = ffn_->forward(n2, cache.child(3));
    ops::axpy_(1, h, y);
    return y;
  }

  /// The residual stream's gradient dy joins the norm's in one kernel
  /// (ops::residual_rms_norm_backward: dh = post_attention_layernorm'(dmlp) + dy).
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    Cache<T>& norm_cache = cache.child(2);
    PTRAIN_CHECK(norm_cache.tensors.size() == 1 && norm_cache.stats.size() == 1, Error,
                 "[ptrain.backward] LlamaBlock::backward without a forward");
    auto dn2 = ffn_->backward(dy, cache.child(3));
    Parameter<T>& w = post_norm_->weight();
    auto dh = ops::residual_rms_norm_backward(norm_cache.tensors[0], norm_cache.stats[0], w.value, dn2, dy, w.grad);
    w.mark_grad_ready();
    norm_cache.clear();
    auto dx = input_norm_->backward(attn_->backward(dh, cache.child(1)), cache.child(0));
    ops::axpy_(1, dh, dx);
    cache.clear();
    return dx;
  }

  /// Generation: x [1, s, C], the next s tokens after kv.length (GroupedQueryAttention::decode).
  Tensor<T> decode(const Tensor<T>& x, KVCache<T>& kv, std::int64_t capacity) {
    Cache<T> scratch;  // no backward
    auto h = attn_->decode(input_norm_->forward(x, scratch.child(0)), kv, capacity);
    ops::axpy_(1, x, h);
    auto y = ffn_->forward(post_norm_->forward(h, scratch.child(1)), scratch.child(2));
    ops::axpy_(1, h, y);
    return y;
  }

  std::string describe() const override { return "LlamaBlock(" + attn_->describe() + ", " + ffn_->describe() + ")"; }
  RMSNorm<T>& input_layernorm() { return *input_norm_; }
  GroupedQueryAttention<T>& self_attn() { return *attn_; }
  RMSNorm<T>& post_attention_layernorm() { return *post_norm_; }
  /// The dense MLP; refused for an MoE block (moe()).
  SwiGLU<T>& mlp() {
    PTRAIN_CHECK(mlp_ != nullptr, Error, "[ptrain.llama.moe] this block's MLP is a mixture of experts: use moe()");
    return *mlp_;
  }
  /// The mixture of experts, or null for a dense block.
  MoE<T>* moe() { return moe_.get(); }

 private:
  std::shared_ptr<RMSNorm<T>> input_norm_, post_norm_;
  std::shared_ptr<GroupedQueryAttention<T>> attn_;
  std::shared_ptr<SwiGLU<T>> mlp_;
  std::shared_ptr<MoE<T>> moe_;
  std::shared_ptr<Module<T>> ffn_;  // mlp_ or moe_
};

namespace detail {

inline void check_llama_config(const LlamaConfig& c) {
  PTRAIN_CHECK(c.vocab_size > 0 && c.n_layer >= 0 && c.n_embd > 0 && c.intermediate_size > 0 && c.max_seq_len > 0,
               Error, "[ptrain.llama.config] vocab_size, n_embd, intermediate_size and max_seq_len must be positive "
               "and n_layer >= 0");
  PTRAIN_CHECK(c.n_head > 0 && c.n_embd % c.n_head == 0, Error, "[ptrain.llama.config] n_embd ", c.n_embd,
               " must be divisible by n_head ", c.n_head);
  PTRAIN_CHECK(c.n_kv_head > 0 && c.n_head % c.n_kv_head == 0, Error, "[ptrain.llama.config] n_kv_head ",
               c.n_kv_head, " must divide n_head ", c.n_head);
  PTRAIN_CHECK(c.head_dim() % 2 == 0, Error, "[ptrain.llama.config] the head width ", c.head_dim(),
               " must be even for rotary positions");
  PTRAIN_CHECK(c.sliding_window >= 0, Error, "[ptrain.llama.config] sliding_window ", c.sliding_window,
               " must be >= 0 (0: none)");
  PTRAIN_CHECK(c.document_token < c.vocab_size, Error, "[ptrain.llama.config] document_token ", c.document_token,
               " is outside the vocabulary of ", c.vocab_size);
  PTRAIN_CHECK(c.num_experts >= 0 && c.moe_every >= 1 && c.moe_intermediate_size >= 0, Error,
               "[ptrain.llama.config] num_experts and moe_intermediate_size must be >= 0 and moe_every >= 1");
  if (c.num_experts > 0) detail::check_moe_config(c.moe_config());
}

// Hugging Face's LlamaPreTrainedModel._init_weights: every Linear and Embedding weight
// ~ N(0, initializer_range), biases 0, RMSNorm weights 1; drawn in named_parameters() order.
template <class T>
void init_llama_unit(Module<T>& unit, const LlamaConfig& cfg, Generator& gen) {
  for (auto& p : unit.named_parameters()) {
    if (p.name.find("norm.") != std::string::npos) continue;
    if (ends_with(p.name, ".bias")) ops::fill_(p.param->value, T(0));
    else ops::normal_(p.param->value, 0.0, cfg.init_std, gen);
  }
}

}  // namespace detail

/// Llama: ids [B, S] -> logits [B, S, vocab].
template <class T>
class Llama : public UnitChain<T> {
 public:
  using Head = LMHead<T, RMSNorm<T>>;

  /// Hugging Face's initialisation from `gen` (detail::init_llama_unit), in
  /// named_parameters() order.
  explicit Llama(const LlamaConfig& cfg, Generator& gen = default_generator()) : cfg_(cfg) {
    detail::check_llama_config(cfg);
    Generator scratch(0);  // the modules' own default init, replaced below
    embed_ = std::make_shared<Embedding<T>>(cfg.vocab_size, cfg.n_embd, scratch);
    this->add_unit("embed_tokens", embed_);
    for (std::int64_t l = 0; l < cfg.n_layer; ++l) {
      blocks_.push_back(std::make_shared<LlamaBlock<T>>(cfg, scratch, l));
      std::shared_ptr<Module<T>> unit = blocks_.back();
      if (cfg.recompute) unit = std::make_shared<Recompute<T>>(unit);
      this->add_unit("layers." + std::to_string(l), unit);
    }
    head_ = std::make_shared<Head>(std::make_shared<RMSNorm<T>>(cfg.n_embd, cfg.rms_norm_eps), "norm", cfg.n_embd,
                                   cfg.vocab_size, cfg.tie_weights ? &embed_->weight() : nullptr, scratch);
    this->add_unit("head", head_);
    for (auto& u : this->units()) detail::init_llama_unit(*u, cfg, gen);
  }

  std::string describe() const override {
    return "Llama(vocab=" + std::to_string(cfg_.vocab_size) + ", layers=" + std::to_string(cfg_.n_layer) +
           ", heads=" + std::to_string(cfg_.n_head) + ", kv_heads=" + std::to_string(cfg_.n_kv_head) +
           ", embd=" + std::to_string(cfg_.n_embd) + ", mlp=" + std::to_string(cfg_.intermediate_size) +
           (cfg_.num_experts > 0 ? ", experts=" + std::to_string(cfg_.num_experts) + " top_k=" +
                                       std::to_string(cfg_.top_k) + " every=" + std::to_string(cfg_.moe_every)
                                 : std::string()) +
           (cfg_.tie_weights ? ", tied)" : ")");
  }
  const LlamaConfig& config() const { return cfg_; }
  /// The auxiliary losses of the latest forward, with their coefficients: the sum of
  /// every MoE layer's stats().loss (0 for a dense model). Backward adds their
  /// gradient; add this value to the cross entropy to report the loss trained.
  double moe_loss() {
    double sum = 0;
    for (auto& b : blocks_)
      if (b->moe()) sum += b->moe()->stats().loss;
    return sum;
  }
  Embedding<T>& embedding() { return *embed_; }
  LlamaBlock<T>& block(std::size_t i) { return *blocks_.at(i); }
  Head& head() { return *head_; }
  bool tied() const { return head_->tied(); }

 private:
  LlamaConfig cfg_;
  std::shared_ptr<Embedding<T>> embed_;
  std::vector<std::shared_ptr<LlamaBlock<T>>> blocks_;
  std::shared_ptr<Head> head_;
};

/// Weight-decay filter for a Llama (pass to optim::AdamW): decay for the matrices of
/// the projections, none for biases, RMSNorm weights and the token embedding.
inline std::function<bool(const std::string&)> llama_decay_filter() {
  return [](const std::string& name) {
    return !(detail::ends_with(name, ".bias") || name.find("norm.") != std::string::npos ||
             name.find("embed_tokens.") != std::string::npos);
  };
}


/// Continues `prompt` by max_new_tokens tokens with a KV cache: the prompt runs
/// once, then each step runs the new token alone against the cached keys and
/// values (GroupedQueryAttention::decode). The context is at most
/// cfg.max_seq_len tokens; when it is full, the cache restarts from the last
/// max_seq_len / 2 tokens. Sampling as GPT's generate (sample_logits: temperature,
/// top_k, vocab_limit, one uniform per token from gen); evaluation mode, restored after.
/// The model may be on any device (ids go there, the last row of logits comes back).
template <class T>
std::vector<std::int32_t> generate(Llama<T>& model, std::vector<std::int32_t> prompt, std::int64_t max_new_tokens,
                                   double temperature, std::int64_t top_k, Generator& gen,
                                   std::int64_t vocab_limit = 0) {
  PTRAIN_CHECK(!prompt.empty(), Error, "[ptrain.sample] the prompt needs at least one token");
  const LlamaConfig& c = model.config();
  const std::int64_t V = c.vocab_size, context = c.sliding_window > 0 ? std::min(c.max_seq_len, c.sliding_window)
                                                                        : c.max_seq_len;
  const bool was_training = model.training();
  model.train(false);
  const Device device = model.named_parameters().front().param->value.device();
  std::vector<KVCache<T>> kv;
  std::size_t fed = 0;  // prompt[0 .. fed) is in the cache
  std::vector<double> last(static_cast<std::size_t>(V));
  for (std::int64_t n = 0; n < max_new_tokens; ++n) {
    if (kv.empty() || static_cast<std::int64_t>(prompt.size() - fed) + kv[0].length > context) {
      // (Re)start: the last tokens that fit, keeping room to grow.
      const std::int64_t keep = std::min<std::int64_t>(static_cast<std::int64_t>(prompt.size()),
                                                       kv.empty() ? context : std::max<std::int64_t>(1, context / 2));
      kv.assign(model.config().n_layer, KVCache<T>{});
      fed = prompt.size() - static_cast<std::size_t>(keep);
    }
    const std::vector<std::int32_t> fresh(prompt.begin() + static_cast<std::ptrdiff_t>(fed), prompt.end());
    const auto s = static_cast<std::int64_t>(fresh.size());
    Cache<T> scratch;
    auto h = model.embedding().forward_tokens(Tensor<std::int32_t>::from(fresh, {1, s}).to(device), scratch.child(0));
    for (std::int64_t l = 0; l < c.n_layer; ++l)
      h = model.block(static_cast<std::size_t>(l)).decode(h, kv[static_cast<std::size_t>(l)], context);
    fed = prompt.size();
    const auto logits = model.head().forward(h.view((s - 1) * c.n_embd, {1, 1, c.n_embd}), scratch.child(1))
                            .to(Device::cpu());
    for (std::int64_t v = 0; v < V; ++v) last[static_cast<std::size_t>(v)] = static_cast<acc_t<T>>(logits.data()[v]);
    prompt.push_back(sample_logits(last.data(), vocab_limit > 0 ? std::min(vocab_limit, V) : V, temperature, top_k,
                                   gen.uniform()));
  }
  model.train(was_training);
  return prompt;
}

// ---- Hugging Face config.json ----

namespace detail {
template <class V>
V hf_get(const nlohmann::json& j, const char* key, V fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  try {
    return j[key].get<V>();
  } catch (const nlohmann::json::exception& e) {
    PTRAIN_THROW(Error, "[ptrain.llama.hf_config] \"", key, "\" has an unexpected type: ", e.what());
  }
}
template <class V>
V hf_require(const nlohmann::json& j, const char* key) {
  PTRAIN_CHECK(j.contains(key) && !j[key].is_null(), Error, "[ptrain.llama.hf_config] config.json has no \"", key,
               "\"; is it a Llama-family model's config?");
  return hf_get<V>(j, key, V{});
}
}  // namespace detail

// Note [Mixtral configs]
// MixtralForCausalLM (model_type "mixtral") is nn::Llama with an nn::MoE in every
// layer: num_local_experts -> num_experts, num_experts_per_tok -> top_k, each
// expert's SwiGLU intermediate_size wide, no biases, Mistral's sliding_window. Its
// router is MoeConfig's default (softmax over all experts, top-k, renormalised).
// router_aux_loss_coef -> moe_aux_loss_coef when output_router_logits is true (the
// only case in which transformers adds the loss), else 0; written back as the
// coefficient with output_router_logits = coefficient > 0. What config.json cannot
// hold is refused when writing (moe_every != 1, shared experts, an expert width other
// than intermediate_size, biases); the capacity factor and the z-loss coefficient are
// training settings that Mixtral has no field for: they are not written.
namespace detail {
inline nlohmann::json mixtral_hf_config(const LlamaConfig& c) {
  PTRAIN_CHECK(c.moe_every == 1, Error, "[ptrain.llama.hf_config] moe_every ", c.moe_every,
               " cannot be written as a Mixtral config.json: Mixtral has a mixture of experts in every layer "
               "(moe_every 1)");
  PTRAIN_CHECK(c.moe_shared_size == 0, Error, "[ptrain.llama.hf_config] shared experts (moe_shared_size ",
               c.moe_shared_size, ") cannot be written as a Mixtral config.json: Mixtral has none");
  PTRAIN_CHECK(c.moe_intermediate_size == 0 || c.moe_intermediate_size == c.intermediate_size, Error,
               "[ptrain.llama.hf_config] moe_intermediate_size ", c.moe_intermediate_size,
               " cannot be written as a Mixtral config.json: its experts are intermediate_size (",
               c.intermediate_size, ") wide; set moe_intermediate_size to 0");
  PTRAIN_CHECK(!c.attention_bias && !c.o_proj_bias && !c.mlp_bias, Error,
               "[ptrain.llama.hf_config] biases cannot be written as a Mixtral config.json: Mixtral has none");
  PTRAIN_CHECK(!c.rope.llama3_scaling, Error,
               "[ptrain.llama.hf_config] Llama 3 rope scaling cannot be written as a Mixtral config.json");
  return {{"architectures", {"MixtralForCausalLM"}},
          {"model_type", "mixtral"},
          {"vocab_size", c.vocab_size},
          {"hidden_size", c.n_embd},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.n_layer},
          {"num_attention_heads", c.n_head},
          {"num_key_value_heads", c.n_kv_head},
          {"max_position_embeddings", c.max_seq_len},
          {"rms_norm_eps", c.rms_norm_eps},
          {"rope_theta", c.rope.theta},
          {"tie_word_embeddings", c.tie_weights},
          {"hidden_act", "silu"},
          {"initializer_range", c.init_std},
          {"torch_dtype", "float32"},
          {"sliding_window", c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json()},
          {"num_local_experts", c.num_experts},
          {"num_experts_per_tok", c.top_k},
          {"router_aux_loss_coef", c.moe_aux_loss_coef},
          {"output_router_logits", c.moe_aux_loss_coef > 0}};
}
}  // namespace detail

inline LlamaConfig LlamaConfig::from_hf_config(const nlohmann::json& j) {
  PTRAIN_CHECK(j.is_object(), Error, "[ptrain.llama.hf_config] config.json must hold a JSON object");
  const std::string type = detail::hf_get<std::string>(j, "model_type", "");
  PTRAIN_CHECK(type == "llama" || type == "mistral" || type == "qwen2" || type == "mixtral", Error,
               "[ptrain.llama.hf_config] model_type \"", type, "\" is not supported; nn::Llama reads llama, "
               "mistral, mixtral and qwen2 configs");
  const std::string act = detail::hf_get<std::string>(j, "hidden_act", "silu");
  PTRAIN_CHECK(act == "silu", Error, "[ptrain.llama.hf_config] hidden_act \"", act,
               "\" is not supported; the SwiGLU MLP uses silu");
  LlamaConfig c;
  c.vocab_size = detail::hf_require<std::int64_t>(j, "vocab_size");
  c.n_embd = detail::hf_require<std::int64_t>(j, "hidden_size");
  c.intermediate_size = detail::hf_require<std::int64_t>(j, "intermediate_size");
  c.n_layer = detail::hf_require<std::int64_t>(j, "num_hidden_layers");
  c.n_head = detail::hf_require<std::int64_t>(j, "num_attention_heads");
  c.n_kv_head = detail::hf_get<std::int64_t>(j, "num_key_value_heads", c.n_head);
  c.max_seq_len = detail::hf_get<std::int64_t>(j, "max_position_embeddings", 2048);
  c.rms_norm_eps = detail::hf_get<double>(j, "rms_norm_eps", 1e-6);
  c.rope.theta = detail::hf_get<double>(j, "rope_theta", 10000.0);
  c.tie_weights = detail::hf_get<bool>(j, "tie_word_embeddings", false);
  c.init_std = detail::hf_get<double>(j, "initializer_range", 0.02);
  if (type == "qwen2") {
    c.attention_bias = true;  // Qwen2's q/k/v projections always have biases, o_proj none
    PTRAIN_CHECK(!detail::hf_get<bool>(j, "use_sliding_window", false), Error,
                 "[ptrain.llama.hf_config] use_sliding_window is not supported (sliding-window attention); "
                 "set it to false to train with full causal attention");
  } else {
    c.attention_bias = c.o_proj_bias = detail::hf_get<bool>(j, "attention_bias", false);
    c.mlp_bias = detail::hf_get<bool>(j, "mlp_bias", false);
  }
  // Mistral's sliding window: each query sees its last sliding_window keys, itself
  // included, as Hugging Face's mask (Note [Sliding window] in kernels/cpu/gqa_attention.hpp).
  if (type == "mistral" || type == "mixtral") c.sliding_window = detail::hf_get<std::int64_t>(j, "sliding_window", 0);
  if (type == "mixtral") {
    // Note [Mixtral configs]: every layer's MLP is a mixture of experts of
    // intermediate_size each; softmax over all experts, top-k, renormalised.
    c.attention_bias = c.o_proj_bias = c.mlp_bias = false;
    c.num_experts = detail::hf_get<std::int64_t>(j, "num_local_experts", 8);
    c.top_k = detail::hf_get<std::int64_t>(j, "num_experts_per_tok", 2);
    c.moe_every = 1;
    // transformers adds the load-balancing loss only with output_router_logits.
    if (detail::hf_get<bool>(j, "output_router_logits", false))
      c.moe_aux_loss_coef = detail::hf_get<double>(j, "router_aux_loss_coef", 0.001);
    PTRAIN_CHECK(detail::hf_get<double>(j, "router_jitter_noise", 0.0) == 0.0, Error,
                 "[ptrain.llama.hf_config] router_jitter_noise is not supported (the router has no noise); "
                 "set it to 0");
  }
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    const auto hd = detail::hf_get<std::int64_t>(j, "head_dim", 0);
    PTRAIN_CHECK(c.n_head > 0 && hd * c.n_head == c.n_embd, Error, "[ptrain.llama.hf_config] head_dim ", hd,
                 " times num_attention_heads ", c.n_head, " differs from hidden_size ", c.n_embd,
                 "; such models are not supported");
  }
  for (const char* key : {"attention_dropout", "hidden_dropout"})
    PTRAIN_CHECK(detail::hf_get<double>(j, key, 0.0) == 0.0, Error, "[ptrain.llama.hf_config] ", key,
                 " must be 0: Llama-family layers have no dropout");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const auto& s = j["rope_scaling"];
    const std::string kind = detail::hf_get<std::string>(s, "rope_type", detail::hf_get<std::string>(s, "type", ""));
    PTRAIN_CHECK(kind == "llama3" || kind == "default", Error, "[ptrain.llama.hf_config] rope_scaling type \"", kind,
                 "\" is not supported; ptrain has Llama 3's (\"llama3\") and plain rotary positions");
    if (kind == "llama3") {
      ops::Llama3RopeScaling sc;
      sc.factor = detail::hf_require<double>(s, "factor");
      sc.low_freq_factor = detail::hf_get<double>(s, "low_freq_factor", sc.low_freq_factor);
      sc.high_freq_factor = detail::hf_get<double>(s, "high_freq_factor", sc.high_freq_factor);
      sc.original_max_position_embeddings =
          detail::hf_get<std::int64_t>(s, "original_max_position_embeddings", sc.original_max_position_embeddings);
      c.rope.llama3_scaling = sc;
    }
  }
  detail::check_llama_config(c);
  return c;
}

inline LlamaConfig LlamaConfig::from_hf_config_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  PTRAIN_CHECK(in.good(), Error, "[ptrain.llama.hf_config] cannot open ", path.string(),
               "; give the path of a Hugging Face config.json");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    PTRAIN_THROW(Error, "[ptrain.llama.hf_config] ", path.string(), " is not valid JSON: ", e.what());
  }
  return from_hf_config(j);
}

inline nlohmann::json LlamaConfig::to_hf_config() const {
  if (num_experts > 0) return detail::mixtral_hf_config(*this);
  const bool qwen2 = attention_bias && !o_proj_bias, mistral = sliding_window > 0;
  nlohmann::json j = {
      {"architectures", {qwen2 ? "Qwen2ForCausalLM" : mistral ? "MistralForCausalLM" : "LlamaForCausalLM"}},
      {"model_type", qwen2 ? "qwen2" : mistral ? "mistral" : "llama"},
      {"vocab_size", vocab_size},
      {"hidden_size", n_embd},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", n_layer},
      {"num_attention_heads", n_head},
      {"num_key_value_heads", n_kv_head},
      {"max_position_embeddings", max_seq_len},
      {"rms_norm_eps", rms_norm_eps},
      {"rope_theta", rope.theta},
      {"tie_word_embeddings", tie_weights},
      {"hidden_act", "silu"},
      {"initializer_range", init_std},
      {"torch_dtype", "float32"},
  };
  if (qwen2) {
    j["use_sliding_window"] = false;
  } else if (mistral) {
    j["sliding_window"] = sliding_window;
  } else {
    j["attention_bias"] = attention_bias;
    j["mlp_bias"] = mlp_bias;
  }
  if (rope.llama3_scaling) {
    const auto& s = *rope.llama3_scaling;
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", s.factor},
                         {"low_freq_factor", s.low_freq_factor},
                         {"high_freq_factor", s.high_freq_factor},
                         {"original_max_position_embeddings", s.original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  return j;
}

}  // namespace ptrain::nn
