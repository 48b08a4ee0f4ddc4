#pragma once
// Pretrained weights for nn::GPT: Hugging Face's GPT-2 safetensors files, or a
// ptrain file with the model's own names (gpt_char --export, a checkpoint's
// model.safetensors), to fine-tune from; and the way back, a Hugging Face GPT-2
// folder that transformers' GPT2LMHeadModel.from_pretrained loads.
//
// It lives beside the model it converts and needs only the layers above nn
// (the safetensors format is in core/); its names keep the ckpt:: namespace
// (ckpt::load_gpt2_weights, ckpt::save_gpt2_weights).
//
//   nn::GPT<float> model({.vocab_size = 50304, .block_size = 1024, .n_layer = 12, .n_head = 12, .n_embd = 768});
//   ckpt::load_gpt2_weights("gpt2/model.safetensors", model);
//   ckpt::save_gpt2_weights("finetuned", model, /*vocab_size=*/50257);   // model.safetensors + config.json
//
// Note [GPT-2 names]
// Hugging Face's GPT2Model is the same network as nn::GPT (pre-LayerNorm blocks,
// tanh GELU, learned positions, biases, eps 1e-5, the head tied to wte), under
// other names and with its linear weights stored transposed (Conv1D: [in, out],
// where ptrain's Linear holds [out, in]):
//   wte.weight, wpe.weight          -> embed.wte.weight, embed.wpe.weight
//   h.L.{ln_1,ln_2}.{weight,bias}   -> the same names
//   h.L.attn.{c_attn,c_proj}.weight -> the same names, transposed (biases as they are)
//   h.L.mlp.{c_fc,c_proj}.weight    -> the same names, transposed
//   ln_f.{weight,bias}              -> head.ln_f.{weight,bias}
//   lm_head.weight                  -> head.lm_head.weight (untied models; a tied model uses wte)
// A "transformer." prefix (GPT2LMHeadModel's state dict, all but lm_head.weight) is dropped, and the
// attention-mask buffers h.L.attn.bias / h.L.attn.masked_bias are skipped.
// Two shapes may differ, as in nanoGPT and llm.c: a larger model vocabulary
// (50304 for GPT-2's 50257 ids) gets zero rows after the file's, and a shorter
// block_size keeps the first rows of wpe. An untied model given a file without
// lm_head.weight starts its head from wte. Anything else that does not match
// (layers, width, a tensor missing or left over) is refused before any
// parameter changes, naming the tensor and the model's shape.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "ptrain/nn/models/gpt.hpp"
#include "ptrain/nn/models/hf_weights.hpp"

namespace ptrain::ckpt {

namespace detail {

// The file's name for ptrain parameter `name` (Note [GPT-2 names]) and whether it is stored transposed.
inline std::pair<std::string, bool> hf_gpt2_name(const std::string& name) {
  if (name == "embed.wte.weight") return {"wte.weight", false};
  if (name == "embed.wpe.weight") return {"wpe.weight", false};
  if (name.rfind("head.ln_f.", 0) == 0) return {name.substr(5), false};
  if (name == "head.lm_head.weight") return {"lm_head.weight", false};
  for (const char* conv : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"})
    if (name.size() > std::strlen(conv) && name.compare(name.size() - std::strlen(conv), std::string::npos, conv) == 0)
      return {name, true};
  return {name, false};
}

}  // namespace detail

/// Loads every parameter of `model` from `path` (Note [GPT-2 names]), a safetensors
/// file or a Hugging Face model folder (model.safetensors or shards with their index,
/// Note [Hugging Face folders]; save_gpt2_weights writes one); the model may live on any device. Returns what was loaded, e.g. "Hugging Face GPT-2 weights,
/// 148 tensors (vocabulary 50257 padded to 50304)". Throws CheckpointError, and
/// changes nothing, when the file does not fit the model.
template <class T>
std::string load_gpt2_weights(std::string path, nn::GPT<T>& model) {
  const detail::HfTensors r(path, "ptrain.ckpt");
  const bool ours = r.contains("embed.wte.weight");
  std::string prefix;
  if (!ours && r.contains("transformer.wte.weight")) prefix = "transformer.";
  PTRAIN_CHECK(ours || r.contains(prefix + "wte.weight"), CheckpointError, "[ptrain.ckpt.gpt2] ", path,
               " holds neither GPT-2 weights (wte.weight) nor a ptrain GPT (embed.wte.weight)");
  const nn::GPTConfig& cfg = model.config();
  std::set<std::string> unused;  // file tensors no parameter takes
  for (const std::string& n : r.names())
    if (ours || !(n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias"))) unused.insert(n);

  // Convert everything first, so that a mismatch leaves the model as it was.
  std::vector<std::pair<nn::Parameter<T>*, Tensor<T>>> values;
  std::string note;
  for (auto& [name, param] : model.named_parameters()) {
    auto [file_name, transposed] = ours ? std::pair{name, false} : detail::hf_gpt2_name(name);
    if (!ours && file_name != "lm_head.weight") file_name = prefix + file_name;  // the head is outside "transformer."
    const Shape& want = param->value.shape();
    if (!r.contains(file_name) && name == "head.lm_head.weight") {  // untied model, tied file: start from wte
      file_name = ours ? "embed.wte.weight" : prefix + "wte.weight";
      note += ", lm_head from wte";
    }
    const TensorEntry& e = r.entry(file_name);
    unused.erase(e.name);
    const bool vocab_rows = name == "embed.wte.weight" || name == "head.lm_head.weight";
    const bool position_rows = name == "embed.wpe.weight";
    Shape have = e.shape;
    if (transposed && have.size() == 2) std::swap(have[0], have[1]);
    const bool fits = have == want || (have.size() == 2 && have[1] == want[1] &&
                                       ((vocab_rows && have[0] <= want[0]) || (position_rows && have[0] >= want[0])));
    PTRAIN_CHECK(fits, CheckpointError, "[ptrain.ckpt.gpt2] ", path, ": tensor '", e.name, "' has shape ", e.shape,
                 transposed ? " (stored transposed)" : "", " but the model's ", name, " is ", want,
                 "; build the model with the file's sizes (layers, width ", cfg.n_embd, ", vocabulary ",
                 cfg.vocab_size, ", block ", cfg.block_size, ")");
    if (vocab_rows && have[0] < want[0] && note.find("padded") == std::string::npos)
      note += ", vocabulary " + std::to_string(have[0]) + " padded to " + std::to_string(want[0]);
    if (position_rows && have[0] > want[0])
      note += ", positions cropped from " + std::to_string(have[0]) + " to " + std::to_string(want[0]);
    auto v = Tensor<T>::zeros(want);
    const std::vector<T> stored = r.values<T>(e.name);
    const std::int64_t rows = want.size() == 2 ? std::min(want[0], have[0]) : 1;
    const std::int64_t cols = want.size() == 2 ? want[1] : param->value.numel();
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j)
        v.data()[i * cols + j] = stored[static_cast<std::size_t>(transposed ? j * e.shape[1] + i : i * cols + j)];
    values.emplace_back(param, std::move(v));
  }
  if (!ours) unused.erase("lm_head.weight");  // tied in the file: the same values as wte
  PTRAIN_CHECK(unused.empty(), CheckpointError, "[ptrain.ckpt.gpt2] ", path, " holds ", unused.size(),
               " tensor(s) the model has no parameter for, e.g. '", unused.empty() ? "" : *unused.begin(),
               "'; build the model with the file's number of layers");
  for (auto& [param, v] : values) param->value.copy_(v);
  return std::string(ours ? "ptrain GPT weights, " : "Hugging Face GPT-2 weights, ") + std::to_string(values.size()) +
         " tensors" + (note.empty() ? "" : " (" + note.substr(2) + ")");
}

/// Writes `model` as a Hugging Face GPT-2 folder (created if missing): model.safetensors
/// with GPT2LMHeadModel's names (Note [GPT-2 names] the other way: "transformer."
/// prefix, Conv1D weights transposed, F32, lm_head.weight only when untied) and
/// config.json (GPT2Config: sizes, tanh GELU, eps 1e-5, the model's dropout,
/// tie_word_embeddings). `vocab_size` (0: the model's) keeps the first rows of wte and
/// lm_head, dropping a padded vocabulary's extra rows. The model may live on any device.
/// Returns what was written, e.g. "148 tensors, vocabulary 50257 (of 50304)".
template <class T>
std::string save_gpt2_weights(const std::string& folder, nn::GPT<T>& model, std::int64_t vocab_size = 0) {
  const nn::GPTConfig& cfg = model.config();
  if (vocab_size == 0) vocab_size = cfg.vocab_size;
  PTRAIN_CHECK(vocab_size > 0 && vocab_size <= cfg.vocab_size, CheckpointError, "[ptrain.ckpt.gpt2] cannot write a ",
               "vocabulary of ", vocab_size, " from a model of ", cfg.vocab_size, " ids; pass at most the model's");
  std::vector<std::pair<std::string, Tensor<float>>> tensors;  // host F32, in the file's layout
  for (auto& [name, param] : model.named_parameters()) {
    auto [file_name, transposed] = detail::hf_gpt2_name(name);
    if (file_name != "lm_head.weight") file_name = "transformer." + file_name;
    const bool vocab_rows = name == "embed.wte.weight" || name == "head.lm_head.weight";
    const std::int64_t rows = param->value.dim() == 2 ? param->value.shape()[0] : 1;
    tensors.emplace_back(file_name, detail::hf_f32(param->value, vocab_rows ? vocab_size : rows, transposed));
  }
  const nlohmann::ordered_json config = {
      {"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"vocab_size", vocab_size},
      {"n_positions", cfg.block_size}, {"n_ctx", cfg.block_size}, {"n_embd", cfg.n_embd}, {"n_layer", cfg.n_layer},
      {"n_head", cfg.n_head}, {"n_inner", nullptr}, {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", 1e-5}, {"resid_pdrop", cfg.dropout}, {"embd_pdrop", cfg.dropout},
      {"attn_pdrop", cfg.dropout}, {"initializer_range", 0.02}, {"tie_word_embeddings", cfg.tie_weights},
      {"torch_dtype", "float32"}};
  detail::write_hf_folder(folder, tensors, config.dump(2), 0);
  return std::to_string(tensors.size()) + " tensors, vocabulary " + std::to_string(vocab_size) +
         (vocab_size < cfg.vocab_size ? " (of " + std::to_string(cfg.vocab_size) + ")" : "");
}

}  // namespace ptrain::ckpt
