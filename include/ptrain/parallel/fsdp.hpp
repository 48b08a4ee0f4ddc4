#pragma once
// Fully sharded data parallel (ZeRO): each rank keeps 1/N of the parameters,
// gradients and optimizer state, and gathers a unit's parameters just before
// the unit runs.
//
//   parallel::FSDP<float> fsdp(gpt.units(), comm);         // shards; the model's own tensors are released
//   optim::AdamW<float> opt(fsdp.parameters(), {...});    // this rank's shard
//   fsdp.zero_grad();
//   double loss = fsdp.forward_backward(ids, targets);     // all-gather unit by unit, prefetching the next;
//                                                          // reduce-scatter each unit's grads in backward
//   fsdp.step(opt);                                        // waits for them, steps the local shard
//                                                          // (and re-gathers if the strategy keeps full copies)
//
// An Engine (parallel/engine.hpp); forward() and backward() are there too, as for any Module.
//
// Note [FSDP units and groups]
// The model is an ordered list of units (GPT::units(), Sequential::units()),
// run in order by forward and in reverse by backward. Parameters are flattened
// per *group*: normally one group per unit, but units that share a parameter
// (a module's borrowed_parameters(), e.g. an LM head tied to the embedding)
// are merged into one group, which then stays gathered from its first unit to
// its last (PyTorch keeps such parameters in the root unit). Units without
// parameters have no group. A group's flat buffer is padded to a multiple of
// the shard-group size Ns and rank r owns elements [r S, (r + 1) S), S = padded / Ns.
// All local shards live in one flat buffer, so the optimizer updates a rank's
// whole shard in one call.
//
// Note [Sharding strategies]   (memory per rank for fp32 AdamW, Ψ parameters)
//   FullShard (ZeRO-3)      shards params, grads, optimizer state         16Ψ/N
//   ShardGradOp (ZeRO-2)    full params kept; grads + state sharded       4Ψ + 16Ψ/N
//   ShardOptimizer (ZeRO-1) full params and grads kept; state sharded     8Ψ + 16Ψ/N
//   NoShard                 DDP-equivalent (local shard = everything)     16Ψ
//   Hybrid                  FullShard inside groups of Ns consecutive
//                           ranks, replicated across the N/Ns groups     16Ψ/Ns
// The 16Ψ/N of ZeRO-1/2 counts the optimizer's master copy of the shard
// (4Ψ/N) besides grads and state: the full parameters live in per-group
// buffers, and the shard the optimizer updates must be one contiguous buffer.
//
// Note [Prefetch and overlap]
// Before a unit computes, the all-gather of the next group it will need is
// issued (forward: the next unit; backward: the previous one), so the
// communicator's worker thread gathers while this unit computes. A group's
// reduce-scatter starts as soon as its first unit's backward ends and is waited
// for when the next group's starts (so at most two full gradient buffers are
// alive) or in finish_gradient_sync().
//
// Note [FSDP units built one at a time]
// FSDP(num_units, make_unit, comm) never holds the whole model: it builds unit
// u, broadcasts rank 0's values of it (on the shard device), keeps this rank's
// shard, frees the unit's full tensors and only then builds unit u + 1. Peak
// memory is the shards (twice, briefly: they are copied into the one local
// buffer once its size is known) plus one unit, where building the model first
// would hold all of it (and its gradients). The units are then the same as
// from FSDP(units, comm) on a built model, and rank 0's values are the same if
// the factory gives each unit the values the whole model would (nn::gpt_unit).
// Units built alone cannot share parameters (a tied LM head borrows the
// embedding's weight): such a factory is refused. ShardGradOp, ShardOptimizer
// and NoShard keep the full parameters anyway: their units are built first.
//
// Note [Frozen parameters under FSDP]
// A group's frozen parameters (Parameter::requires_grad false; Note [Frozen
// parameters] in nn/flat_parameters.hpp) form a second flat buffer beside its
// trainable one, padded and sharded the same way: rank r keeps elements
// [r F, (r + 1) F) of it in frozen_values(), outside parameters(), so the
// optimizer never sees them. They are gathered with the trainable ones for
// forward and backward (a second all-gather) and released with them, but have no
// gradient: no gradient buffer, no reduce-scatter, no optimizer state. A group
// whose parameters are all frozen has no reduction at all. The strategies that
// keep full parameters (ShardGradOp, ShardOptimizer, NoShard) keep the frozen
// ones whole and no frozen shard besides: frozen_values() is then the whole
// frozen buffer. Freeze parameters before wrapping the units. The bytes per rank
// are in docs/finetuning.md.
//
// Note [Accumulation]
// With sharded gradients (FullShard, ShardGradOp, Hybrid) every backward
// reduce-scatters into the local shard, which accumulates across backward
// passes: accumulating k micro-batches never keeps full gradients between
// them. ShardOptimizer and NoShard keep full gradients; inside no_sync() they
// accumulate locally and the next synchronised backward reduces them.
//
// Note [FSDP with expert parallelism]
// FSDPOptions{.expert_parallel = ep} (torchtitan's layout): the world is the dp x ep
// mesh of Note [Expert-parallel layout] (expert_parallel.hpp). Each rank keeps only its
// E/ep experts of every nn::MoE layer (parallel::shard_experts, before grouping), which
// run through the all-to-all dispatch. The dense parameters (attention, norms, router,
// shared experts, embeddings, head) form the groups above, sharded over the world; each
// unit's routed experts form a group of their own, sharded over expert_data_group() (the
// dp ranks holding the same experts), gathered and released with the unit's group.
// - Gradients: a dense group's are averaged over the world (reduce-scatter); an expert
//   group's averaged over the expert-data group and divided by ep, as DDP does (Note
//   [Expert-parallel layout]): each rank's loss is its own tokens' mean, and expert e's
//   gradient sums the contributions of its whole expert-parallel group.
// - Clipping: each element of the model lies in exactly one world rank's shards (a dense
//   one in one rank's world shard; an expert in one ep index, and there in one dp rank's
//   shard), so the squared norms add up over the world, each expert counted once.
// - Checkpoints: pieces keep the experts' global names (experts.{e}.w1.weight), so the
//   dp ranks of each ep index together write each expert once, and a checkpoint loads at
//   any ep, under DDP with expert parallelism and in one process; load_fsdp reads this
//   rank's experts' pieces and accepts the others' names (expert_names()).
// - Why an FSDPOptions field (as DDPOptions::expert_parallel) and not a separate engine:
//   the sharding is FSDP's own (units, groups, prefetch, reduce-scatter); experts differ
//   only in the communicator a group is sharded over and the 1/ep on their gradients.
// - Strategies: FullShard, ShardGradOp and ShardOptimizer (their shard group is the
//   world); NoShard and Hybrid are refused ([ptrain.ep.strategy]): their replica
//   all-reduce would mix different experts. full_parameters() gives the dense parameters
//   and this rank's experts; parallel::gather_experts then gives world rank 0 every
//   expert (gpt_char does this to sample and export).

#include <algorithm>
#include <array>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "ptrain/dist/communicator.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/nn/sequential.hpp"
#include "ptrain/ops/vector.hpp"
#include "ptrain/optim/optimizer.hpp"
#include "ptrain/parallel/engine.hpp"
#include "ptrain/parallel/expert_parallel.hpp"
#include "ptrain/parallel/model_check.hpp"

namespace ptrain::parallel {

enum class ShardingStrategy { FullShard, ShardGradOp, ShardOptimizer, NoShard, Hybrid };

inline const char* strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FullShard: return "full_shard";
    case ShardingStrategy::ShardGradOp: return "shard_grad_op";
    case ShardingStrategy::ShardOptimizer: return "shard_optimizer";
    case ShardingStrategy::NoShard: return "no_shard";
    case ShardingStrategy::Hybrid: return "hybrid";
  }
  return "?";
}

/// A parameter's part in a rank's local shard: elements [param_offset, param_offset + numel)
/// of parameter `name` (whole shape `shape`), at local_offset in parameters().values().
struct ShardPiece {
  std::string name;
  Shape shape;
  std::int64_t param_offset, local_offset, numel;
  /// A frozen parameter's piece: local_offset indexes FSDP::frozen_values(), not parameters().values().
  bool frozen = false;
};

struct FSDPOptions {
  ShardingStrategy strategy = ShardingStrategy::FullShard;
  /// Hybrid: ranks per shard group (consecutive ranks); must divide the world size.
  int hybrid_shard_size = 0;
  /// Issue the next group's all-gather before the current unit computes.
  bool prefetch = true;
  /// Mixed-precision policy for gradient reduction: F32 (the gradients' own type), or BF16
  /// (float gradients rounded to bf16 on their device: half the bytes on the wire).
  DType reduce_dtype = DType::F32;
  /// Parameter-name prefix of each unit (e.g. GPT::unit_names()), so names match
  /// the unwrapped model's; default the unit's index "<i>", as nn::Sequential (and so
  /// nn::MLP) names its layers.
  std::vector<std::string> unit_names = {};
  /// Where the shards and gathered parameters live; default: the parameters' own device.
  /// A model built on the CPU is moved group by group, each group's copy freed once it
  /// is sharded, so the device never holds the whole model (PyTorch FSDP's device_id).
  std::optional<Device> device = {};
  /// Split the experts of every nn::MoE layer over groups of this many consecutive ranks
  /// (Note [FSDP with expert parallelism]); 1: every rank's shards cover all experts.
  /// FullShard, ShardGradOp and ShardOptimizer (the strategies that shard over the world).
  int expert_parallel = 1;
};

/// One entry of the step timeline (steady-clock seconds), for overlap checks.
struct FSDPEvent {
  std::string what;  ///< "gather", "forward_begin", "forward_end", "backward_begin", "backward_end", "reduce"
  int index;         ///< group for gather/reduce, unit otherwise
  double time;
};

template <class T>
class FSDP : public nn::Module<T>, public Engine<T> {
 public:
  /// Shards the parameters of `units` (run in this order) over `comm`. Every
  /// rank must build the same units; rank 0's initial values are used.
  /// After this, the units' parameters are bound only while gathered.
  FSDP(std::vector<std::shared_ptr<nn::Module<T>>> units, dist::Communicator& comm, FSDPOptions opt = {})
      : units_(std::move(units)), world_(comm), opt_(std::move(opt)) {
    check_options();
    setup_experts();
    setup_communicators();
    if (experts_) {
      std::size_t layers = 0;
      for (auto& u : units_) layers += shard_unit_experts(*u);
      check_moe_found(layers);
    }
    build_groups();
    shard_parameters();
    make_view();
  }

  using UnitFactory = std::function<std::shared_ptr<nn::Module<T>>(std::size_t)>;

  /// Builds unit u with make_unit(u), u = 0 .. num_units - 1, and shards it before
  /// building the next (Note [FSDP units built one at a time]): no rank ever holds the
  /// whole model, only its shards and one unit (nn::gpt_unit is such a factory). Every
  /// rank must build the same units; units may not share parameters.
  FSDP(std::size_t num_units, const UnitFactory& make_unit, dist::Communicator& comm, FSDPOptions opt = {})
      : world_(comm), opt_(std::move(opt)) {
    check_options();
    setup_experts();
    setup_communicators();
    if (reshard_) {
      build_and_shard(num_units, make_unit);
      make_view();
      return;
    }
    // The strategies that keep the full parameters hold the whole model anyway.
    std::size_t layers = 0;
    for (std::size_t u = 0; u < num_units; ++u) {
      units_.push_back(make_unit(u));
      PTRAIN_CHECK(units_.back() != nullptr, Error, "[ptrain.fsdp.factory] the unit factory returned no module for "
                   "unit ", u);
      if (experts_) layers += shard_unit_experts(*units_.back());
    }
    if (experts_) check_moe_found(layers);
    build_groups();
    shard_parameters();
    make_view();
  }

  Mode mode() const override { return Mode::FSDP; }
  /// This rank's shard of every group, one flat buffer (what the optimizer updates);
  /// its entries are pieces of parameters: name, offset in the buffer, [length].
  nn::FlatParameters<T>& parameters() override { return *view_; }
  nn::Module<T>& local_module() override { return *this; }
  dist::Communicator& communicator() override { return world_; }
  void train(bool on = true) override {
    nn::Module<T>::train(on);
    for (auto& u : units_) u->train(on);
  }

  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override { return run_forward(x, cache); }
  /// forward() with int32 token ids for the first unit (bf16 models take ids this way).
  Tensor<T> forward_tokens(const Tensor<std::int32_t>& ids, nn::Cache<T>& cache) override {
    return run_forward(ids, cache);
  }

  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    Tensor<T> d = dy;
    for (std::size_t i = units_.size(); i-- > 0;) {
      for (const int g : groups_of(i))
        if (g >= 0 && groups_[static_cast<std::size_t>(g)].last_unit == static_cast<int>(i)) {
          wait_gathered(g);
          bind_grads(groups_[static_cast<std::size_t>(g)]);
        }
      if (opt_.prefetch) prefetch_after(i, -1);
      record("backward_begin", static_cast<int>(i));
      obs::Span span("fsdp.backward_unit", "fsdp", static_cast<std::int64_t>(i));
      d = units_[i]->backward(d, cache.child(i));
      record("backward_end", static_cast<int>(i));
      for (const int g : groups_of(i))
        if (g >= 0 && groups_[static_cast<std::size_t>(g)].first_unit == static_cast<int>(i)) {
          if (reshard_) release(g);
          reduce_gradients(g);
        }
    }
    cache.clear();
    return d;
  }

  /// Waits for the outstanding gradient reductions; the local shard's gradients are then final.
  void finish_gradient_sync() override {
    while (!pending_.empty()) complete_reduction();
  }

  /// Called by step() after the optimizer updated the shard, and (collectively) after
  /// changing it otherwise, e.g. loading a checkpoint: strategies that keep full
  /// parameters (ZeRO-1/2) gather them again, FullShard drops gathered copies.
  void parameters_changed() override {
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      auto& grp = groups_[g];
      if (reshard_) {
        wait_works(grp);
        if (grp.full.defined()) release(static_cast<int>(g));
      } else if (grp.shard > 0 && local_values_.data() + grp.local_offset != grp.full.data()) {
        // Not under NoShard, whose shard is the full buffer; an expert group whose dp is 1 copies.
        gather(grp, local_values_, grp.local_offset, grp.full, grp.shard);
      }
    }
  }

  /// Zeroes the local gradient shard (and kept full gradients), after the sync that writes them.
  void zero_grad() override {
    finish_gradient_sync();
    local_grads_.zero_();
    if (full_grads_.defined()) full_grads_.zero_();
  }

  /// The pieces of parameters in parameters() with their place in the whole parameters (for
  /// checkpoints), then those of frozen parameters in frozen_values() (ShardPiece::frozen).
  const std::vector<ShardPiece>& shard_pieces() const { return shard_pieces_; }
  /// The local part of the frozen parameters (Note [Frozen parameters under FSDP]): this
  /// rank's shard of them, or all of them where the strategy keeps full parameters.
  Tensor<T>& frozen_values() { return local_frozen_; }
  /// The buffer a piece lies in: parameters().values() or, for a frozen piece, frozen_values().
  Tensor<T> piece_values(const ShardPiece& p) {
    return (p.frozen ? local_frozen_ : local_values_).view(p.local_offset, {p.numel});
  }
  /// Where the strategy keeps full parameters (ShardGradOp, ShardOptimizer, NoShard): every
  /// frozen parameter whole, by name, as views of frozen_values(), which a checkpoint loads
  /// whole; empty under FullShard and Hybrid, whose frozen pieces are loaded instead.
  std::vector<std::pair<std::string, Tensor<T>>> whole_frozen() {
    std::vector<std::pair<std::string, Tensor<T>>> out;
    if (reshard_) return out;
    for (auto& grp : groups_)
      for (auto& e : grp.frozen_entries) out.emplace_back(e.name, grp.full_frozen.view(e.offset, e.shape));
    return out;
  }
  /// Name and shape of every parameter, trainable and frozen, in group order.
  std::vector<std::pair<std::string, Shape>> parameter_shapes() const {
    std::vector<std::pair<std::string, Shape>> out;
    for (const auto& grp : groups_) {
      for (const auto& e : grp.entries) out.emplace_back(e.name, e.shape);
      for (const auto& e : grp.frozen_entries) out.emplace_back(e.name, e.shape);
    }
    return out;
  }
  /// Whether this rank's shard goes into sharded checkpoints: replicas (Hybrid,
  /// NoShard) hold the same shard, so only the first of each replica group writes.
  bool writes_checkpoint() const { return !replicate_comm_ || replicate_comm_->rank() == 0; }

  /// Collective: every parameter, full and unsharded, by name (for export or inspection),
  /// group by group (units that share a parameter form one group).
  std::vector<std::pair<std::string, Tensor<T>>> full_parameters() {
    std::vector<std::pair<std::string, Tensor<T>>> out;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      auto& grp = groups_[g];
      const bool gathered = grp.full.defined() && !grp.gather_work && !grp.frozen_gather_work;
      Tensor<T> full = gathered ? grp.full : Tensor<T>::empty({grp.padded}, local_values_.device());
      Tensor<T> frozen = gathered ? grp.full_frozen : Tensor<T>::empty({grp.frozen_padded}, local_values_.device());
      if (!gathered) {
        gather(grp, local_values_, grp.local_offset, full, grp.shard);
        gather(grp, local_frozen_, grp.frozen_local_offset, frozen, grp.frozen_shard);
      }
      for (auto& e : grp.entries) out.emplace_back(e.name, full.view(e.offset, e.shape).clone());
      for (auto& e : grp.frozen_entries) out.emplace_back(e.name, frozen.view(e.offset, e.shape).clone());
    }
    return out;
  }

  std::string describe() const override {
    return std::string("FSDP(") + strategy_name(opt_.strategy) + ", " + std::to_string(groups_.size()) + " groups" +
           (experts_ ? ", ep " + std::to_string(experts_->ep_size()) : std::string()) + ")";
  }
  /// The expert-parallel groups (FSDPOptions::expert_parallel > 1), or null.
  ExpertMesh* expert_mesh() { return experts_.get(); }
  /// With expert parallelism: the global name of every expert parameter of every MoE layer,
  /// held here or not (what a checkpoint of the whole model holds for its experts).
  std::vector<std::string> expert_names() {
    std::vector<std::string> out;
    if (experts_)
      for (std::size_t u = 0; u < units_.size(); ++u) all_expert_names(*units_[u], unit_prefix(u), out);
    return out;
  }
  std::size_t num_groups() const { return groups_.size(); }
  /// Elements of group g: unpadded, padded, and per shard.
  std::int64_t group_numel(std::size_t g) const { return groups_.at(g).numel; }
  std::int64_t group_padded(std::size_t g) const { return groups_.at(g).padded; }
  /// Frozen elements of group g, padded (Note [Frozen parameters under FSDP]).
  std::int64_t group_frozen_padded(std::size_t g) const { return groups_.at(g).frozen_padded; }
  int shard_size() const { return shard_size_; }
  /// The ranks whose shards together hold the model once (null under NoShard).
  dist::Communicator* shard_group() { return shard_comm_; }
  const std::vector<FSDPEvent>& events() const { return events_; }
  void clear_events() { events_.clear(); }

 private:
  double run(const BatchInput<T>& in, const Targets<T>& targets, double grad_scale,
             bool training) override {
    return this->run_module(*this, in, targets, grad_scale, training);
  }
  // The squared norms of the shards add up over the shard group, whose shards
  // together hold every gradient once; replicas (Hybrid) hold the same shards. With
  // expert parallelism the shard group is the world: its dense shards hold every dense
  // gradient once, and its expert shards every expert once (the ep ranks hold different
  // experts, the dp ranks different shards of them; Note [FSDP with expert parallelism]).
  double sum_over_model(double sq) override {
    if (shard_comm_ && shard_comm_->size() > 1) shard_comm_->all_reduce(&sq, 1, DType::F64, dist::ReduceOp::Sum);
    return sq;
  }
  void make_view() {
    view_ = std::make_unique<nn::FlatParameters<T>>(local_values_, local_grads_, local_entries_);
    view_->set_buffers(unit_buffers());
    for (auto& u : units_) detail::attach_replica_sum(*u, this->data_parallel_group());
  }
  // Every unit's buffers under the units' parameter prefixes; they are not sharded
  // (each rank keeps them whole; SyncBatchNorm keeps them equal on every rank).
  std::vector<nn::NamedBuffer<T>> unit_buffers() {
    std::vector<nn::NamedBuffer<T>> out;
    for (std::size_t u = 0; u < units_.size(); ++u)
      for (auto& b : units_[u]->named_buffers(unit_prefix(u))) out.push_back(b);
    return out;
  }

  template <class X>
  Tensor<T> run_forward(const X& x, nn::Cache<T>& cache) {
    if constexpr (std::is_same_v<X, Tensor<std::int32_t>>) nn::detail::set_batch_ids(cache, x);
    Tensor<T> h;
    for (std::size_t i = 0; i < units_.size(); ++i) {
      for (const int g : groups_of(i))
        if (g >= 0) wait_gathered(g);
      if (opt_.prefetch) prefetch_after(i, +1);
      record("forward_begin", static_cast<int>(i));
      obs::Span span("fsdp.forward_unit", "fsdp", static_cast<std::int64_t>(i));
      if (i > 0) h = units_[i]->forward(h, cache.child(i));
      else if constexpr (std::is_same_v<X, Tensor<std::int32_t>>) h = units_[i]->forward_tokens(x, cache.child(i));
      else h = units_[i]->forward(x, cache.child(i));
      record("forward_end", static_cast<int>(i));
      for (const int g : groups_of(i))
        if (g >= 0 && reshard_ && groups_[static_cast<std::size_t>(g)].last_unit == static_cast<int>(i)) release(g);
    }
    return h;
  }

  struct Group {
    std::vector<nn::Parameter<T>*> params;  // every parameter, trainable and frozen
    std::vector<nn::FlatEntry<T>> entries;  // trainable: offsets inside the group's flat buffer
    std::int64_t numel = 0, padded = 0, shard = 0;
    std::int64_t local_offset = 0;  // of this rank's shard in local_values_
    std::int64_t full_offset = 0;   // of the group in full_values_/full_grads_ (kept buffers)
    // Frozen parameters (Note [Frozen parameters under FSDP]): the same, in their own flat
    // buffer; frozen_local_offset places the shard in local_frozen_ when resharding,
    // frozen_full_offset the whole group in it when the full parameters are kept.
    std::vector<nn::FlatEntry<T>> frozen_entries;
    std::int64_t frozen_numel = 0, frozen_padded = 0, frozen_shard = 0;
    std::int64_t frozen_local_offset = 0, frozen_full_offset = 0;
    int first_unit = 0, last_unit = 0;
    bool expert = false;    // routed experts: sharded over the expert-data group
    Tensor<T> full;         // gathered values (always, when not resharding)
    Tensor<T> full_frozen;  // gathered frozen values
    Tensor<T> full_grad;    // gradients during backward (views of full_grads_ when kept)
    std::shared_ptr<dist::Work> gather_work, frozen_gather_work;
  };
  // A group's gradient reduction in flight: a reduce-scatter over the shard
  // group, then (Hybrid, NoShard) an all-reduce over the replicas. Both stages
  // run asynchronously; the second starts when the first is found complete.
  struct Pending {
    int group;
    Tensor<T> grad;             // full gradient being reduced (kept alive until done)
    Tensor<T> out;              // the shard's reduced gradient [shard]
    // BF16 reduction buffers [padded] and [shard], on the gradient's device. Taken
    // per reduction from the caching allocator, not kept per group as DDP keeps
    // them per bucket: kept, they would hold a bf16 copy of every group's full
    // gradient between steps, which FSDP exists to avoid.
    Tensor<bf16> wire;
    Tensor<bf16> wire_out;
    std::shared_ptr<dist::Work> work;
    bool replicated = false;    // the replica all-reduce was started
    bool expert = false;        // an expert group's: no replicas, scaled by 1 / ep
  };

  void record(const char* what, int index) { events_.push_back({what, index, detail::steady_seconds()}); }

  void check_options() const {
    PTRAIN_CHECK(opt_.reduce_dtype == DType::F32 || opt_.reduce_dtype == DType::BF16, Error,
                 "[ptrain.fsdp.options] reduce_dtype must be F32 or BF16");
  }

  // Note [FSDP with expert parallelism]: agrees on the ep degree first (a rank with another
  // ep would split the world differently and hang), refuses the strategies that do not shard
  // over the world, then splits the world into the dp x ep mesh.
  void setup_experts() {
    const int ep = opt_.expert_parallel;
    if (ep == 1) return;  // a rank with ep = 1 meets this check in check_same_groups()
    check_same_model(world_, {::ptrain::detail::cat("FSDPOptions{.expert_parallel = ", ep, "}")});
    PTRAIN_CHECK(opt_.strategy != ShardingStrategy::NoShard && opt_.strategy != ShardingStrategy::Hybrid, Error,
                 "[ptrain.ep.strategy] FSDPOptions{.expert_parallel = ", ep, "} shards the dense parameters over the "
                 "world and the experts over the dp ranks that hold them; strategy ", strategy_name(opt_.strategy),
                 " is not supported with it: use full_shard, shard_grad_op or shard_optimizer (or DDPOptions{"
                 ".expert_parallel} for replicated parameters)");
    experts_ = std::make_unique<ExpertMesh>(world_, ep);
  }
  // Keeps this rank's experts of unit's MoE layers and records their parameters; the layers sharded.
  std::size_t shard_unit_experts(nn::Module<T>& unit) {
    const std::size_t layers = shard_experts(unit, *experts_);
    for (auto* moe : moe_layers(unit))
      for (auto& p : moe->experts().named_parameters()) expert_params_.insert(p.param);
    return layers;
  }
  void check_moe_found(std::size_t layers) const {
    PTRAIN_CHECK(layers > 0, Error, "[ptrain.ep.model] expert_parallel = ", opt_.expert_parallel,
                 " but the model has no nn::MoE layer; use expert_parallel = 1");
  }
  // Moves the expert parameters out of `owned` and returns them.
  std::vector<nn::NamedParameter<T>> take_experts(std::vector<nn::NamedParameter<T>>& owned) const {
    std::vector<nn::NamedParameter<T>> out;
    std::erase_if(owned, [&](const nn::NamedParameter<T>& p) {
      if (!expert_params_.count(p.param)) return false;
      out.push_back(p);
      return true;
    });
    return out;
  }
  // The communicator a group is sharded over (null under NoShard), its size and this rank's place.
  dist::Communicator* comm_of(const Group& grp) const {
    return grp.expert ? &experts_->expert_data_group() : shard_comm_;
  }
  int size_of(const Group& grp) const { return grp.expert ? experts_->dp_size() : shard_size_; }
  int rank_of(const Group& grp) const { return grp.expert ? experts_->replica() : shard_rank_; }
  // The groups of unit i: its own (or shared) group and its experts' group; -1 where none.
  std::array<int, 2> groups_of(std::size_t i) const { return {unit_group_[i], unit_experts_[i]}; }

  void setup_communicators() {
    const int n = world_.size(), r = world_.rank();
    switch (opt_.strategy) {
      case ShardingStrategy::Hybrid: {
        const int s = opt_.hybrid_shard_size;
        PTRAIN_CHECK(s >= 1 && n % s == 0, Error, "[ptrain.fsdp.hybrid] hybrid_shard_size ", s,
                     " must divide the world size ", n, "; e.g. the number of ranks per node");
        // Both splits are collective on the world, in the same order everywhere.
        owned_shard_ = world_.split(r / s, r);
        owned_replicate_ = world_.split(r % s, r);
        shard_comm_ = owned_shard_.get();
        replicate_comm_ = owned_replicate_.get();
        break;
      }
      case ShardingStrategy::NoShard:
        replicate_comm_ = &world_;
        break;
      default:
        shard_comm_ = &world_;
    }
    shard_size_ = shard_comm_ ? shard_comm_->size() : 1;
    shard_rank_ = shard_comm_ ? shard_comm_->rank() : 0;
    reshard_ = opt_.strategy == ShardingStrategy::FullShard || opt_.strategy == ShardingStrategy::Hybrid;
    keep_full_grads_ = opt_.strategy == ShardingStrategy::ShardOptimizer || opt_.strategy == ShardingStrategy::NoShard;
  }

  // Note [FSDP units and groups]: union-find over units that share parameters.
  void build_groups() {
    const std::size_t n = units_.size();
    std::vector<std::size_t> parent(n);
    std::iota(parent.begin(), parent.end(), 0);
    auto find = [&](std::size_t u) {
      while (parent[u] != u) u = parent[u] = parent[parent[u]];
      return u;
    };
    std::map<nn::Parameter<T>*, std::size_t> owner;
    std::vector<std::vector<nn::NamedParameter<T>>> owned(n);
    check_unit_names(n);
    std::vector<std::vector<nn::NamedParameter<T>>> experts(n);
    for (std::size_t u = 0; u < n; ++u) {
      owned[u] = units_[u]->named_parameters(unit_prefix(u));
      for (auto& p : owned[u]) owner.emplace(p.param, u);
      experts[u] = take_experts(owned[u]);
    }
    for (std::size_t u = 0; u < n; ++u)
      for (auto* p : units_[u]->borrowed_parameters()) {
        auto it = owner.find(p);
        PTRAIN_CHECK(it != owner.end(), Error, "[ptrain.fsdp.borrowed] unit ", u,
                     " uses a parameter that no unit owns; register it in one of the units");
        parent[find(u)] = find(it->second);
      }
    std::map<std::size_t, int> root_group;
    unit_group_.assign(n, -1);
    unit_experts_.assign(n, -1);
    for (std::size_t u = 0; u < n; ++u) {
      if (owned[u].empty() && units_[u]->borrowed_parameters().empty()) continue;
      auto [it, fresh] = root_group.emplace(find(u), static_cast<int>(groups_.size()));
      if (fresh) {
        groups_.emplace_back();
        groups_.back().first_unit = static_cast<int>(u);
      }
      auto& grp = groups_[static_cast<std::size_t>(it->second)];
      grp.last_unit = static_cast<int>(u);
      unit_group_[u] = it->second;
      add_entries(grp, owned[u]);
    }
    // Each unit's experts: a group of their own, after the others (Note [FSDP with expert parallelism]).
    for (std::size_t u = 0; u < n; ++u) {
      if (experts[u].empty()) continue;
      unit_experts_[u] = static_cast<int>(groups_.size());
      groups_.push_back(expert_group(u, experts[u]));
    }
  }
  static Group expert_group(std::size_t u, const std::vector<nn::NamedParameter<T>>& params) {
    Group grp;
    grp.expert = true;
    grp.first_unit = grp.last_unit = static_cast<int>(u);
    add_entries(grp, params);
    return grp;
  }

  static void add_entries(Group& grp, const std::vector<nn::NamedParameter<T>>& owned) {
    for (auto& p : owned) {
      const bool trains = p.param->requires_grad;
      std::int64_t& end = trains ? grp.numel : grp.frozen_numel;
      (trains ? grp.entries : grp.frozen_entries).push_back({p.name, end, p.param->value.shape(), p.param});
      grp.params.push_back(p.param);
      end += p.param->value.numel();
    }
  }

  std::string unit_prefix(std::size_t u) const {
    return (opt_.unit_names.empty() ? std::to_string(u) : opt_.unit_names[u]) + ".";
  }
  void check_unit_names(std::size_t n) const {
    PTRAIN_CHECK(opt_.unit_names.empty() || opt_.unit_names.size() == n, Error, "[ptrain.fsdp.names] ",
                 opt_.unit_names.size(), " unit names for ", n, " units");
  }

  // Where the shards live: FSDPOptions::device, else the first parameter's device;
  // the communicator must move that memory.
  Device shard_device(const Group& first) const {
    const Device dev = opt_.device ? *opt_.device : first.params.front()->value.device();
    world_.check_serves(dev, dev.is_cpu() && !opt_.device
                                 ? "FSDP (FSDPOptions::device = cuda:N places a CPU-built model's shards on that GPU)"
                                 : "FSDP");
    return dev;
  }

  // Pads and places grp right after the groups in groups_: padded size, shard, offsets.
  void layout(Group& grp) const {
    const std::int64_t n = size_of(grp);
    grp.padded = (grp.numel + n - 1) / n * n;
    grp.shard = grp.padded / n;
    grp.local_offset = local_total();
    grp.full_offset = full_total();
    grp.frozen_padded = (grp.frozen_numel + n - 1) / n * n;
    grp.frozen_shard = grp.frozen_padded / n;
    grp.frozen_local_offset = frozen_local_total();
    grp.frozen_full_offset = frozen_full_total();
  }
  // Elements of the groups in groups_: the local buffers' and the full buffers' sizes.
  std::int64_t local_total() const { return groups_.empty() ? 0 : groups_.back().local_offset + groups_.back().shard; }
  std::int64_t full_total() const { return groups_.empty() ? 0 : groups_.back().full_offset + groups_.back().padded; }
  std::int64_t frozen_local_total() const {
    return groups_.empty() ? 0 : groups_.back().frozen_local_offset + groups_.back().frozen_shard;
  }
  std::int64_t frozen_full_total() const {
    return groups_.empty() ? 0 : groups_.back().frozen_full_offset + groups_.back().frozen_padded;
  }

  // Collective: checks that every rank has the same entries in `groups`; with expert
  // parallelism the dense ones over the world, the experts over the expert-data group.
  void check_same_groups(const std::vector<Group>& groups) {
    std::vector<std::string> desc, experts;
    if (experts_) desc.push_back(::ptrain::detail::cat("FSDPOptions{.expert_parallel = ", opt_.expert_parallel, "}"));
    for (auto& grp : groups) {
      auto& d = grp.expert ? experts : desc;
      for (auto& e : grp.entries) d.push_back(e.name + " " + e.shape.str() + " " + dtype_name(dtype_of<T>()));
      for (auto& e : grp.frozen_entries)
        d.push_back(e.name + " " + e.shape.str() + " " + dtype_name(dtype_of<T>()) + " frozen");
    }
    if (experts_) desc.push_back(::ptrain::detail::cat(experts.size(), " expert tensors"));
    check_same_model(world_, desc);
    if (experts_) check_same_model(experts_->expert_data_group(), experts);
  }

  // Broadcasts rank 0's values of grp through `full` ([padded], on the shard device) and
  // `frozen` ([frozen_padded]) and returns this rank's shards of them (views). The units'
  // gradients are released, their values too when resharding (else bound to full and
  // frozen, which the group keeps), and the shards' pieces of parameters are recorded.
  std::pair<Tensor<T>, Tensor<T>> scatter_group(Group& grp, Tensor<T> full, Tensor<T> frozen) {
    for (auto& e : grp.entries) full.view(e.offset, e.shape).copy_(e.param->value);
    for (auto& e : grp.frozen_entries) frozen.view(e.offset, e.shape).copy_(e.param->value);
    // Rank 0's values; experts from rank 0 of the ranks that hold them.
    dist::Communicator& from = grp.expert ? experts_->expert_data_group() : world_;
    if (grp.padded > 0 && from.size() > 1) from.broadcast(full, 0);
    if (grp.frozen_padded > 0 && from.size() > 1) from.broadcast(frozen, 0);
    for (auto* p : grp.params) p->grad = Tensor<T>();
    if (reshard_) {
      for (auto* p : grp.params) p->value = Tensor<T>();
    } else {
      grp.full = full;
      grp.full_frozen = frozen;
      bind_values(grp);
    }
    // Local pieces of parameters: the overlap of each entry with this rank's range.
    const std::int64_t lo = static_cast<std::int64_t>(rank_of(grp)) * grp.shard, hi = lo + grp.shard;
    for (auto& e : grp.entries) {
      const std::int64_t b = std::max(lo, e.offset), en = std::min(hi, e.offset + e.numel());
      if (b >= en) continue;
      local_entries_.push_back({e.name, grp.local_offset + (b - lo), Shape{en - b}, nullptr});
      shard_pieces_.push_back({e.name, e.shape, b - e.offset, grp.local_offset + (b - lo), en - b});
    }
    // Frozen pieces index frozen_values(): the shard, or the whole frozen buffer when kept.
    const std::int64_t flo = static_cast<std::int64_t>(rank_of(grp)) * grp.frozen_shard,
                       fhi = flo + grp.frozen_shard;
    const std::int64_t base = reshard_ ? grp.frozen_local_offset - flo : grp.frozen_full_offset;
    for (auto& e : grp.frozen_entries) {
      const std::int64_t b = std::max(flo, e.offset), en = std::min(fhi, e.offset + e.numel());
      if (b >= en) continue;
      frozen_pieces_.push_back({e.name, e.shape, b - e.offset, base + b, en - b, true});
    }
    return {full.view(lo, {grp.shard}), frozen.view(flo, {grp.frozen_shard})};
  }

  // Copies rank 0's values into every rank's shard (on the shard device) and releases
  // the units' tensors group by group.
  void shard_parameters() {
    const Device dev = groups_.empty() ? opt_.device.value_or(Device::cpu()) : shard_device(groups_.front());
    check_same_groups(groups_);
    auto built = std::move(groups_);
    groups_.clear();
    for (auto& grp : built) {
      layout(grp);
      groups_.push_back(std::move(grp));
    }
    if (!reshard_) full_values_ = Tensor<T>::zeros({full_total()}, dev);
    if (keep_full_grads_) full_grads_ = Tensor<T>::zeros({full_total()}, dev);
    if (shard_size_ == 1 && !reshard_) {
      // NoShard: the local shard is the whole model; no second copy.
      local_values_ = full_values_;
      local_grads_ = keep_full_grads_ ? full_grads_ : Tensor<T>::zeros({local_total()}, dev);
    } else {
      local_values_ = Tensor<T>::zeros({local_total()}, dev);
      local_grads_ = Tensor<T>::zeros({local_total()}, dev);
    }
    // Note [Frozen parameters under FSDP]: a frozen shard, or the whole frozen buffer when kept.
    local_frozen_ = Tensor<T>::zeros({reshard_ ? frozen_local_total() : frozen_full_total()}, dev);
    for (auto& grp : groups_) {
      auto full = reshard_ ? Tensor<T>::zeros({grp.padded}, dev) : full_values_.view(grp.full_offset, {grp.padded});
      auto frozen = reshard_ ? Tensor<T>::zeros({grp.frozen_padded}, dev)
                             : local_frozen_.view(grp.frozen_full_offset, {grp.frozen_padded});
      auto [shard, frozen_shard] = scatter_group(grp, full, frozen);
      local_values_.view(grp.local_offset, {grp.shard}).copy_(shard);  // in place under NoShard
      if (reshard_) local_frozen_.view(grp.frozen_local_offset, {grp.frozen_shard}).copy_(frozen_shard);
    }
    collect_pieces();
  }
  // Frozen pieces after the trainable ones (ShardPiece::frozen).
  void collect_pieces() {
    shard_pieces_.insert(shard_pieces_.end(), frozen_pieces_.begin(), frozen_pieces_.end());
    frozen_pieces_.clear();
  }

  // Note [FSDP units built one at a time]: builds, shards and releases unit after
  // unit; the shards wait in `shards` until their total size is known.
  void build_and_shard(std::size_t num_units, const UnitFactory& make_unit) {
    check_unit_names(num_units);
    std::optional<Device> dev;
    std::vector<Tensor<T>> shards, frozen_shards;
    std::size_t layers = 0;
    for (std::size_t u = 0; u < num_units; ++u) {
      auto unit = make_unit(u);
      PTRAIN_CHECK(unit != nullptr, Error, "[ptrain.fsdp.factory] the unit factory returned no module for "
                   "unit ", u);
      PTRAIN_CHECK(unit->borrowed_parameters().empty(), Error, "[ptrain.fsdp.borrowed] unit ", u,
                   " uses a parameter of another unit; units built one at a time cannot share one (build the "
                   "model with tie_weights = false, or pass the built units)");
      if (experts_) layers += shard_unit_experts(*unit);
      units_.push_back(unit);
      auto owned = unit->named_parameters(unit_prefix(u));
      const auto experts = take_experts(owned);
      std::vector<Group> added;
      if (!owned.empty()) {
        added.emplace_back();
        added.back().first_unit = added.back().last_unit = static_cast<int>(u);
        add_entries(added.back(), owned);
      }
      if (!experts.empty()) added.push_back(expert_group(u, experts));
      check_same_groups(added);  // every rank, every unit: the same collectives
      unit_group_.push_back(-1);
      unit_experts_.push_back(-1);
      for (auto& a : added) {
        if (!dev) dev = shard_device(a);
        (a.expert ? unit_experts_ : unit_group_).back() = static_cast<int>(groups_.size());
        layout(a);
        groups_.push_back(std::move(a));
        auto& grp = groups_.back();
        auto [shard, frozen_shard] =
            scatter_group(grp, Tensor<T>::zeros({grp.padded}, *dev), Tensor<T>::zeros({grp.frozen_padded}, *dev));
        shards.push_back(shard.clone());
        frozen_shards.push_back(frozen_shard.clone());
      }
    }
    if (experts_) check_moe_found(layers);
    const Device d = dev.value_or(opt_.device.value_or(Device::cpu()));
    local_values_ = Tensor<T>::zeros({local_total()}, d);
    local_frozen_ = Tensor<T>::zeros({frozen_local_total()}, d);
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      local_values_.view(groups_[g].local_offset, {groups_[g].shard}).copy_(shards[g]);
      local_frozen_.view(groups_[g].frozen_local_offset, {groups_[g].frozen_shard}).copy_(frozen_shards[g]);
    }
    shards.clear();  // before the gradients' buffer: at most two shard-sized buffers at once
    frozen_shards.clear();
    local_grads_ = Tensor<T>::zeros({local_total()}, d);
    collect_pieces();
  }

  void bind_values(Group& grp) {
    for (auto& e : grp.entries) e.param->value = grp.full.view(e.offset, e.shape);
    for (auto& e : grp.frozen_entries) e.param->value = grp.full_frozen.view(e.offset, e.shape);
  }

  // Gradients of the trainable parameters only (Note [Frozen parameters under FSDP]).
  void bind_grads(Group& grp) {
    if (grp.numel == 0) return;
    grp.full_grad = keep_full_grads_ ? full_grads_.view(grp.full_offset, {grp.padded})
                                     : Tensor<T>::zeros({grp.padded}, local_values_.device());
    for (auto& e : grp.entries) e.param->grad = grp.full_grad.view(e.offset, e.shape);
  }

  // Synchronous all-gather over grp's shard group of `shard` elements at src[offset] into
  // full (nothing when empty).
  void gather(const Group& grp, Tensor<T>& src, std::int64_t offset, Tensor<T>& full, std::int64_t shard) {
    if (shard > 0)
      comm_of(grp)->all_gather(src.data() + offset, full.data(), static_cast<std::size_t>(shard), dtype_of<T>());
  }
  std::shared_ptr<dist::Work> gather_async(const Group& grp, Tensor<T>& src, std::int64_t offset, Tensor<T>& full,
                                           std::int64_t shard) {
    if (shard == 0) return nullptr;
    return comm_of(grp)->all_gather_async(src.data() + offset, full.data(), static_cast<std::size_t>(shard),
                                          dtype_of<T>());
  }

  void issue_gather(int g) {
    auto& grp = groups_[static_cast<std::size_t>(g)];
    if (grp.full.defined()) return;  // gathered or in flight
    grp.full = Tensor<T>::empty({grp.padded}, local_values_.device());
    grp.full_frozen = Tensor<T>::empty({grp.frozen_padded}, local_values_.device());
    record("gather", g);
    dist::CollectiveLabel label("fsdp.gather");
    grp.gather_work = gather_async(grp, local_values_, grp.local_offset, grp.full, grp.shard);
    grp.frozen_gather_work =
        gather_async(grp, local_frozen_, grp.frozen_local_offset, grp.full_frozen, grp.frozen_shard);
  }

  // Waits for group's gathers in flight; whether there were any.
  bool wait_works(Group& grp) {
    bool any = false;
    for (auto* w : {&grp.gather_work, &grp.frozen_gather_work})
      if (*w) {
        (*w)->wait(comm_of(grp)->timeout());
        w->reset();
        any = true;
      }
    return any;
  }

  void wait_gathered(int g) {
    auto& grp = groups_[static_cast<std::size_t>(g)];
    if (!reshard_) return;
    issue_gather(g);
    if (wait_works(grp)) bind_values(grp);
  }

  // Issues the gather of the next group (in direction dir) that is not gathered yet.
  void prefetch_after(std::size_t unit, int dir) {
    if (!reshard_) return;
    const int current = unit_group_[unit];
    for (auto u = static_cast<std::ptrdiff_t>(unit) + dir; u >= 0 && u < static_cast<std::ptrdiff_t>(units_.size());
         u += dir) {
      const auto [g, experts] = groups_of(static_cast<std::size_t>(u));
      if ((g < 0 || g == current) && experts < 0) continue;
      if (g >= 0 && g != current) issue_gather(g);
      if (experts >= 0) issue_gather(experts);
      return;
    }
  }

  void release(int g) {
    auto& grp = groups_[static_cast<std::size_t>(g)];
    for (auto* p : grp.params) p->value = Tensor<T>();
    grp.full = Tensor<T>();
    grp.full_frozen = Tensor<T>();
  }

  // Starts group g's reduction (Note [Prefetch and overlap]); completes the previous one first.
  void reduce_gradients(int g) {
    auto& grp = groups_[static_cast<std::size_t>(g)];
    if (grp.numel == 0) return;  // every parameter frozen: nothing to reduce
    for (auto* p : grp.params) p->grad = Tensor<T>();
    Tensor<T> grad = grp.full_grad;
    grp.full_grad = Tensor<T>();
    if (!this->syncing() && keep_full_grads_) return;  // accumulate locally (no_sync)
    while (!pending_.empty()) complete_reduction();
    record("reduce", g);
    dist::CollectiveLabel label("fsdp.reduce_scatter");
    Pending p{g, grad, {}, {}, {}, {}};
    p.expert = grp.expert;
    const auto shard = static_cast<std::size_t>(grp.shard);
    dist::Communicator* shard_comm = comm_of(grp);
    if (size_of(grp) > 1) {
      p.out = Tensor<T>::empty({grp.shard}, grad.device());
      if (opt_.reduce_dtype == DType::BF16 && !std::is_same_v<T, bf16>) {
        p.wire = Tensor<bf16>::empty(Shape{grp.padded}, grad.device());
        p.wire_out = Tensor<bf16>::empty(Shape{grp.shard}, grad.device());
        ops::cast_into(grad, p.wire);
        p.work = shard_comm->reduce_scatter_async(p.wire.data(), p.wire_out.data(), shard, DType::BF16,
                                                   dist::ReduceOp::Avg);
      } else {
        p.work = shard_comm->reduce_scatter_async(grad.data(), p.out.data(), shard, dtype_of<T>(),
                                                   dist::ReduceOp::Avg);
      }
    } else {
      p.out = grad;  // NoShard: the "shard" is the whole group, reduced across replicas
      start_replication(p);
    }
    pending_.push_back(std::move(p));
  }

  void start_replication(Pending& p) {
    p.replicated = true;
    if (!p.expert && replicate_comm_ && replicate_comm_->size() > 1)
      p.work = replicate_comm_->all_reduce_async(p.out.data(), p.out.data(), static_cast<std::size_t>(p.out.numel()),
                                                 dtype_of<T>(), dist::ReduceOp::Avg);
    else
      p.work.reset();
  }

  void complete_reduction() {
    Pending p = std::move(pending_.front());
    pending_.erase(pending_.begin());
    auto& grp = groups_[static_cast<std::size_t>(p.group)];
    try {
      if (p.work) p.work->wait(!p.replicated ? comm_of(grp)->timeout() : replicate_comm_->timeout());
      if (!p.replicated) {
        if (p.wire_out.defined()) ops::cast_into(p.wire_out, p.out);
        start_replication(p);
        if (p.work) p.work->wait(replicate_comm_->timeout());
      }
    } catch (const CommError& e) {
      PTRAIN_THROW(CommError, "[ptrain.fsdp.reduce] gradient reduction of FSDP group ", p.group, " failed: ",
                   e.what());
    }
    if (grp.expert && experts_->ep_size() > 1) {
      // Note [FSDP with expert parallelism]: the average over the expert-data group, divided by ep
      // (on a copy where the "shard" is the kept full gradient itself).
      if (p.out.data() == p.grad.data()) p.out = p.out.clone();
      ops::scale_(p.out, static_cast<acc_t<T>>(1.0 / experts_->ep_size()));
    }
    auto local = local_grads_.view(grp.local_offset, {grp.shard});
    if (keep_full_grads_) {
      // The full gradients hold the accumulation; the shard takes this step's reduced value.
      if (local.data() != p.out.data()) local.copy_(p.out);
    } else {
      ops::axpy_(1, p.out, local);
    }
  }

  std::vector<std::shared_ptr<nn::Module<T>>> units_;
  dist::Communicator& world_;
  FSDPOptions opt_;
  std::unique_ptr<dist::Communicator> owned_shard_, owned_replicate_;
  dist::Communicator* shard_comm_ = nullptr;
  dist::Communicator* replicate_comm_ = nullptr;
  int shard_size_ = 1, shard_rank_ = 0;
  bool reshard_ = true, keep_full_grads_ = false;
  std::vector<Group> groups_;
  std::vector<int> unit_group_;
  std::vector<int> unit_experts_;  // each unit's expert group, or -1
  std::unique_ptr<ExpertMesh> experts_;  // FSDPOptions::expert_parallel > 1
  std::set<nn::Parameter<T>*> expert_params_;  // this rank's experts' parameters
  Tensor<T> local_values_, local_grads_, full_values_, full_grads_;
  Tensor<T> local_frozen_;  // Note [Frozen parameters under FSDP]
  std::vector<ShardPiece> frozen_pieces_;  // while sharding; then appended to shard_pieces_
  std::vector<nn::FlatEntry<T>> local_entries_;
  std::unique_ptr<nn::FlatParameters<T>> view_;  // the local buffers as the optimizer's parameters
  std::vector<ShardPiece> shard_pieces_;
  std::vector<Pending> pending_;
  std::vector<FSDPEvent> events_;
};

}  // namespace ptrain::parallel
