#pragma once
// LoRA: low-rank adapters on chosen Linear layers over a frozen model (Hu et al.,
// 2021; Hugging Face PEFT's LoraConfig, get_peft_model, merge_and_unload).
//
//   nn::LoraConfig cfg{.r = 8, .alpha = 16, .target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"}};
//   auto names = nn::apply_lora(model, cfg);  // before the engine packs the model
//   parallel::Local<float> engine(model);      // the adapters train, the rest is frozen
//   ...
//   nn::merge_lora(model);                     // W += (alpha / r) B A: one Linear again
//
// Note [LoRA]
// apply_lora gives every Linear whose module name matches a pattern of
// target_modules (PEFT's rule: the name equals the pattern or ends in "." + the
// pattern) a LoraAdapter (Linear::set_adapter), so that the layer computes
//
//   y = x W^T + b + (alpha / r) * dropout(x) A^T B^T,   A [r, in], B [out, r],
//
// and freezes every parameter whose name has no "lora_" in it (PEFT with bias
// "none"). The adapter joins the Linear in place rather than replacing it, so the
// models' typed handles to their projections (GroupedQueryAttention::q_proj(),
// FeedForward::c_fc(), ...) and every path through Linear::forward see it.
// A is drawn as PEFT does (kaiming_uniform with a = sqrt(5): U(-1/sqrt(in),
// 1/sqrt(in)), torch.nn.Linear's init) and B starts at zero, so a fresh adapter
// leaves the model's output unchanged.
//
// Names: the base keeps its names ("layers.0.self_attn.q_proj.weight"), so the
// Hugging Face loaders still fill it; the adapter's are "<linear>.lora_A.weight"
// and "<linear>.lora_B.weight". PEFT's files name them
// "base_model.model.<Hugging Face module name>.lora_A.weight".
//
// Precision: the adapters have the model's element type T. In a bf16 model they are
// bf16 tensors, and forward and backward run in bf16 with fp32 accumulation, as
// the base does; AdamW (optim/adamw.hpp) keeps an fp32 master copy and fp32 moments
// of every trainable bf16 parameter, so the adapters' updates accumulate in fp32 and
// are rounded to bf16 after each step. The frozen base has no gradient, no moments
// and no master copy: its memory is its bf16 values alone. A float or double model
// trains its adapters in its own type.
//
// Merging: merge_lora adds scale * B A into each base weight (in the weight's type:
// one rounding per element in bf16) and the adapters then add nothing;
// unmerge_lora subtracts it again (exact up to that rounding). Train with the
// adapters unmerged: a merged adapter's backward computes no gradients.
//
// Limits: plain nn::Linear only (a tensor-parallel projection, a tied LM head or an
// MoE router is no Linear; routed experts refuse adapters, [ptrain.lora.moe]); bias
// "none" only; one adapter per layer.

#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "ptrain/nn/activation.hpp"
#include "ptrain/nn/linear.hpp"

namespace ptrain::nn {

/// PEFT's LoraConfig, the fields ptrain uses.
struct LoraConfig {
  std::int64_t r = 8;                       ///< rank
  double alpha = 8;                         ///< lora_alpha: the update is scaled by alpha / r
  double dropout = 0.0;                     ///< lora_dropout, on the adapter's input only
  std::vector<std::string> target_modules;  ///< module name patterns (PEFT's rule, Note [LoRA])
  std::string bias = "none";                ///< only "none": every bias stays frozen
  std::uint64_t dropout_seed = 0;           ///< adapter i draws its dropout masks from stream dropout_seed + i

  double scale() const { return alpha / static_cast<double>(r); }
};

/// True when module name `name` is selected by `pattern` (PEFT: equal, or ending in "." + pattern).
inline bool lora_target_matches(const std::string& name, const std::string& pattern) {
  if (name == pattern) return true;
  const std::string tail = "." + pattern;
  return name.size() > tail.size() && name.ends_with(tail);
}

/// The low-rank update of one Linear (Note [LoRA]): x [..., in] -> scale * B(A(dropout(x))) [..., out].
/// Parameters "lora_A.weight" [r, in] and "lora_B.weight" [out, r].
template <class T>
class LoraAdapter : public Module<T> {
 public:
  LoraAdapter(std::int64_t in, std::int64_t out, const LoraConfig& cfg, std::uint64_t dropout_seed,
              Generator& gen = default_generator())
      : r_(cfg.r), scale_(cfg.scale()) {
    drop_ = this->register_module("lora_dropout", std::make_shared<Dropout<T>>(cfg.dropout, dropout_seed));
    a_ = this->register_module("lora_A", std::make_shared<Linear<T>>(in, cfg.r, false, gen));
    b_ = this->register_module("lora_B", std::make_shared<Linear<T>>(cfg.r, out, false, gen));
    b_->weight().value.zero_();
  }

  /// scale * B A dropout(x); undefined while merged (the base weight holds the update).
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    if (merged_) return {};
    auto y = b_->forward(a_->forward(drop_->forward(x, cache.child(0)), cache.child(1)), cache.child(2));
    ops::scale_(y, static_cast<acc_t<T>>(scale_));
    return y;
  }
  /// Accumulates A's and B's gradients; returns the update's part of dx (undefined while merged).
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    if (cache.empty()) {
      PTRAIN_CHECK(merged_, Error, "[ptrain.backward] LoraAdapter::backward without a forward");
      return {};
    }
    auto g = dy.clone();
    ops::scale_(g, static_cast<acc_t<T>>(scale_));
    auto dx = drop_->backward(a_->backward(b_->backward(g, cache.child(2)), cache.child(1)), cache.child(0));
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    return "LoraAdapter(r=" + std::to_string(r_) + ", scale=" + std::to_string(scale_) + ")";
  }

  /// weight += sign * scale * B A, in the weight's type.
  void add_to(Tensor<T>& weight, double sign) const {
    ops::matmul_into(b_->weight().value, a_->weight().value, weight, false, false,
                     static_cast<acc_t<T>>(sign * scale_), acc_t<T>(1));
  }
  bool merged() const { return merged_; }
  void set_merged(bool on) { merged_ = on; }
  Linear<T>& lora_A() { return *a_; }
  Linear<T>& lora_B() { return *b_; }
  double scale() const { return scale_; }

 private:
  std::int64_t r_;
  double scale_;
  bool merged_ = false;
  std::shared_ptr<Dropout<T>> drop_;
  std::shared_ptr<Linear<T>> a_, b_;
};

namespace detail {
// Calls fn(path, linear) for every Linear of the tree, depth-first in registration order
// (named_parameters() order); adapters' own Linears are not visited.
template <class T, class Fn>
void for_each_linear(Module<T>& m, const std::string& path, Fn&& fn) {
  for (const auto& [name, child] : m.children()) {
    if (dynamic_cast<LoraAdapter<T>*>(child.get())) continue;
    const std::string p = name.empty() ? path : path.empty() ? name : path + "." + name;
    if (auto* lin = dynamic_cast<Linear<T>*>(child.get())) fn(p, *lin);
    for_each_linear(*child, p, fn);
  }
}
}  // namespace detail

/// Adds a LoRA adapter to every Linear of `model` that cfg.target_modules selects and
/// freezes every other parameter (Note [LoRA]). Returns the adapters' parameter names
/// ("<linear>.lora_A.weight", "<linear>.lora_B.weight"), in named_parameters() order.
/// Call it before an engine packs the model. A draws from `gen`.
template <class T>
std::vector<std::string> apply_lora(Module<T>& model, const LoraConfig& cfg, Generator& gen = default_generator()) {
  PTRAIN_CHECK(cfg.r > 0, Error, "[ptrain.lora.config] rank r = ", cfg.r, " must be positive");
  PTRAIN_CHECK(cfg.alpha > 0, Error, "[ptrain.lora.config] alpha = ", cfg.alpha, " must be positive");
  PTRAIN_CHECK(cfg.dropout >= 0 && cfg.dropout < 1, Error, "[ptrain.lora.config] dropout ", cfg.dropout,
               " must be in [0, 1)");
  PTRAIN_CHECK(cfg.bias == "none", Error, "[ptrain.lora.config] bias '", cfg.bias,
               "' is not supported; use \"none\" (every bias stays frozen)");
  PTRAIN_CHECK(!cfg.target_modules.empty(), Error,
               "[ptrain.lora.config] target_modules is empty; name the Linear layers to adapt, e.g. q_proj, v_proj");
  std::vector<std::pair<std::string, Linear<T>*>> targets;
  detail::for_each_linear(model, "", [&](const std::string& path, Linear<T>& lin) {
    for (const auto& pattern : cfg.target_modules)
      if (lora_target_matches(path, pattern)) {
        targets.emplace_back(path, &lin);
        return;
      }
  });
  PTRAIN_CHECK(!targets.empty(), Error, "[ptrain.lora.targets] no Linear layer of ", model.describe(),
               " matches target_modules; patterns match a module name or its last dotted parts (q_proj matches "
               "layers.0.self_attn.q_proj): list the names with named_parameters()");
  for (const auto& [path, lin] : targets) {
    PTRAIN_CHECK(typeid(*lin) == typeid(Linear<T>), Error, "[ptrain.lora.target] ", path, " is a ", lin->describe(),
                 ", whose own forward would leave an adapter out; LoRA adapts plain nn::Linear layers");
    PTRAIN_CHECK(!lin->adapter(), Error, "[ptrain.lora.target] ", path,
                 " already has an adapter; apply_lora once per model");
  }
  std::uint64_t i = 0;
  for (const auto& [path, lin] : targets) {
    const Tensor<T>& w = lin->weight().value;
    auto adapter = std::make_shared<LoraAdapter<T>>(w.size(1), w.size(0), cfg, cfg.dropout_seed + i++, gen);
    adapter->to(w.device());
    lin->set_adapter(adapter);
  }
  std::vector<std::string> names;
  for (auto& p : model.named_parameters())
    if (p.name.find("lora_") == std::string::npos) p.param->set_requires_grad(false);
    else names.push_back(p.name);
  return names;
}

/// The adapted Linears of `model` with their module names and adapters, in named_parameters() order.
template <class T>
std::vector<std::pair<std::string, LoraAdapter<T>*>> lora_adapters(Module<T>& model) {
  std::vector<std::pair<std::string, LoraAdapter<T>*>> out;
  detail::for_each_linear(model, "", [&](const std::string& path, Linear<T>& lin) {
    if (auto* a = dynamic_cast<LoraAdapter<T>*>(lin.adapter())) out.emplace_back(path, a);
  });
  return out;
}

/// W += scale * B A in every adapted Linear; the adapters then add nothing (Note [LoRA]).
template <class T>
void merge_lora(Module<T>& model) {
  detail::for_each_linear(model, "", [](const std::string&, Linear<T>& lin) {
    if (auto* a = dynamic_cast<LoraAdapter<T>*>(lin.adapter()); a && !a->merged()) {
      a->add_to(lin.weight().value, 1);
      a->set_merged(true);
    }
  });
}

/// Undoes merge_lora: W -= scale * B A, and the adapters add their update again.
template <class T>
void unmerge_lora(Module<T>& model) {
  detail::for_each_linear(model, "", [](const std::string&, Linear<T>& lin) {
    if (auto* a = dynamic_cast<LoraAdapter<T>*>(lin.adapter()); a && a->merged()) {
      a->add_to(lin.weight().value, -1);
      a->set_merged(false);
    }
  });
}

}  // namespace ptrain::nn
