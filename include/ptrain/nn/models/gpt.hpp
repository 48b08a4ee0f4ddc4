#pragma once
// GPT (GPT-2 architecture) as an ordered list of units:
//
//   unit 0        "embed"   TokenPositionEmbedding  ids [B, S] -> [B, S, C]
//   unit 1..L     "h.i"     TransformerBlock        [B, S, C] -> [B, S, C]
//                           (in a Recompute wrapper with cfg.recompute)
//   unit L+1      "head"    LMHead (ln_f + lm_head) [B, S, C] -> logits [B, S, V]
//
// Every unit is a Module<T>, so wrappers split the model without special
// cases: FSDP wraps each unit, a pipeline cuts between units. Token ids enter
// unit 0 as integral T values (see nn/embedding.hpp).
//
//   GPTConfig cfg{.vocab_size = 65, .block_size = 128, .n_layer = 4, .n_head = 4, .n_embd = 128};
//   nn::GPT<float> model(cfg);
//   nn::Cache<float> cache;
//   auto logits = model.forward(ids, cache);              // ids [B, S] as float
//
// Note [Weight tying]
// With tie_weights the LM head multiplies by the token embedding wte
// ([V, C]): the head holds a pointer to the embedding unit's Parameter and
// owns no weight of its own, so named_parameters() lists the weight once, as
// "embed.wte.weight". Backward runs the head first: it adds dlogits^T h to
// wte's gradient and does not announce it; the embedding unit, whose backward
// runs last, adds the lookup part and calls mark_grad_ready() once. The head
// reports the weight through borrowed_parameters(): FSDP then keeps the two
// units in one group; a pipeline that would put them on different ranks
// refuses a tied model ([ptrain.pipeline.tied]; build with tie_weights = false).

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "ptrain/nn/embedding.hpp"
#include "ptrain/nn/layer_norm.hpp"
#include "ptrain/nn/recompute.hpp"
#include "ptrain/nn/sequential.hpp"
#include "ptrain/nn/transformer_block.hpp"
#include "ptrain/ops/linear.hpp"

namespace ptrain::nn {

/// GPT-2 style hyperparameters (nanoGPT's GPTConfig).
struct GPTConfig {
  std::int64_t vocab_size = 65;
  std::int64_t block_size = 128;  ///< longest sequence (positions in wpe)
  std::int64_t n_layer = 4;
  std::int64_t n_head = 4;
  std::int64_t n_embd = 128;
  double dropout = 0.0;     ///< embedding, attention-probability, residual and MLP dropout
  bool tie_weights = true;  ///< LM head = token embedding (Note [Weight tying])
  std::uint64_t dropout_seed = 0;
  /// Activation checkpointing: each block keeps only its input and recomputes its
  /// activations in backward (nn/recompute.hpp); same results, less memory, more compute.
  bool recompute = false;

  /// Parameters of the model built from this config (tied weight counted once).
  std::int64_t num_parameters() const {
    const std::int64_t C = n_embd;
    const std::int64_t block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C);
    return vocab_size * C + block_size * C + n_layer * block + 2 * C + (tie_weights ? 0 : vocab_size * C);
  }
  /// Training FLOPs per token (forward + backward) of the matrix products,
  /// counting the causal attention products at full S x S (the usual convention).
  double flops_per_token(std::int64_t seq) const {
    const double C = static_cast<double>(n_embd), L = static_cast<double>(n_layer);
    const double matmul = L * 12.0 * C * C + C * static_cast<double>(vocab_size);
    const double attention = L * 2.0 * static_cast<double>(seq) * C;  // q k^T and p v, per token
    return 6.0 * matmul + 6.0 * attention;
  }
};

/// Final unit: logits [B, S, V] = norm(x) W^T, W = lm_head weight or the tied token
/// embedding. GPT-2's head normalises with LayerNorm ("ln_f"), Llama's with RMSNorm ("norm").
template <class T, class Norm = LayerNorm<T>>
class LMHead : public Module<T> {
 public:
  /// GPT-2's head: LayerNorm "ln_f". `tied` is the token embedding's Parameter, or
  /// null for an own "lm_head.weight" [V, C].
  LMHead(std::int64_t n_embd, std::int64_t vocab, Parameter<T>* tied = nullptr, Generator& gen = default_generator())
    requires std::is_same_v<Norm, LayerNorm<T>>
      : LMHead(std::make_shared<Norm>(n_embd), "ln_f", n_embd, vocab, tied, gen) {}
  /// Any norm, registered under norm_name.
  LMHead(std::shared_ptr<Norm> norm, const std::string& norm_name, std::int64_t n_embd, std::int64_t vocab,
         Parameter<T>* tied = nullptr, Generator& gen = default_generator())
      : n_embd_(n_embd), vocab_(vocab), tied_(tied) {
    norm_ = this->register_module(norm_name, std::move(norm));
    if (!tied_) lm_head_ = this->register_module("lm_head", std::make_shared<Linear<T>>(n_embd, vocab, false, gen));
    if (tied_) check_shape(tied_->value, {vocab, n_embd}, "tied LM head weight");
  }

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    auto h = norm_->forward(x, cache.child(0));
    if (!tied_) return lm_head_->forward(h, cache.child(1));  // with its adapter, if any (nn/lora.hpp)
    cache.tensors = {h};
    return ops::linear(h, weight().value, Tensor<T>());
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(tied_ ? cache.tensors.size() == 1 : !cache.child(1).empty(), Error,
                 "[ptrain.backward] LMHead::backward without a forward");
    Parameter<T>& w = weight();
    // A tied weight is announced by the embedding (Note [Weight tying]), lm_head's by its backward.
    auto dh = tied_ ? ops::linear_backward(cache.tensors[0], w.value, dy, w.grad, static_cast<Tensor<T>*>(nullptr))
                    : lm_head_->backward(dy, cache.child(1));
    auto dx = norm_->backward(dh, cache.child(0));
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    return "LMHead(" + std::to_string(n_embd_) + " -> " + std::to_string(vocab_) + (tied_ ? ", tied)" : ")");
  }
  /// The tied embedding weight, which this unit uses but does not own (FSDP keeps the
  /// two units in one group because of it; see Module::borrowed_parameters()).
  std::vector<Parameter<T>*> borrowed_parameters() override {
    auto out = Module<T>::borrowed_parameters();
    if (tied_) out.push_back(tied_);
    return out;
  }
  /// The output projection [V, C]: the tied embedding or the own lm_head weight.
  Parameter<T>& weight() { return tied_ ? *tied_ : lm_head_->weight(); }
  bool tied() const { return tied_ != nullptr; }
  Norm& norm() { return *norm_; }
  Norm& ln_f() { return *norm_; }

 private:
  std::int64_t n_embd_, vocab_;
  Parameter<T>* tied_;
  std::shared_ptr<Norm> norm_;
  std::shared_ptr<Linear<T>> lm_head_;
};

namespace detail {

inline void check_gpt_config(const GPTConfig& cfg) {
  PTRAIN_CHECK(cfg.vocab_size > 0 && cfg.block_size > 0 && cfg.n_layer >= 0 && cfg.n_embd > 0, Error,
               "[ptrain.gpt.config] vocab_size, block_size and n_embd must be positive and n_layer >= 0");
  PTRAIN_CHECK(cfg.n_head > 0 && cfg.n_embd % cfg.n_head == 0, Error, "[ptrain.gpt.config] n_embd ", cfg.n_embd,
               " must be divisible by n_head ", cfg.n_head);
}

// Seed of unit i's dropout streams.
inline std::uint64_t gpt_dropout_site(const GPTConfig& cfg, std::uint64_t i) {
  return cfg.dropout_seed * 0x9E3779B97F4A7C15ull + 16 * i;
}

// The units, with their modules' own default initialisation drawn from `scratch`.
template <class T>
std::shared_ptr<TokenPositionEmbedding<T>> make_gpt_embedding(const GPTConfig& c, Generator& scratch) {
  return std::make_shared<TokenPositionEmbedding<T>>(c.vocab_size, c.block_size, c.n_embd, c.dropout,
                                                     gpt_dropout_site(c, 0), scratch);
}
template <class T>
std::shared_ptr<TransformerBlock<T>> make_gpt_block(const GPTConfig& c, std::int64_t layer, Generator& scratch) {
  return std::make_shared<TransformerBlock<T>>(c.n_embd, c.n_head, c.dropout,
                                               gpt_dropout_site(c, static_cast<std::uint64_t>(layer) + 1), scratch);
}
// A block as the model's unit: wrapped in Recompute when the config asks for it.
template <class T>
std::shared_ptr<Module<T>> gpt_block_unit(const GPTConfig& c, std::shared_ptr<TransformerBlock<T>> block) {
  if (c.recompute) return std::make_shared<Recompute<T>>(std::move(block));
  return block;
}

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// GPT-2's initialisation of one unit's own parameters, in named_parameters() order
// (Note [GPT units alone]).
template <class T>
void init_gpt_unit(Module<T>& unit, const GPTConfig& cfg, Generator& gen) {
  const double std_resid = 0.02 / std::sqrt(2.0 * static_cast<double>(std::max<std::int64_t>(1, cfg.n_layer)));
  for (auto& p : unit.named_parameters()) {
    Tensor<T>& v = p.param->value;
    if (p.name.find("ln_") != std::string::npos) continue;  // LayerNorm keeps 1 and 0
    if (ends_with(p.name, ".bias")) ops::fill_(v, T(0));
    else if (ends_with(p.name, "c_proj.weight")) ops::normal_(v, 0.0, std_resid, gen);
    else ops::normal_(v, 0.0, 0.02, gen);
  }
}

// Generator positions init_gpt_unit draws for unit u: one per element of each weight
// (wte and wpe; c_attn, attn.c_proj, c_fc and mlp.c_proj; the untied lm_head).
inline std::uint64_t gpt_unit_draws(const GPTConfig& c, std::size_t u) {
  const auto C = static_cast<std::uint64_t>(c.n_embd), V = static_cast<std::uint64_t>(c.vocab_size);
  if (u == 0) return (V + static_cast<std::uint64_t>(c.block_size)) * C;
  if (u <= static_cast<std::size_t>(c.n_layer)) return 12 * C * C;
  return c.tie_weights ? 0 : V * C;
}

// The dropout streams of a GPT's units by name: the embedding's, then each block's
// (any block whose attn() and mlp() name their streams as TransformerBlock's do).
template <class Embed, class Block>
std::vector<std::pair<std::string, Generator*>> gpt_generators(Embed& embed,
                                                               const std::vector<std::shared_ptr<Block>>& blocks) {
  std::vector<std::pair<std::string, Generator*>> out{{"embed.drop", &embed.dropout().generator()}};
  for (std::size_t l = 0; l < blocks.size(); ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    out.push_back({p + "attn.attn_drop", &blocks[l]->attn().attn_dropout_generator()});
    out.push_back({p + "attn.resid_drop", &blocks[l]->attn().resid_dropout().generator()});
    out.push_back({p + "mlp.drop", &blocks[l]->mlp().dropout().generator()});
  }
  return out;
}

}  // namespace detail

/// GPT-2: ids [B, S] (integral T values) -> logits [B, S, vocab].
template <class T>
class GPT : public UnitChain<T> {
 public:
  /// GPT-2 initialisation from `gen`, in named_parameters() order: every Linear and
  /// embedding weight ~ N(0, 0.02), residual projections (attn.c_proj, mlp.c_proj)
  /// ~ N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm 1 and 0.
  explicit GPT(const GPTConfig& cfg, Generator& gen = default_generator()) : cfg_(cfg) {
    detail::check_gpt_config(cfg);
    // Modules draw their own default init from a scratch stream; GPT-2's init below replaces it.
    Generator scratch(0);
    embed_ = detail::make_gpt_embedding<T>(cfg, scratch);
    this->add_unit("embed", embed_);
    for (std::int64_t l = 0; l < cfg.n_layer; ++l) {
      blocks_.push_back(detail::make_gpt_block<T>(cfg, l, scratch));
      this->add_unit("h." + std::to_string(l), detail::gpt_block_unit(cfg, blocks_.back()));
    }
    head_ = std::make_shared<LMHead<T>>(cfg.n_embd, cfg.vocab_size,
                                        cfg.tie_weights ? &embed_->wte().weight() : nullptr, scratch);
    this->add_unit("head", head_);
    for (auto& u : this->units()) detail::init_gpt_unit(*u, cfg, gen);
  }

  std::string describe() const override {
    return "GPT(vocab=" + std::to_string(cfg_.vocab_size) + ", block=" + std::to_string(cfg_.block_size) +
           ", layers=" + std::to_string(cfg_.n_layer) + ", heads=" + std::to_string(cfg_.n_head) +
           ", embd=" + std::to_string(cfg_.n_embd) + (cfg_.tie_weights ? ", tied)" : ")");
  }

  const GPTConfig& config() const { return cfg_; }
  TokenPositionEmbedding<T>& embedding() { return *embed_; }
  TransformerBlock<T>& block(std::size_t i) { return *blocks_.at(i); }
  LMHead<T>& head() { return *head_; }
  bool tied() const { return head_->tied(); }

  /// Every dropout stream, named; a checkpoint saves each offset() and restores it with set_offset().
  std::vector<std::pair<std::string, Generator*>> generators() { return detail::gpt_generators(*embed_, blocks_); }

 private:
  GPTConfig cfg_;
  std::shared_ptr<TokenPositionEmbedding<T>> embed_;
  std::vector<std::shared_ptr<TransformerBlock<T>>> blocks_;
  std::shared_ptr<LMHead<T>> head_;
};

/// Unit u of `GPT<T>(cfg, gen)` built alone, with the values the whole model gives it
/// (Note [GPT units alone]): a pipeline's unit factory that never builds the whole
/// model. `gen` is the generator as the whole model would receive it; it is not advanced.
/// The head of a tied model borrows the embedding's weight and cannot be built alone.
///
/// Note [GPT units alone]
/// GPT-2's initialisation draws one stream over the model's weights in order, and
/// normal_ takes one counter position per element, so unit u's draws start after
/// those of units 0..u-1, whose count follows from the config (detail::gpt_unit_draws).
/// Building unit u alone therefore needs no other unit; ptrain_unit ("gpt_unit builds
/// each unit alone ...") checks every unit bitwise against the whole model.
template <class T>
std::shared_ptr<Module<T>> gpt_unit(const GPTConfig& cfg, std::size_t u, const Generator& gen = default_generator()) {
  detail::check_gpt_config(cfg);
  const auto units = static_cast<std::size_t>(cfg.n_layer) + 2;
  PTRAIN_CHECK(u < units, Error, "[ptrain.gpt.unit] unit ", u, " of a GPT with ", units, " units (embedding, ",
               cfg.n_layer, " blocks, head)");
  PTRAIN_CHECK(!cfg.tie_weights || u + 1 < units, Error, "[ptrain.gpt.unit] the head of a tied GPT uses the "
               "embedding's weight and cannot be built alone; build the model with tie_weights = false");
  std::uint64_t offset = gen.offset();
  for (std::size_t k = 0; k < u; ++k) offset += detail::gpt_unit_draws(cfg, k);
  Generator draws(gen.seed(), offset), scratch(0);
  std::shared_ptr<Module<T>> unit;
  if (u == 0) unit = detail::make_gpt_embedding<T>(cfg, scratch);
  else if (u + 1 < units)
    unit = detail::gpt_block_unit(cfg, detail::make_gpt_block<T>(cfg, static_cast<std::int64_t>(u) - 1, scratch));
  else unit = std::make_shared<LMHead<T>>(cfg.n_embd, cfg.vocab_size, nullptr, scratch);
  detail::init_gpt_unit(*unit, cfg, draws);
  return unit;
}

/// GPT<T>(cfg).unit_names() without building the model: "embed", "h.0", ..., "head".
inline std::vector<std::string> gpt_unit_names(const GPTConfig& cfg) {
  std::vector<std::string> names{"embed"};
  for (std::int64_t l = 0; l < cfg.n_layer; ++l) names.push_back("h." + std::to_string(l));
  names.push_back("head");
  return names;
}

/// Weight-decay filter for a GPT (pass to optim::AdamW): decay for the matrices of
/// Linear layers, none for biases, LayerNorm parameters and embeddings (wte, wpe).
inline std::function<bool(const std::string&)> gpt_decay_filter() {
  return [](const std::string& name) {
    const bool bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    const bool norm = name.find("ln_") != std::string::npos;
    const bool embedding = name.find("wte.") != std::string::npos || name.find("wpe.") != std::string::npos;
    return !(bias || norm || embedding);
  };
}

/// Samples one token from a row of logits: divide by temperature, keep the top_k
/// largest (all when top_k <= 0), softmax, and invert the CDF at u in [0, 1).
/// temperature 0 means greedy (the first largest logit).
template <class T>
std::int32_t sample_logits(const T* logits, std::int64_t vocab, double temperature, std::int64_t top_k, double u) {
  PTRAIN_CHECK(temperature >= 0.0, Error, "[ptrain.sample] temperature ", temperature, " must be >= 0");
  std::vector<std::int32_t> order(static_cast<std::size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  // Stable: ties keep the lower id first, so greedy picks the first largest logit.
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return logits[a] > logits[b]; });
  if (temperature == 0.0) return order[0];
  const std::size_t k = top_k > 0 ? std::min<std::size_t>(static_cast<std::size_t>(top_k), order.size()) : order.size();
  std::vector<double> w(k);
  const double mx = static_cast<double>(logits[order[0]]);
  double total = 0;
  for (std::size_t i = 0; i < k; ++i) total += (w[i] = std::exp((static_cast<double>(logits[order[i]]) - mx) / temperature));
  double acc = 0;
  for (std::size_t i = 0; i < k; ++i) {
    acc += w[i] / total;
    if (u < acc) return order[i];
  }
  return order[k - 1];
}

/// Continues `prompt` by max_new_tokens tokens, feeding at most block_size tokens
/// of context each step; returns prompt + new tokens. Runs in evaluation mode
/// (dropout off) and restores the previous mode. Draws one uniform per token from gen.
/// The model may be on any device (ids go there, the last row of logits comes back).
/// vocab_limit > 0 samples among the first vocab_limit ids only: a tokenizer's ids when
/// the model's vocabulary is padded (as llm.c samples GPT-2's 50257 of 50304).
template <class T>
std::vector<std::int32_t> generate(GPT<T>& model, std::vector<std::int32_t> prompt, std::int64_t max_new_tokens,
                                   double temperature, std::int64_t top_k, Generator& gen,
                                   std::int64_t vocab_limit = 0) {
  PTRAIN_CHECK(!prompt.empty(), Error, "[ptrain.sample] the prompt needs at least one token");
  const bool was_training = model.training();
  model.train(false);
  const std::int64_t V = model.config().vocab_size, block = model.config().block_size;
  const Device device = model.named_parameters().front().param->value.device();
  std::vector<double> last(static_cast<std::size_t>(V));
  for (std::int64_t n = 0; n < max_new_tokens; ++n) {
    const std::int64_t len = std::min<std::int64_t>(block, static_cast<std::int64_t>(prompt.size()));
    const std::vector<std::int32_t> window(prompt.end() - len, prompt.end());
    Cache<T> cache;
    auto logits = model.forward_tokens(Tensor<std::int32_t>::from(window, {1, len}).to(device), cache);
    const auto row = logits.view((len - 1) * V, {V}).to(Device::cpu());
    for (std::int64_t v = 0; v < V; ++v) last[static_cast<std::size_t>(v)] = static_cast<acc_t<T>>(row.data()[v]);
    prompt.push_back(sample_logits(last.data(), vocab_limit > 0 ? std::min(vocab_limit, V) : V, temperature, top_k,
                                   gen.uniform()));
  }
  model.train(was_training);
  return prompt;
}

}  // namespace ptrain::nn
