#pragma once
// LoRA adapters of a Llama-family model in Hugging Face PEFT's folder format
// (adapter_model.safetensors + adapter_config.json), written and read, so that
// PEFT's PeftModel.from_pretrained(base, folder) loads what ptrain trained and
// ptrain loads what PEFT trained.
//
//   nn::Llama<float> model(cfg);
//   ckpt::load_llama_weights("Llama-3.2-1B", model);           // the base first
//   nn::apply_lora(model, lora);                                // then the adapters
//   ... train ...
//   ckpt::save_lora_adapter("adapter", model, lora, "Llama-3.2-1B");
//   ckpt::save_llama_weights("merged", model);                  // or one merged folder
//
//   nn::Llama<float> again(cfg);
//   ckpt::load_llama_weights("Llama-3.2-1B", again);
//   ckpt::load_lora_adapter("adapter", again);                  // applies LoRA from the config
//
// Note [PEFT adapter folders]
// PEFT (0.7) saves the trainable LoRA tensors of a PeftModel under the names
// "base_model.model.<Hugging Face module>.lora_A.weight" ([r, in]) and
// ".lora_B.weight" ([out, r]), without the adapter's name, and the LoraConfig
// as JSON: r, lora_alpha, lora_dropout, target_modules (a list of names, or a
// string that is a regular expression), bias, peft_type "LORA", task_type, and
// options ptrain does not implement (rank_pattern, alpha_pattern,
// layers_to_transform, modules_to_save, fan_in_fan_out; later versions add
// use_rslora and use_dora). Writing, ptrain writes the keys PEFT 0.7.1 writes,
// those options at their defaults (0.7.1 refuses keys it does not know);
// reading, it refuses a config that sets one, since the model it built would
// then differ from PEFT's. The module names follow Note
// [Llama names]; tensors are written as F32 and read from F32, F64, BF16 or F16.

#include <nlohmann/json.hpp>

#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ptrain/nn/lora.hpp"
#include "ptrain/nn/models/llama_weights.hpp"

namespace ptrain::ckpt {

inline constexpr const char* kPeftWeights = "adapter_model.safetensors";
inline constexpr const char* kPeftConfig = "adapter_config.json";

/// PEFT's file name of the adapter parameter `name` of an nn::Llama
/// ("layers.0.self_attn.q_proj.lora_A.weight" -> "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").
inline std::string peft_name(const std::string& name) {
  const auto at = name.find(".lora_");
  PTRAIN_CHECK(at != std::string::npos, CheckpointError, "[ptrain.peft.name] '", name, "' is no LoRA parameter");
  const std::string module = detail::hf_llama_name(name.substr(0, at) + ".weight");
  return "base_model.model." + module.substr(0, module.size() - 7) + name.substr(at);
}

/// The LoraConfig of a PEFT adapter folder's adapter_config.json; refuses what ptrain
/// does not build the same way (Note [PEFT adapter folders]).
inline nn::LoraConfig read_lora_config(const std::string& folder) {
  const auto path = std::filesystem::path(folder) / kPeftConfig;
  std::ifstream in(path);
  PTRAIN_CHECK(in, CheckpointError, "[ptrain.peft.config] cannot read ", path.string(),
               "; give the folder PEFT's save_pretrained (or ptrain's save_lora_adapter) wrote");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    PTRAIN_THROW(CheckpointError, "[ptrain.peft.config] ", path.string(), " is not valid JSON: ", e.what());
  }
  auto refuse = [&](const std::string& what) {
    PTRAIN_THROW(CheckpointError, "[ptrain.peft.config] ", path.string(), ": ", what);
  };
  if (j.value("peft_type", std::string()) != "LORA") refuse("peft_type is not \"LORA\"; only LoRA adapters load");
  nn::LoraConfig cfg;
  try {
    cfg.r = j.at("r").get<std::int64_t>();
    cfg.alpha = j.at("lora_alpha").get<double>();
    cfg.dropout = j.value("lora_dropout", 0.0);
    cfg.bias = j.value("bias", std::string("none"));
    const auto& t = j.at("target_modules");
    if (t.is_string())
      refuse("target_modules is a regular expression; save the adapter with a list of module names");
    cfg.target_modules = t.get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    refuse(std::string("a field has the wrong type or is missing: ") + e.what());
  }
  auto unset = [&](const char* key) { return !j.contains(key) || j[key].is_null() || j[key].empty() || j[key] == false; };
  for (const char* key : {"use_rslora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "layers_to_transform",
                          "modules_to_save", "use_dora"})
    if (!unset(key)) refuse(std::string(key) + " is set; ptrain builds plain LoRA only (Note [PEFT adapter folders])");
  return cfg;
}

/// Writes the LoRA adapters of `model` (nn::apply_lora) as a PEFT folder (created if
/// missing): adapter_model.safetensors (F32) and adapter_config.json from `cfg`, the
/// config the adapters were applied with; `base_model` goes to base_model_name_or_path.
/// Returns what was written, e.g. "14 adapter tensors (r 8, 7 target modules)".
template <class T>
std::string save_lora_adapter(const std::string& folder, nn::Llama<T>& model, const nn::LoraConfig& cfg,
                              const std::string& base_model = "") {
  std::vector<std::pair<std::string, Tensor<float>>> tensors;
  for (auto& [name, param] : model.named_parameters())
    if (detail::is_lora_name(name))
      tensors.emplace_back(peft_name(name), detail::hf_f32(param->value, param->value.shape()[0]));
  PTRAIN_CHECK(!tensors.empty(), CheckpointError, "[ptrain.peft.none] the model has no LoRA adapters; call "
               "nn::apply_lora before save_lora_adapter");
  for (const auto& [path, adapter] : nn::lora_adapters(model))
    PTRAIN_CHECK(!adapter->merged(), CheckpointError, "[ptrain.peft.merged] the adapter of ", path,
                 " is merged into its weight; unmerge_lora first, or save the merged model with save_llama_weights");
  nlohmann::json j = {{"alpha_pattern", nlohmann::json::object()}, {"auto_mapping", nullptr},
                      {"base_model_name_or_path", base_model}, {"bias", cfg.bias},
                      {"fan_in_fan_out", false}, {"inference_mode", true}, {"init_lora_weights", true},
                      {"layers_pattern", nullptr}, {"layers_to_transform", nullptr},
                      {"loftq_config", nlohmann::json::object()}, {"lora_alpha", cfg.alpha},
                      {"lora_dropout", cfg.dropout}, {"megatron_config", nullptr},
                      {"megatron_core", "megatron.core"}, {"modules_to_save", nullptr}, {"peft_type", "LORA"},
                      {"r", cfg.r}, {"rank_pattern", nlohmann::json::object()}, {"revision", nullptr},
                      {"target_modules", cfg.target_modules}, {"task_type", "CAUSAL_LM"}};
  std::filesystem::create_directories(folder);
  std::vector<TensorRef> refs;
  for (const auto& [name, t] : tensors) refs.push_back(tensor_ref(name, t));
  const auto file = std::filesystem::path(folder) / kPeftWeights;
  const std::string tmp = file.string() + ".tmp";
  write_safetensors(tmp, refs, {{"format", "pt"}});
  detail::rename_into_place(tmp, file);
  detail::write_text_whole(std::filesystem::path(folder) / kPeftConfig, j.dump(2));
  return std::to_string(tensors.size()) + " adapter tensors (r " + std::to_string(cfg.r) + ", " +
         std::to_string(cfg.target_modules.size()) + " target modules)";
}

/// Loads a PEFT adapter folder into `model`: applies LoRA from its adapter_config.json
/// when the model has no adapters yet (load the base weights first), then reads every
/// adapter tensor. Throws CheckpointError, changing no adapter value, when the folder's
/// tensors and the model's adapters differ in names or shapes. Returns what was loaded.
template <class T>
std::string load_lora_adapter(const std::string& folder, nn::Llama<T>& model, Generator& gen = default_generator()) {
  const nn::LoraConfig cfg = read_lora_config(folder);
  if (nn::lora_adapters(model).empty()) nn::apply_lora(model, cfg, gen);
  const auto file = std::filesystem::path(folder) / kPeftWeights;
  PTRAIN_CHECK(std::filesystem::exists(file), CheckpointError, "[ptrain.peft.weights] ", folder, " has no ",
               kPeftWeights, "; PEFT before 0.6 wrote adapter_model.bin, which ptrain does not read: load it in "
               "PEFT and save_pretrained(folder, safe_serialization=True)");
  const detail::HfTensors r(file.string(), "ptrain.peft");
  std::set<std::string> unused;
  for (const std::string& n : r.names()) unused.insert(n);
  std::vector<std::pair<nn::Parameter<T>*, std::string>> plan;
  for (auto& [name, param] : model.named_parameters()) {
    if (!detail::is_lora_name(name)) continue;
    const std::string file_name = peft_name(name);
    const TensorEntry& e = r.float_entry(file_name);
    PTRAIN_CHECK(e.shape == param->value.shape(), CheckpointError, "[ptrain.peft.shape] ", folder, ": tensor '",
                 file_name, "' has shape ", e.shape, ", expected ", param->value.shape(), " (the model's ", name,
                 "); apply LoRA with the folder's r (read_lora_config) to the model it was trained on");
    unused.erase(file_name);
    plan.emplace_back(param, file_name);
  }
  PTRAIN_CHECK(unused.empty(), CheckpointError, "[ptrain.peft.unused] ", folder, " holds ", unused.size(),
               " tensor(s) no adapter of the model takes, e.g. '", unused.empty() ? "" : *unused.begin(),
               "'; apply LoRA with the folder's target_modules (read_lora_config)");
  for (auto& [param, file_name] : plan) {
    auto v = Tensor<T>::empty(param->value.shape());
    r.read_into(file_name, v.data());
    param->value.copy_(v);
  }
  return "PEFT adapter, " + std::to_string(plan.size()) + " tensors (r " + std::to_string(cfg.r) + ")";
}

}  // namespace ptrain::ckpt
