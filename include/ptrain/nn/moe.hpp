#pragma once
// Mixture of experts: a router picks k of E SwiGLU experts per token, the tokens
// run through their experts grouped by expert, and each token's output is the
// weighted sum of its k expert outputs (Mixtral's MixtralSparseMoeBlock; DeepSeek's
// MoE with shared experts; Qwen2-MoE's gated shared expert).
//
//   x [..., C] -> MoE -> y [..., C]
//
//   MoeRouter  "gate"        logits = x W^T [N, E]; softmax or sigmoid scores; top-k;
//                            optional renormalisation; load-balancing and z-losses
//   MoeExperts "experts"     expert e: w2(silu(w1 x) * w3 x), on its tokens only
//   SwiGLU     "shared_experts"      optional, every token (DeepSeek), optionally
//   Linear     "shared_expert_gate"  scaled by sigmoid(x W_g^T) (Qwen2-MoE)
//
// Parameter names follow Hugging Face's Mixtral inside a block_sparse_moe:
// "gate.weight", "experts.{e}.w1.weight" (gate projection, [F, C]),
// "experts.{e}.w2.weight" (down, [C, F]), "experts.{e}.w3.weight" (up, [F, C]);
// shared experts take DeepSeek's "shared_experts.{gate,up,down}_proj.weight".
// CPU and CUDA (ops/moe.hpp); docs/moe.md has the maths, the memory and the limits.
//
//   nn::MoeConfig c;
//   c.n_embd = 256; c.num_experts = 8; c.top_k = 2; c.expert_hidden = 512;
//   c.aux_loss_coef = 0.01;
//   nn::MoE<float> moe(c);
//   auto y = moe.forward(x, cache);          // x [B, S, 256]
//   moe.stats().aux_loss;                    // the latest forward's routing statistics
//   moe.window_stats().tokens_per_expert;    // summed over the training forwards since reset_window()
//
// Note [The dispatch seam]
// forward() runs three steps, and expert parallelism cuts between them:
//   1. route and permute (token order): the router's plan says where each of a
//      token's k slots goes; moe_gather copies the token rows into one buffer
//      grouped by expert, expert e's rows at [offsets[e], offsets[e + 1]).
//   2. run experts (expert order): MoeExperts::forward_grouped runs each
//      expert's SwiGLU on its segment (one grouped GEMM per projection).
//   3. combine (token order): moe_combine sums each token's k expert outputs,
//      weighted, in slot order.
// With experts spread over an expert-parallel group, an all-to-all goes between
// 1 and 2 (rank r receives the segments of its experts from every rank: split
// sizes are sums of offsets' segments, exchanged first) and its reverse between
// 2 and 3; backward mirrors both (dyp out, dxp back). Steps 1 and 3 need only
// the plan; step 2 needs only its segments' row counts. Step 2 is a MoeDispatch
// when one is set (MoE::shard_experts; parallel::ExpertParallelDispatch does the
// all-to-alls); docs/moe.md gives the traffic per layer.
//
// Note [MoE metrics window]
// stats() is the latest forward call's routing, whatever the mode; a step of several
// micro-batches (gradient accumulation, pipeline micro-batches) or an evaluation after it
// would leave only the last one there. So each layer also keeps a window (MoeWindow): sums
// over the training forwards since reset_window(), what named_metrics() reports and what
// the Trainer writes at each report before resetting (Megatron-Core's MoE aux-loss tracker
// does the same over an iteration's micro-batches):
// - Which forwards: those run in training mode (Module::training()) whose backward has run.
//   forward() keeps its statistics in its cache and backward() adds them, so an evaluation
//   forward counts nothing and a forward that Recompute replays in backward counts once.
// - tokens_per_expert and dropped are summed over the window's forwards (the step's token
//   slots), load_imbalance is max / mean of those sums, capacity is the latest counted
//   forward's. aux_loss, z_loss and loss are the mean over the forwards, each forward
//   weighing 1 whatever its tokens: each is a per-forward quantity (the load-balancing loss
//   is a product of two means over the call's tokens, not a sum over tokens) that backward
//   differentiates once per forward, as Megatron-Core averages over micro-batches.
// - parallel::all_reduce_moe_stats ends the window (end_window) with its sums over the
//   ranks (one all-reduce); the next counted forward starts a new one rather than adding
//   this rank's tokens to every rank's sums, so a loop that reduces after every step (or
//   every report) reports each step (or report window) without a reset of its own. A model
//   that never resets nor reduces reports everything since its construction.
// Cost: E + 5 host numbers per training forward in its cache, E + 5 additions per backward.

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "ptrain/nn/linear.hpp"
#include "ptrain/nn/swiglu.hpp"
#include "ptrain/ops/activation.hpp"
#include "ptrain/ops/moe.hpp"

namespace ptrain::nn {

/// The hyperparameters of an MoE layer.
struct MoeConfig {
  std::int64_t n_embd = 0;          ///< C, the model width
  std::int64_t num_experts = 8;     ///< E
  std::int64_t top_k = 2;           ///< k experts per token
  std::int64_t expert_hidden = 0;   ///< F, each expert's SwiGLU width (Mixtral's intermediate_size)
  kernels::MoeScore score = kernels::MoeScore::Softmax;  ///< Softmax (Mixtral, Qwen) or Sigmoid (DeepSeek-V3)
  bool renormalize = true;          ///< the k weights divided by their sum (Mixtral; Qwen's norm_topk_prob)
  double routed_scale = 1.0;        ///< the routed weights' factor (DeepSeek's routed_scaling_factor)
  double capacity_factor = 0;       ///< > 0: each expert keeps ceil(factor * N * k / E) slots; 0: dropless
  double aux_loss_coef = 0;         ///< load-balancing loss coefficient (Mixtral's router_aux_loss_coef)
  double z_loss_coef = 0;           ///< router z-loss coefficient (ST-MoE: 1e-3)
  std::int64_t shared_hidden = 0;   ///< the shared experts' SwiGLU width (DeepSeek: n_shared_experts * F); 0: none
  bool shared_gate = false;         ///< scale the shared output by sigmoid(x W_g^T) (Qwen2-MoE)
};

/// What one forward call's routing looked like (docs/moe.md, "Routing").
struct MoeStats {
  double aux_loss = 0;       ///< E * sum_e f_e P_e (k when perfectly balanced), before its coefficient
  double z_loss = 0;         ///< mean over tokens of logsumexp(logits)^2, before its coefficient
  double loss = 0;           ///< aux_loss_coef * aux_loss + z_loss_coef * z_loss: what backward differentiates
  std::vector<std::int64_t> tokens_per_expert;  ///< token slots routed to each expert (before capacity)
  std::int64_t capacity = 0; ///< slots each expert keeps; 0: dropless
  std::int64_t dropped = 0;  ///< slots beyond their expert's capacity (they add nothing to the output)
  double max_load = 0;       ///< max over experts of tokens_per_expert
  double mean_load = 0;      ///< mean over experts of tokens_per_expert (N * k / E)
};

/// Sums over the counted forwards of a metrics window (Note [MoE metrics window]);
/// stats() summarises them as one MoeStats.
struct MoeWindow {
  std::int64_t forwards = 0;                    ///< training forwards counted (summed over ranks when reduced)
  std::vector<std::int64_t> tokens_per_expert;  ///< summed; empty while forwards == 0
  std::int64_t dropped = 0;                     ///< summed
  double aux_loss = 0, z_loss = 0, loss = 0;    ///< summed over the forwards (stats() takes their mean)
  std::int64_t capacity = 0;                    ///< the latest counted forward's

  void add(const MoeStats& s) {
    tokens_per_expert.resize(s.tokens_per_expert.size(), 0);
    for (std::size_t e = 0; e < s.tokens_per_expert.size(); ++e) tokens_per_expert[e] += s.tokens_per_expert[e];
    dropped += s.dropped;
    aux_loss += s.aux_loss;
    z_loss += s.z_loss;
    loss += s.loss;
    capacity = s.capacity;
    ++forwards;
  }
  /// The window as one MoeStats: counts and drops summed, losses averaged over the
  /// forwards, max_load and mean_load from the summed counts; empty when nothing counted.
  MoeStats stats() const {
    MoeStats s;
    if (forwards == 0 || tokens_per_expert.empty()) return s;
    s.tokens_per_expert = tokens_per_expert;
    s.dropped = dropped;
    s.capacity = capacity;
    s.aux_loss = aux_loss / double(forwards);
    s.z_loss = z_loss / double(forwards);
    s.loss = loss / double(forwards);
    s.max_load = double(*std::max_element(tokens_per_expert.begin(), tokens_per_expert.end()));
    for (auto n : tokens_per_expert) s.mean_load += double(n);
    s.mean_load /= double(tokens_per_expert.size());
    return s;
  }
};

namespace detail {
inline void check_moe_config(const MoeConfig& c) {
  PTRAIN_CHECK(c.n_embd > 0 && c.num_experts > 0 && c.expert_hidden > 0, Error,
               "[ptrain.moe.config] n_embd, num_experts and expert_hidden must be positive, got ", c.n_embd, ", ",
               c.num_experts, ", ", c.expert_hidden);
  PTRAIN_CHECK(c.top_k >= 1 && c.top_k <= c.num_experts, Error, "[ptrain.moe.config] top_k ", c.top_k,
               " must lie in [1, num_experts = ", c.num_experts, "]");
  PTRAIN_CHECK(c.capacity_factor >= 0 && c.aux_loss_coef >= 0 && c.z_loss_coef >= 0 && c.shared_hidden >= 0, Error,
               "[ptrain.moe.config] capacity_factor, aux_loss_coef, z_loss_coef and shared_hidden must be >= 0");
  PTRAIN_CHECK(!c.shared_gate || c.shared_hidden > 0, Error,
               "[ptrain.moe.config] shared_gate needs shared experts: set shared_hidden > 0");
}
}  // namespace detail

/// The router: x [N, C] -> the k routing weights per token [N, k]. Its forward also
/// plans the permutation (ops::moe_permute_plan, with the capacity) and the statistics;
/// backward takes the weights' gradient and adds the auxiliary losses' (their
/// coefficients times their gradients) before the scores' backward. Parameter "weight" [E, C].
template <class T>
class MoeRouter : public Module<T> {
 public:
  using A = acc_t<T>;

  explicit MoeRouter(const MoeConfig& c, Generator& gen = default_generator()) : cfg_(c) {
    detail::check_moe_config(c);
    weight_ = &this->register_parameter("weight",
                                        detail::fan_in_uniform<T>({c.num_experts, c.n_embd}, c.n_embd, gen));
  }

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    PTRAIN_CHECK(x.dim() == 2 && x.size(1) == cfg_.n_embd && x.size(0) > 0, ShapeError, "[ptrain.moe.router] input ",
                 x.shape(), " must be [tokens > 0, ", cfg_.n_embd, "]");
    const std::int64_t N = x.size(0), E = cfg_.num_experts, k = cfg_.top_k;
    auto logits = ops::linear(x, weight_->value, Tensor<T>());
    auto r = ops::moe_route(logits, k, cfg_.score, cfg_.renormalize, cfg_.routed_scale);
    const std::int64_t capacity =
        cfg_.capacity_factor > 0 && plan_capacity_
            ? static_cast<std::int64_t>(std::ceil(cfg_.capacity_factor * static_cast<double>(N * k) / double(E)))
            : 0;
    auto plan = ops::moe_permute_plan(r.experts, E, capacity);

    MoeStats s;
    const auto P = ops::moe_mean_probs(r.probs);
    // The fractions f_e of the load-balancing loss: this call's, or over the ranks (set_count_reducer).
    std::vector<double> counts(plan.routed.begin(), plan.routed.end());
    counts.push_back(double(N));
    if (reduce_counts_) reduce_counts_(counts);
    for (std::int64_t e = 0; e < E; ++e)
      s.aux_loss += counts[static_cast<std::size_t>(e)] / counts.back() * P[static_cast<std::size_t>(e)];
    s.aux_loss *= double(E);
    s.z_loss = ops::sum_squares(r.lse) / double(N);
    s.loss = cfg_.aux_loss_coef * s.aux_loss + cfg_.z_loss_coef * s.z_loss;
    s.tokens_per_expert = plan.routed;
    s.capacity = capacity;
    s.dropped = N * k - plan.rows();
    s.max_load = double(*std::max_element(plan.routed.begin(), plan.routed.end()));
    s.mean_load = double(N * k) / double(E);
    stats_ = std::move(s);

    cache.tensors = {x, logits, r.weights};
    cache.stats = {r.lse};
    if (reduce_counts_) {
      std::vector<A> f;
      for (std::int64_t e = 0; e < E; ++e)
        f.push_back(static_cast<A>(counts[static_cast<std::size_t>(e)] / counts.back()));
      cache.stats.push_back(Tensor<A>::from(f, {E}));  // on the host: backward reads them
    }
    cache.indices = {r.experts, plan.pos, plan.token_of};
    cache.values.clear();
    for (auto v : plan.routed) cache.values.push_back(static_cast<std::uint64_t>(v));
    for (auto v : plan.offsets) cache.values.push_back(static_cast<std::uint64_t>(v));
    return r.weights;
  }

  /// dweights [N, k] -> dx [N, C]; adds to the weight's gradient.
  Tensor<T> backward(const Tensor<T>& dweights, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 3, Error, "[ptrain.backward] MoeRouter::backward without a forward");
    const Tensor<T>& x = cache.tensors[0];
    const std::int64_t N = x.size(0), E = cfg_.num_experts;
    const ops::MoePlan p = plan(cache);
    ops::MoeRouting<T> r{cache.indices[0], cache.tensors[2], {}, cache.stats[0]};
    // d(aux_loss_coef * E sum_e f_e P_e) / dp_te = aux_loss_coef E f_e / N with f_e = routed_e / N
    // (or the fractions over the ranks, set_count_reducer).
    Tensor<A> aux_grad;
    if (cfg_.aux_loss_coef != 0) {
      std::vector<A> g;
      for (std::int64_t e = 0; e < E; ++e) {
        const double f = cache.stats.size() > 1 ? double(cache.stats[1].data()[e]) : double(p.routed[e]) / double(N);
        g.push_back(static_cast<A>(loss_scale_ * cfg_.aux_loss_coef * double(E) * f / double(N)));
      }
      aux_grad = Tensor<A>::from(g, {E}).to(x.device());
    }
    auto dlogits = ops::moe_route_backward(cache.tensors[1], r, dweights, cfg_.score, cfg_.renormalize,
                                           cfg_.routed_scale, aux_grad, loss_scale_ * cfg_.z_loss_coef / double(N));
    auto dx = ops::linear_backward(x, weight_->value, dlogits, weight_->grad, static_cast<Tensor<T>*>(nullptr));
    weight_->mark_grad_ready();
    cache.clear();
    return dx;
  }

  /// The chosen experts [N, k] of the forward call that filled `cache` (best first).
  static const Tensor<std::int32_t>& experts(const Cache<T>& cache) { return cache.indices.at(0); }
  /// The permutation that forward call planned.
  ops::MoePlan plan(const Cache<T>& cache) const {
    PTRAIN_CHECK(cache.indices.size() == 3, Error, "[ptrain.moe.router] no routing in this cache; run forward first");
    const auto E = static_cast<std::ptrdiff_t>(cfg_.num_experts);
    ops::MoePlan p{cache.indices[1], cache.indices[2], {}, {}};
    for (auto it = cache.values.begin(); it != cache.values.end(); ++it)
      (it - cache.values.begin() < E ? p.routed : p.offsets).push_back(static_cast<std::int64_t>(*it));
    return p;
  }
  /// The latest forward call's statistics.
  const MoeStats& stats() const { return stats_; }
  /// Replaces what stats() reports (MoE::set_stats).
  void set_stats(MoeStats s) { stats_ = std::move(s); }
  /// false: plan every slot (dropless) whatever the capacity factor; a dispatch that
  /// applies the capacity itself (MoeDispatch::applies_capacity) drops instead.
  void set_plan_capacity(bool on) { plan_capacity_ = on; }
  /// Multiplies the auxiliary losses' gradients (not stats()): MoE::set_aux_loss_scale.
  void set_loss_scale(double s) { loss_scale_ = s; }
  /// Global-batch load balancing (Megatron-Core's global form): `reduce` sums the routed
  /// counts (E numbers) and the tokens (1 more) over the data-parallel ranks in every
  /// forward, and the load-balancing loss takes its fractions f_e from those sums
  /// (parallel::global_load_balance installs it); empty: this call's tokens.
  void set_count_reducer(std::function<void(std::vector<double>&)> reduce) { reduce_counts_ = std::move(reduce); }
  const MoeConfig& config() const { return cfg_; }
  Parameter<T>& weight() { return *weight_; }

  std::string describe() const override {
    return "MoeRouter(" + std::to_string(cfg_.n_embd) + " -> " + std::to_string(cfg_.num_experts) +
           ", top_k=" + std::to_string(cfg_.top_k) +
           (cfg_.score == kernels::MoeScore::Softmax ? ", softmax" : ", sigmoid") + ")";
  }

 private:
  MoeConfig cfg_;
  Parameter<T>* weight_ = nullptr;
  MoeStats stats_;
  bool plan_capacity_ = true;
  double loss_scale_ = 1;
  std::function<void(std::vector<double>&)> reduce_counts_;
};

/// One routed expert: Mixtral's MixtralBlockSparseTop2MLP, w2(silu(w1 x) * w3 x), no biases.
template <class T>
class MoeExpert : public Module<T> {
 public:
  MoeExpert(std::int64_t n_embd, std::int64_t hidden, Generator& gen = default_generator()) {
    w1_ = this->register_module("w1", std::make_shared<Linear<T>>(n_embd, hidden, false, gen));
    w2_ = this->register_module("w2", std::make_shared<Linear<T>>(hidden, n_embd, false, gen));
    w3_ = this->register_module("w3", std::make_shared<Linear<T>>(n_embd, hidden, false, gen));
  }
  /// The expert on its own (every row of x), as a SwiGLU.
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    auto gate = w1_->forward(x, cache.child(0));
    auto up = w3_->forward(x, cache.child(1));
    cache.tensors = {gate, up};
    return w2_->forward(ops::swiglu(gate, up), cache.child(2));
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 2, Error, "[ptrain.backward] MoeExpert::backward without a forward");
    auto dh = w2_->backward(dy, cache.child(2));
    Tensor<T> dgate, dup;
    ops::swiglu_backward(cache.tensors[0], cache.tensors[1], dh, dgate, dup);
    auto dx = w1_->backward(dgate, cache.child(0));
    ops::axpy_(1, w3_->backward(dup, cache.child(1)), dx);
    cache.clear();
    return dx;
  }
  std::string describe() const override { return "MoeExpert(" + w1_->describe() + ")"; }
  Linear<T>& w1() { return *w1_; }  ///< gate projection [F, C]
  Linear<T>& w2() { return *w2_; }  ///< down projection [C, F]
  Linear<T>& w3() { return *w3_; }  ///< up projection [F, C]

 private:
  std::shared_ptr<Linear<T>> w1_, w2_, w3_;
};

/// The E routed experts, run on tokens grouped by expert (Note [The dispatch seam]):
/// forward_grouped(xp, offsets) runs expert e on rows [offsets[e], offsets[e + 1]) of xp,
/// one grouped GEMM for all experts per projection (ops::grouped_matmul_into); one SwiGLU
/// product over all rows.
template <class T>
class MoeExperts : public Module<T> {
 public:
  /// Experts first .. first + num_experts - 1 of a layer, named by that global index
  /// (first > 0: one rank's share under expert parallelism, parallel/expert_parallel.hpp).
  MoeExperts(std::int64_t num_experts, std::int64_t n_embd, std::int64_t hidden, Generator& gen = default_generator(),
             std::int64_t first = 0)
      : n_embd_(n_embd), hidden_(hidden), first_(first) {
    for (std::int64_t e = 0; e < num_experts; ++e)
      experts_.push_back(
          this->register_module(std::to_string(first + e), std::make_shared<MoeExpert<T>>(n_embd, hidden, gen)));
  }

  /// Refused: the experts need their segments (forward_grouped).
  Tensor<T> forward(const Tensor<T>&, Cache<T>&) override {
    PTRAIN_THROW(Error, "[ptrain.moe.experts] MoeExperts runs on tokens grouped by expert: call "
                 "forward_grouped(x, offsets, cache), as nn::MoE does");
  }

  /// xp [M, C] grouped by expert, offsets [E + 1] (offsets[E] = M) -> [M, C].
  Tensor<T> forward_grouped(const Tensor<T>& xp, const std::vector<std::int64_t>& offsets, Cache<T>& cache) {
    const auto E = static_cast<std::int64_t>(experts_.size());
    PTRAIN_CHECK(static_cast<std::int64_t>(offsets.size()) == E + 1 && offsets[0] == 0 &&
                     std::is_sorted(offsets.begin(), offsets.end()),
                 ShapeError, "[ptrain.moe.experts] offsets must be E + 1 = ", E + 1,
                 " non-decreasing row offsets from 0");
    PTRAIN_CHECK(xp.dim() == 2 && xp.size(1) == n_embd_ && xp.size(0) == offsets.back(), ShapeError,
                 "[ptrain.moe.experts] input ", xp.shape(), " must be [", offsets.back(), ", ", n_embd_, "]");
    for (auto& ex : experts_)
      for (auto* lin : {&ex->w1(), &ex->w2(), &ex->w3()})
        PTRAIN_CHECK(!lin->adapter(), Error, "[ptrain.lora.moe] routed experts run as grouped GEMMs over their "
                     "weights, which leave out an adapter (LoRA) on w1, w2 or w3; leave the routed experts out of "
                     "target_modules");
    const std::int64_t M = xp.size(0);
    auto gate = Tensor<T>::empty({M, hidden_}, xp.device()), up = Tensor<T>::empty({M, hidden_}, xp.device());
    ops::grouped_matmul_into(xp, weights(0), offsets, gate, true);
    ops::grouped_matmul_into(xp, weights(2), offsets, up, true);
    const auto h = ops::swiglu(gate, up);
    auto y = Tensor<T>::empty({M, n_embd_}, xp.device());
    ops::grouped_matmul_into(h, weights(1), offsets, y, true);
    cache.tensors = {xp, gate, up};  // h is recomputed in backward
    cache.values.assign(offsets.begin(), offsets.end());
    return y;
  }

  /// dy [M, C] -> dx [M, C]; adds every expert's weight gradients and announces them.
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 3, Error, "[ptrain.backward] MoeExperts::backward without a forward");
    const std::vector<std::int64_t> offsets(cache.values.begin(), cache.values.end());
    const Tensor<T>&xp = cache.tensors[0], &gate = cache.tensors[1], &up = cache.tensors[2];
    check_shape(dy, xp.shape(), "MoE experts' output gradient");
    const std::int64_t M = xp.size(0);
    const auto h = ops::swiglu(gate, up);
    auto dh = Tensor<T>::empty({M, hidden_}, xp.device());
    ops::grouped_matmul_into(dy, weights(1), offsets, dh, false);
    ops::grouped_matmul_weight_grad(dy, h, offsets, weights(1, true));
    Tensor<T> dgate, dup;
    ops::swiglu_backward(gate, up, dh, dgate, dup);
    auto dx = Tensor<T>::empty({M, n_embd_}, xp.device());
    ops::grouped_matmul_into(dgate, weights(0), offsets, dx, false);
    ops::grouped_matmul_into(dup, weights(2), offsets, dx, false, 1, 1);
    ops::grouped_matmul_weight_grad(dgate, xp, offsets, weights(0, true));
    ops::grouped_matmul_weight_grad(dup, xp, offsets, weights(2, true));
    for (auto& ex : experts_)
      for (auto* lin : {&ex->w1(), &ex->w2(), &ex->w3()}) lin->weight().mark_grad_ready();
    cache.clear();
    return dx;
  }

  std::string describe() const override {
    return "MoeExperts(" + std::to_string(experts_.size()) + " x SwiGLU(" + std::to_string(n_embd_) +
           ", hidden=" + std::to_string(hidden_) + "))";
  }
  std::int64_t size() const { return static_cast<std::int64_t>(experts_.size()); }
  /// The global index of expert(0).
  std::int64_t first() const { return first_; }
  /// The e-th expert held here (global index first() + e).
  MoeExpert<T>& expert(std::int64_t e) { return *experts_.at(static_cast<std::size_t>(e)); }

 private:
  // Every expert's w1 (j = 0), w2 (1) or w3 (2) weight, or with `grads` its gradient
  // (undefined for a frozen weight, which the grouped GEMM skips: Note [Frozen parameters]).
  std::vector<Tensor<T>> weights(int j, bool grads = false) {
    std::vector<Tensor<T>> out;
    for (auto& ex : experts_) {
      const Parameter<T>& p = (j == 0 ? ex->w1() : j == 1 ? ex->w2() : ex->w3()).weight();
      out.push_back(!grads ? p.value : p.requires_grad ? p.grad : Tensor<T>());
    }
    return out;
  }

  std::int64_t n_embd_, hidden_, first_;
  std::vector<std::shared_ptr<MoeExpert<T>>> experts_;
};

/// Where the experts run on the grouped rows (Note [The dispatch seam]). Without one,
/// nn::MoE runs all E experts here; parallel::ExpertParallelDispatch sends each row to
/// the rank that holds its expert and brings the outputs back.
template <class T>
class MoeDispatch {
 public:
  virtual ~MoeDispatch() = default;
  /// xp [M, C] grouped by global expert (offsets [E + 1]) -> the experts' outputs [M, C], same rows.
  virtual Tensor<T> forward(MoeExperts<T>& local, const Tensor<T>& xp, const std::vector<std::int64_t>& offsets,
                            Cache<T>& cache) = 0;
  /// dyp [M, C] -> dxp [M, C]; adds to the local experts' gradients.
  virtual Tensor<T> backward(MoeExperts<T>& local, const Tensor<T>& dyp, Cache<T>& cache) = 0;
  /// Whether forward applies the layer's capacity itself (over several ranks): the layer
  /// then plans every slot and a dropped slot's output row comes back zero, with no
  /// gradient to the router through it (its weight's gradient is dy . 0).
  virtual bool applies_capacity() const { return false; }
  /// With applies_capacity(): the latest forward's capacity per expert and the slots it
  /// dropped at this rank's experts (the layer's stats() report them).
  virtual std::int64_t capacity() const { return 0; }
  virtual std::int64_t dropped() const { return 0; }
};

/// The MoE layer: x [..., C] -> y [..., C] (file comment).
template <class T>
class MoE : public Module<T> {
 public:
  explicit MoE(const MoeConfig& c, Generator& gen = default_generator()) : cfg_(c) {
    detail::check_moe_config(c);
    router_ = this->register_module("gate", std::make_shared<MoeRouter<T>>(c, gen));
    experts_ = this->register_module(
        "experts", std::make_shared<MoeExperts<T>>(c.num_experts, c.n_embd, c.expert_hidden, gen));
    if (c.shared_hidden > 0) {
      shared_ = this->register_module("shared_experts",
                                      std::make_shared<SwiGLU<T>>(c.n_embd, c.shared_hidden, false, gen));
      if (c.shared_gate)
        shared_gate_ =
            this->register_module("shared_expert_gate", std::make_shared<Linear<T>>(c.n_embd, 1, false, gen));
    }
  }

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    PTRAIN_CHECK(x.dim() >= 1 && x.size(-1) == cfg_.n_embd, ShapeError, "[ptrain.moe] input ", x.shape(),
                 " does not end in ", cfg_.n_embd);
    const auto x2 = x.reshape({-1, cfg_.n_embd});
    // 1. Route, and permute the token rows into expert-grouped order.
    Cache<T>& rc = cache.child(0);
    const auto w = router_->forward(x2, rc);
    const ops::MoePlan plan = router_->plan(rc);
    const auto xp = ops::moe_gather(x2, plan);
    // 2. Run each expert on its segment (expert parallelism: all-to-all before and after).
    const auto yp = dispatch_ ? dispatch_->forward(*experts_, xp, plan.offsets, cache.child(1))
                              : experts_->forward_grouped(xp, plan.offsets, cache.child(1));
    if (dispatch_ && dispatch_->applies_capacity()) {  // the drops happened at the experts' ranks
      MoeStats s = router_->stats();
      s.capacity = dispatch_->capacity();
      s.dropped = dispatch_->dropped();
      router_->set_stats(std::move(s));
    }
    cache.values.clear();
    if (this->training()) keep_stats(router_->stats(), cache);  // backward counts them
    // 3. Combine each token's k outputs, weighted, in token order.
    auto y = ops::moe_combine(yp, plan.pos, w);
    cache.tensors = {w, yp};
    if (shared_) {
      auto ys = shared_->forward(x2, cache.child(2));
      if (shared_gate_) {
        const auto g = ops::sigmoid(shared_gate_->forward(x2, cache.child(3)));  // [N, 1]
        cache.tensors.insert(cache.tensors.end(), {ys, g});
        ys = ops::moe_combine(ys, Tensor<std::int32_t>(), g);                   // row t times g[t]
      }
      ops::axpy_(1, ys, y);
    }
    return y.reshape(x.shape());
  }

  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() >= 2, Error, "[ptrain.backward] MoE::backward without a forward");
    count_stats(cache);
    const auto dy2 = dy.reshape({-1, cfg_.n_embd});
    Cache<T>& rc = cache.child(0);
    const ops::MoePlan plan = router_->plan(rc);
    Tensor<T> dyp, dw;
    ops::moe_combine_backward(cache.tensors[1], plan.pos, cache.tensors[0], dy2, dyp, dw);
    const auto dxp =
        dispatch_ ? dispatch_->backward(*experts_, dyp, cache.child(1)) : experts_->backward(dyp, cache.child(1));
    auto dx = ops::moe_gather_backward(dxp, plan);
    ops::axpy_(1, router_->backward(dw, rc), dx);
    if (shared_) {
      Tensor<T> dys = dy2;
      if (shared_gate_) {
        Tensor<T> dg;
        ops::moe_combine_backward(cache.tensors[2], Tensor<std::int32_t>(), cache.tensors[3], dy2, dys, dg);
        ops::axpy_(1, shared_gate_->backward(ops::sigmoid_backward(cache.tensors[3], dg), cache.child(3)), dx);
      }
      ops::axpy_(1, shared_->backward(dys, cache.child(2)), dx);
    }
    cache.clear();
    return dx.reshape(dy.shape());
  }

  std::string describe() const override {
    return "MoE(" + std::to_string(cfg_.n_embd) + ", experts=" + std::to_string(cfg_.num_experts) +
           ", top_k=" + std::to_string(cfg_.top_k) + ", hidden=" + std::to_string(cfg_.expert_hidden) +
           (shared_ ? ", shared=" + std::to_string(cfg_.shared_hidden) : std::string()) + ")";
  }
  /// The latest forward call's routing statistics (training or evaluation).
  const MoeStats& stats() const { return router_->stats(); }
  /// The sums over the training forwards of the metrics window (Note [MoE metrics window]).
  const MoeWindow& window() const { return window_; }
  /// window() as one MoeStats (what named_metrics() reports); empty when nothing counted.
  MoeStats window_stats() const { return window_.stats(); }
  /// Starts a new, empty window (parallel::reset_moe_metrics: every layer of a model).
  void reset_window() {
    window_ = {};
    window_ended_ = false;
  }
  /// Ends the window with `over` as its sums (parallel::all_reduce_moe_stats: the sums over
  /// the ranks): window() reports them until the next counted forward starts a new window.
  void end_window(MoeWindow over) {
    window_ = std::move(over);
    window_ended_ = true;
  }
  const MoeConfig& config() const { return cfg_; }
  MoeRouter<T>& router() { return *router_; }
  MoeExperts<T>& experts() { return *experts_; }
  /// Keeps only experts [first, first + count) (their values copied, their global names
  /// kept) and runs the experts through `dispatch` from now on: expert parallelism
  /// (parallel/expert_parallel.hpp). Before any forward; the gradients start at zero.
  void shard_experts(std::int64_t first, std::int64_t count, std::shared_ptr<MoeDispatch<T>> dispatch) {
    PTRAIN_CHECK(experts_->first() == 0 && experts_->size() == cfg_.num_experts && first >= 0 && count > 0 &&
                     first + count <= cfg_.num_experts && dispatch,
                 Error, "[ptrain.moe.shard] experts [", first, ", ", first + count, ") of ", cfg_.num_experts,
                 " cannot be kept: the layer must hold all of them (shard once) and the range must lie inside");
    Generator scratch(0);  // the values are copied from the full experts
    auto mine = std::make_shared<MoeExperts<T>>(count, cfg_.n_embd, cfg_.expert_hidden, scratch, first);
    mine->to(router_->weight().value.device());
    for (std::int64_t e = 0; e < count; ++e)
      for (int j = 0; j < 3; ++j) {
        auto pick = [j](MoeExpert<T>& x) -> Linear<T>& { return j == 0 ? x.w1() : j == 1 ? x.w2() : x.w3(); };
        const Parameter<T>& full = pick(experts_->expert(first + e)).weight();
        Parameter<T>& kept = pick(mine->expert(e)).weight();
        kept.value.copy_(full.value);
        kept.set_requires_grad(full.requires_grad);  // a frozen expert stays frozen
      }
    experts_ = this->replace_module("experts", std::move(mine));
    dispatch_ = std::move(dispatch);
    router_->set_plan_capacity(!dispatch_->applies_capacity());
  }
  /// Undoes shard_experts(): `all` (every expert, first() == 0, its values gathered by the
  /// caller: parallel::gather_experts) runs here again, without a dispatch.
  void unshard_experts(std::shared_ptr<MoeExperts<T>> all) {
    PTRAIN_CHECK(all && all->first() == 0 && all->size() == cfg_.num_experts, Error, "[ptrain.moe.shard] "
                 "unshard_experts needs all ", cfg_.num_experts, " experts, from expert 0");
    retired_ = experts_;  // an engine built on the sharded layer still refers to their parameters
    experts_ = this->replace_module("experts", std::move(all));
    dispatch_.reset();
    router_->set_plan_capacity(true);
  }
  /// Backward differentiates s times the auxiliary losses (stats() still reports them
  /// unscaled): a layer that routes 1/tp of its replica's tokens under tensor parallelism
  /// takes 1/tp, so the replica's losses are the mean over its tp slices
  /// (parallel/tp_moe.hpp).
  void set_aux_loss_scale(double s) { router_->set_loss_scale(s); }
  SwiGLU<T>* shared_experts() { return shared_.get(); }
  Linear<T>* shared_expert_gate() { return shared_gate_.get(); }

 protected:
  /// The window's routing (window_stats(), Note [MoE metrics window]) for
  /// Module::named_metrics(): aux_loss and z_loss (before their coefficients) and moe_loss
  /// (loss), averaged over the forwards; dropped slots and tokens_per_expert.{e}, summed;
  /// load_imbalance (max_load / mean_load of the sums).
  void own_metrics(const std::string& prefix, std::vector<std::pair<std::string, double>>& out) override {
    const MoeStats s = window_stats();
    if (s.tokens_per_expert.empty()) return;  // nothing counted yet
    out.insert(out.end(), {{prefix + "aux_loss", s.aux_loss},
                           {prefix + "z_loss", s.z_loss},
                           {prefix + "moe_loss", s.loss},
                           {prefix + "dropped", double(s.dropped)},
                           {prefix + "load_imbalance", s.mean_load > 0 ? s.max_load / s.mean_load : 0.0}});
    for (std::size_t e = 0; e < s.tokens_per_expert.size(); ++e)
      out.emplace_back(prefix + "tokens_per_expert." + std::to_string(e), double(s.tokens_per_expert[e]));
  }

 private:
  // A training forward's statistics in its cache (E counts, then 5 doubles' bits), which
  // backward adds to the window (Note [MoE metrics window]).
  static void keep_stats(const MoeStats& s, Cache<T>& cache) {
    for (auto n : s.tokens_per_expert) cache.values.push_back(static_cast<std::uint64_t>(n));
    for (double v : {double(s.dropped), double(s.capacity), s.aux_loss, s.z_loss, s.loss})
      cache.values.push_back(std::bit_cast<std::uint64_t>(v));
  }
  void count_stats(const Cache<T>& cache) {
    const auto E = static_cast<std::size_t>(cfg_.num_experts);
    if (cache.values.size() != E + 5) return;  // an evaluation forward
    auto at = [&](std::size_t i) { return std::bit_cast<double>(cache.values[E + i]); };
    MoeStats s;
    for (std::size_t e = 0; e < E; ++e) s.tokens_per_expert.push_back(static_cast<std::int64_t>(cache.values[e]));
    s.dropped = static_cast<std::int64_t>(at(0));
    s.capacity = static_cast<std::int64_t>(at(1));
    s.aux_loss = at(2);
    s.z_loss = at(3);
    s.loss = at(4);
    if (window_ended_) reset_window();
    window_.add(s);
  }

  MoeConfig cfg_;
  std::shared_ptr<MoeRouter<T>> router_;
  std::shared_ptr<MoeExperts<T>> experts_, retired_;  // retired_: the shards before unshard_experts()
  std::shared_ptr<MoeDispatch<T>> dispatch_;
  std::shared_ptr<SwiGLU<T>> shared_;
  std::shared_ptr<Linear<T>> shared_gate_;
  MoeWindow window_;
  bool window_ended_ = false;  // end_window(): the next counted forward starts a new window
};

}  // namespace ptrain::nn
