#pragma once
// Pretrained weights for nn::Llama: a Hugging Face Llama-family folder (Llama 2/3,
// Mistral, Mixtral, Qwen2, SmolLM: model.safetensors, or shards with
// model.safetensors.index.json) or a ptrain file with the model's own names, to
// fine-tune from; and the way back, a folder that transformers'
// AutoModelForCausalLM.from_pretrained loads. Names keep the ckpt:: namespace
// as gpt2_weights.hpp's do.
//
//   auto cfg = nn::LlamaConfig::from_hf_config_file("SmolLM-135M/config.json");
//   nn::Llama<float> model(cfg);
//   ckpt::load_llama_weights("SmolLM-135M", model);
//   ckpt::save_llama_weights("finetuned", model);          // config.json + model.safetensors
//   ckpt::save_llama_weights("big", model, 0, 2'000'000'000);  // shards of <= 2 GB + index
//
// Note [Llama names]
// nn::Llama's parameters carry Hugging Face's names without "model.", but for the head:
//   model.embed_tokens.weight          -> embed_tokens.weight
//   model.layers.L.<rest>              -> layers.L.<rest>   (input_layernorm.weight,
//        self_attn.{q,k,v,o}_proj.{weight,bias}, post_attention_layernorm.weight,
//        mlp.{gate,up,down}_proj.{weight,bias}, or Mixtral's block_sparse_moe.gate.weight
//        and block_sparse_moe.experts.E.{w1,w2,w3}.weight), every Linear [out, in] as nn::Linear
//   model.norm.weight                  -> head.norm.weight
//   lm_head.weight                     -> head.lm_head.weight (untied; a tied model uses
//                                         embed_tokens, an untied model given a file
//                                         without lm_head.weight starts from it, as HF does)
// Buffers "*.rotary_emb.inv_freq" (older transformers saved them) are skipped: ptrain
// computes the frequencies from the config. A model vocabulary larger than the
// file's (padded for speed, as save_llama_weights' vocab_size drops) gets zero rows
// after the file's. Everything else that does not match, a tensor missing, left
// over or of another shape, is refused before any parameter changes.
//
// Note [Rotary layout of q and k]
// Meta's original Llama checkpoints (consolidated.00.pth) rotate interleaved pairs
// (dimensions 2i, 2i+1 of each head). transformers' convert_llama_weights_to_hf.py
// permutes the rows of q_proj and k_proj once, per head, so that the rotate-half
// convention (dimension i paired with i + D/2) gives the same attention; every
// Hugging Face Llama-family checkpoint stores them so permuted. ops/rotary.hpp uses
// rotate-half too, so the rows load and save as they are, with no permutation.
// Meta's own layout is not read (it is a .pth, not safetensors): convert it with
// transformers' script first.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ptrain/nn/lora.hpp"
#include "ptrain/nn/models/hf_weights.hpp"
#include "ptrain/nn/models/llama.hpp"

namespace ptrain::ckpt {

namespace detail {

// A LoRA adapter's parameter ("layers.0.self_attn.q_proj.lora_A.weight", nn/lora.hpp).
inline bool is_lora_name(const std::string& name) { return name.find(".lora_") != std::string::npos; }

// The Hugging Face name of ptrain parameter `name` (Note [Llama names]).
inline std::string hf_llama_name(const std::string& name) {
  if (name == "head.norm.weight") return "model.norm.weight";
  if (name == "head.lm_head.weight") return "lm_head.weight";
  return "model." + name;
}

}  // namespace detail

/// Loads every parameter of `model` from `path` (Note [Llama names]): a Hugging Face
/// folder (Note [Hugging Face folders]), one .safetensors file, or a ptrain file with
/// the model's own names; F32, BF16, F16 or F64 values, converted to T. The model may
/// live on any device. Returns what was loaded, e.g. "Hugging Face Llama weights, 3
/// files, 272 tensors (lm_head from embed_tokens)". Throws CheckpointError, and changes
/// nothing, when the weights do not fit the model. LoRA adapters (nn/lora.hpp) are not
/// touched: load the base, then the adapter (load_lora_adapter, nn/models/peft.hpp).
template <class T>
std::string load_llama_weights(const std::string& path, nn::Llama<T>& model) {
  const detail::HfTensors r(path, "ptrain.llama_weights");
  const bool ours = r.contains("embed_tokens.weight");
  PTRAIN_CHECK(ours || r.contains("model.embed_tokens.weight"), CheckpointError, "[ptrain.llama_weights.format] ",
               path, " holds neither Hugging Face Llama weights (model.embed_tokens.weight) nor a ptrain Llama "
               "(embed_tokens.weight); give a Llama-family model folder");
  const nn::LlamaConfig& cfg = model.config();
  std::set<std::string> unused;  // file tensors no parameter takes
  for (const std::string& n : r.names())
    if (!n.ends_with("rotary_emb.inv_freq")) unused.insert(n);

  // Check everything first, so that a mismatch leaves the model as it was; then
  // convert one tensor at a time (no second copy of the model in memory).
  std::vector<std::pair<nn::Parameter<T>*, std::string>> plan;
  std::string note;
  const std::string embed = ours ? "embed_tokens.weight" : "model.embed_tokens.weight";
  for (auto& [name, param] : model.named_parameters()) {
    if (detail::is_lora_name(name)) continue;  // adapters come from their own folder (nn/models/peft.hpp)
    std::string file_name = ours ? name : detail::hf_llama_name(name);
    if (name == "head.lm_head.weight" && !r.contains(file_name)) {  // untied model, tied file
      file_name = embed;
      note += ", lm_head from embed_tokens";
    }
    const TensorEntry& e = r.float_entry(file_name);
    unused.erase(file_name);
    const Shape& want = param->value.shape();
    const bool vocab_rows = name == "embed_tokens.weight" || name == "head.lm_head.weight";
    const bool fits = e.shape == want || (vocab_rows && e.shape.size() == 2 && e.shape[1] == want[1] &&
                                          e.shape[0] <= want[0]);
    PTRAIN_CHECK(fits, CheckpointError, "[ptrain.llama_weights.shape] ", path, ": tensor '", file_name,
                 "' has shape ", e.shape, ", expected shape ", want, " (the model's ", name, ")",
                 "; build the model from the folder's config.json (LlamaConfig::from_hf_config_file)");
    if (vocab_rows && e.shape[0] < want[0] && note.find("padded") == std::string::npos)
      note += ", vocabulary " + std::to_string(e.shape[0]) + " padded to " + std::to_string(want[0]);
    plan.emplace_back(param, file_name);
  }
  if (cfg.tie_weights && !ours) unused.erase("lm_head.weight");  // a tied model's copy of embed_tokens
  PTRAIN_CHECK(unused.empty(), CheckpointError, "[ptrain.llama_weights.unused] ", path, " holds ", unused.size(),
               " tensor(s) the model has no parameter for, e.g. '", unused.empty() ? "" : *unused.begin(),
               "'; build the model from the folder's config.json (layers, biases, tie_word_embeddings)");
  for (auto& [param, file_name] : plan) {
    auto v = Tensor<T>::zeros(param->value.shape());  // rows past the file's vocabulary stay zero
    r.read_into(file_name, v.data());
    param->value.copy_(v);
  }
  return std::string(ours ? "ptrain Llama weights, " : "Hugging Face Llama weights, ") +
         (r.files() > 1 ? std::to_string(r.files()) + " files, " : "") + std::to_string(plan.size()) + " tensors" +
         (note.empty() ? "" : " (" + note.substr(2) + ")");
}

/// Writes `model` as a Hugging Face folder (created if missing): config.json
/// (model.config().to_hf_config()) and the parameters in Hugging Face's names
/// (Note [Llama names], lm_head.weight only when untied) as F32, in model.safetensors,
/// or, when max_shard_bytes > 0 and the data is larger, in shards of at most that
/// many bytes with model.safetensors.index.json (Note [Hugging Face folders]).
/// A model with LoRA adapters (nn/lora.hpp) is written merged: each adapted weight as
/// W + (alpha / r) B A, the adapters themselves left out (the model is not changed).
/// `vocab_size` (0: the model's) keeps the first rows of embed_tokens and lm_head,
/// dropping a padded vocabulary's extra rows. Returns what was written, e.g.
/// "29 tensors in 3 files, vocabulary 49152".
template <class T>
std::string save_llama_weights(const std::string& folder, nn::Llama<T>& model, std::int64_t vocab_size = 0,
                               std::int64_t max_shard_bytes = 0) {
  const nn::LlamaConfig& cfg = model.config();
  if (vocab_size == 0) vocab_size = cfg.vocab_size;
  PTRAIN_CHECK(vocab_size > 0 && vocab_size <= cfg.vocab_size, CheckpointError, "[ptrain.llama_weights.vocab] ",
               "cannot write a vocabulary of ", vocab_size, " from a model of ", cfg.vocab_size,
               " ids; pass at most the model's (0 for all of it)");
  PTRAIN_CHECK(max_shard_bytes >= 0, CheckpointError, "[ptrain.llama_weights.shard] max_shard_bytes ",
               max_shard_bytes, " must be >= 0 (0: one model.safetensors)");
  std::map<std::string, nn::LoraAdapter<T>*> adapters;  // by the adapted weight's name
  for (const auto& [path, adapter] : nn::lora_adapters(model))
    if (!adapter->merged()) adapters[path + ".weight"] = adapter;
  std::vector<std::pair<std::string, Tensor<float>>> tensors;
  for (auto& [name, param] : model.named_parameters()) {
    if (detail::is_lora_name(name)) continue;
    const bool vocab_rows = name == "embed_tokens.weight" || name == "head.lm_head.weight";
    const std::int64_t rows = param->value.dim() == 2 ? param->value.shape()[0] : 1;
    Tensor<T> value = param->value;
    if (auto it = adapters.find(name); it != adapters.end()) {  // W + scale B A, the model's own weights untouched
      value = value.clone();
      it->second->add_to(value, 1);
    }
    tensors.emplace_back(detail::hf_llama_name(name), detail::hf_f32(value, vocab_rows ? vocab_size : rows));
  }
  nlohmann::json config = cfg.to_hf_config();
  config["vocab_size"] = vocab_size;
  const std::size_t files = detail::write_hf_folder(folder, tensors, config.dump(2), max_shard_bytes);
  return std::to_string(tensors.size()) + " tensors in " + std::to_string(files) + " file" + (files > 1 ? "s" : "") +
         ", vocabulary " + std::to_string(vocab_size) +
         (vocab_size < cfg.vocab_size ? " (of " + std::to_string(cfg.vocab_size) + ")" : "");
}

}  // namespace ptrain::ckpt
