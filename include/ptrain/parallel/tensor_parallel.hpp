#pragma once
// Tensor parallelism (Megatron-LM) as an Engine: every layer of a GPT or a Llama
// is split over tp ranks (parallel/tp_gpt.hpp, parallel/tp_llama.hpp), optionally
// cut into pp pipeline stages, and world / (tp * pp) replicas of that model train
// on their own part of the global batch.
//
//   auto world = dist::init_process_group();
//   auto engine = parallel::make_engine<float>(gpt, *world, parallel::TensorParallelPlan{.tp = 2});
//   optim::AdamW<float> opt(engine->parameters(), {.lr = 1e-3});
//   engine->zero_grad();
//   engine->forward_backward(my_ids, my_targets);   // this replica's batch; the tp ranks of a replica get the same one
//   engine->clip_grad_norm_(1.0);
//   engine->step(opt);
//
// Note [Tensor-parallel engine]
// - Mesh: dp x tp x pp (parallel/mesh.hpp), tp innermost, so the tp ranks of a
//   stage are consecutive world ranks (one node first), then the stages of a
//   replica, then the replicas.
// - Every tp rank of a replica runs forward_backward on the same batch; the
//   data-parallel rank (data_parallel_group()) says which slice of the global batch.
// - pp > 1: a Pipeline (parallel/pipeline.hpp) over the mesh whose units are the
//   tensor-parallel units of this rank's stage (detail::tensor_parallel_gpt_unit),
//   with the vocabulary-parallel loss on the last stage; every rank of a stage
//   receives the same activations from its own tp index of the previous stage.
//   A tied GPT cannot be cut (its embedding and head share a weight).
// - Gradients: sharded and replicated parameters alike are averaged over the
//   data_group() (the replicas holding the same shard): in one all-reduce of the
//   flat gradient buffer after backward, or, with pp > 1, by the pipeline after
//   each stage's last backward. Replicated parameters (LayerNorms, wpe,
//   row-parallel biases) need no tp communication: their gradients are equal on
//   every tp rank by construction (Note [Tensor parallel f and g] in tp_group.hpp).
// - Sequence parallelism (TensorParallelPlan::sequence_parallel, Note [Sequence
//   parallelism] in tp_group.hpp): the norms' partial gradients are summed over
//   the tp group in one all-reduce when the gradients are synced (a sum, so
//   before or after the dp average alike); a batch's sequence length must then
//   be a multiple of tp.
// - clip_grad_norm_: the squares of sharded gradients are summed over the tp
//   group, those of replicated ones are counted once, and the stages' sums added.
// - The loss is VocabParallelCrossEntropy (with pp = 1, set_loss() replaces it
//   with a loss that must itself take vocabulary-parallel logits).
// - Checkpoints (ckpt/tp_checkpoint.hpp) hold full tensors under the full model's names.
// - Frozen parameters (Parameter::requires_grad false in the full model, set before
//   the engine is built) stay frozen in their shards: no gradient, no all-reduce, no
//   optimizer state; checkpoints hold them like the others (docs/finetuning.md).
// - Context parallelism (TensorParallelPlan::cp, pp = 1): the mesh is dp x cp x tp and
//   every sequence is split over the cp ranks with the same t (Note [Context-parallel
//   engine] in parallel/cp_engine.hpp, "With tensor parallelism"); the replicas of a
//   shard, for the gradients, FSDP and the initial broadcast, are then the dp x cp ranks.
// - Device: each unit is built on the device of the full model's unit, or moved to
//   TensorParallelPlan::device; the vocabulary-parallel pieces and the collectives
//   run there (docs/tensor_parallel.md, "On the GPU").
//
// Note [FSDP x TP]
// TensorParallelPlan::fsdp (pp = 1) replaces the replicas' all-reduce by PyTorch's
// 2-D layout: the tensor-parallel units (one per unit of the full model, named as
// its units) are handed to an FSDP engine (parallel/fsdp.hpp) over data_group(),
// so each tp shard is sharded again over the dp ranks that hold it; parameters()
// is then FSDP's local shard (pieces named by the full parameter names) and
// parameters + gradients + optimizer state shrink by dp under FullShard. Forward
// gathers a unit's tp shard over dp, the unit runs its tp collectives, backward
// reduce-scatters its gradients over dp: dp and tp communicate in different groups,
// so they nest. Every FSDP strategy works, since each only sees the dp group.
// - clip_grad_norm_: each rank's pieces are summed per kind (tp-sharded,
//   replicated) over FSDP's shard group first, whose pieces hold every gradient of
//   a tp rank once; then as above (replicated pieces are equal on every tp rank).
// - Sequence parallelism: the norms' partial gradients are summed over tp after
//   FSDP's reduction (a sum, so after the dp average alike), piece by piece: every
//   tp rank's shards have the same shapes (vocabulary padding included), so FSDP
//   lays out and cuts the groups alike on the tp ranks of one dp rank, and their
//   pieces of a norm cover the same elements.
// - Not offered: pp > 1 ([ptrain.tp.fsdp_pipeline]; the pipeline averages each
//   stage's replicas itself).
// - Checkpoints (ckpt/tp_checkpoint.hpp) gather the pieces over FSDP's shard group,
//   then over tp: the same full tensors under the same names as without FSDP, so
//   they load into one process, into TP alone and back.
// - The units are built whole (every tp shard of the model at once) before FSDP
//   shards them, as FSDP(units, comm) does; a tied head shares its group with the
//   embedding (Note [FSDP units and groups]).
//
// A Llama with mixture-of-experts blocks runs each MoE layer on 1/tp of the tokens per
// tp rank, its experts split over TensorParallelPlan::expert_parallel ranks (Note
// [Expert parallelism x TP] in tp_moe.hpp: layout, gradients, clipping, checkpoints).

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ptrain/parallel/cp_engine.hpp"
#include "ptrain/parallel/engine.hpp"
#include "ptrain/parallel/fsdp.hpp"
#include "ptrain/parallel/mesh.hpp"
#include "ptrain/parallel/model_check.hpp"
#include "ptrain/parallel/pipeline.hpp"
#include "ptrain/parallel/tp_gpt.hpp"
#include "ptrain/parallel/tp_llama.hpp"

namespace ptrain::parallel {

/// Tensor parallelism over tp consecutive ranks, optionally pipelined over pp
/// stages; data parallelism over world / (tp * pp) replicas.
struct TensorParallelPlan {
  int tp = 1;
  /// Cut the residual stream along the sequence between the tensor-parallel regions
  /// (Note [Sequence parallelism] in tp_group.hpp): activations outside them shrink by tp.
  bool sequence_parallel = false;
  /// Pipeline stages per replica (Note [Tensor-parallel engine]); 1: no pipeline.
  int pp = 1;
  /// With pp > 1: micro-batches per batch and their schedule (parallel/pipeline.hpp);
  /// virtual_stages > 1 runs the interleaved schedule over that many chunks per stage.
  int micro_batches = 1;
  Schedule schedule = Schedule::OneFOneB;
  int virtual_stages = 1;
  /// With pp > 1: relative cost of each unit for balancing the stages; empty: equal.
  std::vector<double> unit_costs = {};
  /// The device of this rank's shards (the world's communicator must serve it: NCCL
  /// for cuda:N); unset: the device of the model's parameters (the CPU for a model
  /// built from its config). With a device, the full model may stay on the host.
  std::optional<Device> device = std::nullopt;
  /// Data parallelism over the replicas (Note [FSDP x TP]): unset, each replica holds the
  /// whole tensor-parallel shard and the gradients are all-reduced (DDP); set, each
  /// tensor-parallel unit is sharded again over data_parallel_group() by an FSDP engine
  /// with these options (pp = 1; unit_names and device are the engine's).
  std::optional<FSDPOptions> fsdp = std::nullopt;
  /// Context parallelism inside each tp rank (pp = 1; Note [Context-parallel engine], "With
  /// tensor parallelism"): every sequence split over cp ranks that hold the same heads, whose
  /// attention runs the ring over the mesh's context_group(); the replicas are world / (tp * cp).
  int cp = 1;
  /// With cp > 1: how attention reaches the other cp ranks' keys and values.
  KVExchange kv_exchange = KVExchange::Ring;
  /// For a model with nn::MoE layers: split their experts over groups of this many
  /// consecutive ranks (Note [Expert parallelism x TP] in tp_moe.hpp); 1: every rank
  /// holds every expert. ep must divide the world and the experts.
  int expert_parallel = 1;
};

template <class T>
class TensorParallel : public Engine<T> {
 public:
  /// The shards of nn::GPT<T>(cfg, gen), built unit by unit (nn::gpt_unit); collective
  /// over `world` (which must outlive the engine), every rank with the same plan and config.
  TensorParallel(const nn::GPTConfig& cfg, dist::Communicator& world, TensorParallelPlan plan,
                 const Generator& gen = default_generator())
      : world_(world) {
    init(gpt_model(cfg, [cfg, gen](std::size_t u) -> std::shared_ptr<nn::Module<T>> {
           // The head of a tied model has no weight of its own; its ln_f starts at 1 and 0 as built.
           if (cfg.tie_weights && u == static_cast<std::size_t>(cfg.n_layer) + 1) return nullptr;
           return nn::gpt_unit<T>(cfg, u, gen);
         }),
         plan);
  }
  /// The shards of an nn::GPT that every rank built alike (same config and values).
  TensorParallel(nn::GPT<T>& full, dist::Communicator& world, TensorParallelPlan plan) : world_(world) {
    init(gpt_model(full.config(), [&full](std::size_t u) { return full.units()[u]; }), plan);
  }
  /// The shards of an nn::Llama that every rank built alike (parallel/tp_llama.hpp).
  TensorParallel(nn::Llama<T>& full, dist::Communicator& world, TensorParallelPlan plan) : world_(world) {
    const nn::LlamaConfig cfg = full.config();
    init({.describe = full.describe(), .names = full.unit_names(), .heads = cfg.n_kv_head, .vocab = cfg.vocab_size,
          .tied = cfg.tie_weights, .document_token = cfg.document_token, .moe = cfg.num_experts > 0,
          .unit = [this, cfg, &full](std::size_t u, TensorParallelGroup& g, nn::Parameter<T>* tied) {
            return detail::tensor_parallel_llama_unit<T>(cfg, u, g, full.units()[u], tied, experts_.get());
          }},
         plan);
  }

  Mode mode() const override { return Mode::TensorParallel; }
  nn::FlatParameters<T>& parameters() override { return *params_; }
  nn::Module<T>& local_module() override {
    if (fsdp_) return *fsdp_;
    return pipe_ ? pipe_->module() : *model_;
  }
  dist::Communicator& communicator() override { return world_; }
  dist::Communicator* data_parallel_group() override { return &mesh_->data_group(); }
  void zero_grad() override {
    finish_gradient_sync();
    if (fsdp_) fsdp_->zero_grad();
    else parameters().zero_grad();
  }
  void finish_gradient_sync() override {
    if (fsdp_) fsdp_->finish_gradient_sync();  // the dp reduce-scatters, before the tp sum of partial pieces
    if (!pending_) return;
    pending_ = false;
    sum_partial_gradients();
    if (experts_) {  // Note [Expert parallelism x TP]: dense runs over the replicas, expert runs over the expert replicas
      dist::CollectiveLabel label("tp.dp_gradients");
      const double scale = double(mesh_->tp_size()) / experts_->ep_size();
      for_runs(params_->entries(), expert_, params_->grads(), [&](Tensor<T> g, bool expert) {
        dist::Communicator& c = expert ? experts_->expert_data_group() : replicas();
        if (c.size() > 1) c.all_reduce(g, dist::ReduceOp::Avg);
        if (expert && scale != 1) ops::scale_(g, static_cast<acc_t<T>>(scale));
      });
    } else if (!pipe_ && !fsdp_ && replicas().size() > 1 && params_->numel() > 0) {
      // A pipeline averages each stage itself; with cp the cp ranks are replicas for the weights.
      dist::CollectiveLabel label("tp.dp_gradients");
      replicas().all_reduce(params_->grads(), dist::ReduceOp::Avg);
    }
  }

  void parameters_changed() override {
    if (fsdp_) fsdp_->parameters_changed();
  }

  /// The whole tensor-parallel model, its units named as the full model's (pp = 1);
  /// under FSDP its parameters are bound only while gathered.
  nn::UnitChain<T>& model() {
    PTRAIN_CHECK(model_ != nullptr, Error, "[ptrain.tp.model] with pp = ", mesh_->pp_size(), " each rank holds one "
                 "stage's units: use local_module() or pipeline()");
    return *model_;
  }
  /// This rank's pipeline stage (pp > 1), or null.
  Pipeline<T>* pipeline() { return pipe_.get(); }
  Mesh& mesh() { return *mesh_; }
  /// The FSDP engine over the data-parallel group (TensorParallelPlan::fsdp), or null.
  FSDP<T>* fsdp() { return fsdp_.get(); }
  /// The expert-parallel groups of a model with MoE layers, or null.
  ExpertMesh* expert_mesh() { return experts_.get(); }
  /// Whether entry i of parameters() (frozen entry i) is an expert's.
  bool is_expert(std::size_t i) const { return !expert_.empty() && expert_.at(i); }
  bool is_frozen_expert(std::size_t i) const { return !frozen_expert_.empty() && frozen_expert_.at(i); }
  /// How the parameter of that full name is cut over tp (any parameter, trainable or frozen).
  ShardSpec spec_of(const std::string& name) const {
    auto it = std::find_if(all_specs_.begin(), all_specs_.end(), [&](const auto& s) { return s.first == name; });
    return it == all_specs_.end() ? ShardSpec{} : it->second;
  }
  TensorParallelGroup& group() { return *group_; }
  /// How entry i of parameters() is cut (Note [Tensor parallel shards]) and its full shape;
  /// under FSDP x TP, whose entries are pieces of parameters, use spec_of(name) instead.
  const ShardSpec& spec(std::size_t i) const { return specs_.at(i); }
  Shape full_shape(std::size_t i) const { return detail::full_shape(params_->entries().at(i).shape, specs_.at(i)); }
  /// The same for frozen entry i (parameters().frozen_entries()).
  const ShardSpec& frozen_spec(std::size_t i) const { return frozen_specs_.at(i); }
  Shape frozen_full_shape(std::size_t i) const {
    return detail::full_shape(params_->frozen_entries().at(i).shape, frozen_specs_.at(i));
  }

 private:
  // What the engine needs of the model it splits.
  struct Model {
    std::string describe;                // the model for the plan check
    std::vector<std::string> names;      // its units
    std::int64_t heads, vocab;           // heads that tp must divide (key/value heads for Llama)
    bool tied;                           // the head uses the embedding's weight
    std::int32_t document_token = -1;    // the token that starts a packed document (Llama), or -1
    double dropout = 0;                  // GPT's
    bool moe = false;                    // has nn::MoE layers (Note [Expert parallelism x TP])
    /// Unit u in tensor-parallel form with this rank's shards (tied: the embedding's weight shard).
    std::function<std::shared_ptr<nn::Module<T>>(std::size_t u, TensorParallelGroup&, nn::Parameter<T>* tied)> unit;
  };
  static Model gpt_model(const nn::GPTConfig& cfg, std::function<std::shared_ptr<nn::Module<T>>(std::size_t)> full) {
    return {.describe = ::ptrain::detail::cat("GPT(vocab ", cfg.vocab_size, ", block ", cfg.block_size, ", layers ",
                                              cfg.n_layer, ", heads ", cfg.n_head, ", embd ", cfg.n_embd,
                                              cfg.tie_weights ? ", tied)" : ")"),
            .names = nn::gpt_unit_names(cfg), .heads = cfg.n_head, .vocab = cfg.vocab_size, .tied = cfg.tie_weights,
            .dropout = cfg.dropout,
            .unit = [cfg, full](std::size_t u, TensorParallelGroup& g, nn::Parameter<T>* tied) {
              return detail::tensor_parallel_gpt_unit<T>(cfg, u, g, full(u), tied);
            }};
  }

  void init(const Model& m, const TensorParallelPlan& plan) {
    check_plan(m, plan);
    mesh_ = std::make_unique<Mesh>(world_, MeshShape{.dp = world_.size() / (plan.tp * plan.cp * plan.pp),
                                                     .tp = plan.tp, .pp = plan.pp, .cp = plan.cp});
    group_ = std::make_unique<TensorParallelGroup>(mesh_->tensor_group(), plan.sequence_parallel);
    vocab_ = m.vocab;
    document_token_ = m.document_token;
    if (plan.cp > 1) batch_ = std::make_shared<ContextParallelBatch>(mesh_->context_group(), plan.kv_exchange);
    if (m.moe) experts_ = std::make_unique<ExpertMesh>(world_, plan.expert_parallel);
    const std::int64_t vocab = m.vocab;
    TensorParallelGroup* g = group_.get();
    LossFn<T> loss = [g, vocab](const Tensor<T>& out, const Targets<T>& targets, Tensor<T>* dout, acc_t<T> scale) {
      VocabParallelCrossEntropy<T> ce(*g, vocab);
      nn::Cache<T> cache;
      const double l = ce.forward(out, targets, cache);
      if (dout) *dout = ce.backward(cache, scale);
      return l;
    };
    if (plan.pp == 1) {
      model_ = std::make_unique<detail::StageModule<T>>();
      nn::Parameter<T>* wte = nullptr;  // the embedding's weight shard, for a tied head
      for (std::size_t u = 0; u < m.names.size(); ++u) {
        auto unit = m.unit(u, *group_, m.tied ? wte : nullptr);
        if (plan.device) unit->to(*plan.device);  // before the tied head borrows the embedding's weight
        if (auto* e = dynamic_cast<VocabParallelEmbedding<T>*>(unit.get())) wte = &e->wte();
        if (batch_) unit = detail::context_parallel_tp_unit(unit, *group_, batch_);
        model_->add(m.names[u], std::move(unit));
      }
      if (plan.fsdp) {
        // Note [FSDP x TP]: the tensor-parallel units, sharded again over the replicas.
        FSDPOptions opt = *plan.fsdp;
        opt.unit_names = model_->unit_names();
        opt.device = plan.device;
        fsdp_ = std::make_unique<FSDP<T>>(model_->units(), mesh_->data_context_group(), opt);
        params_ = &fsdp_->parameters();
      } else {
        own_params_ = std::make_unique<nn::FlatParameters<T>>(*model_);
        params_ = own_params_.get();
      }
      this->set_loss(loss);
    } else {
      const std::vector<double> costs = plan.unit_costs.empty() ? std::vector<double>(m.names.size(), 1.0)
                                                                : plan.unit_costs;
      pipe_ = std::make_unique<Pipeline<T>>(
          *mesh_, m.names.size(),
          [&](std::size_t u) {
            auto unit = m.unit(u, *group_, nullptr);
            if (plan.device) unit->to(*plan.device);
            return unit;
          },
          partition_balanced(costs, plan.pp * plan.virtual_stages),
          PipelineOptions<T>{.schedule = plan.virtual_stages > 1 ? Schedule::Interleaved : plan.schedule,
                             .micro_batches = plan.micro_batches, .virtual_stages = plan.virtual_stages,
                             .unit_names = m.names, .loss = loss});
      params_ = &pipe_->parameters();
    }
    detail::collect_shard_specs(pipe_ ? pipe_->module() : *model_, "", all_specs_);
    for (const auto& e : parameters().entries()) {  // under FSDP: this rank's pieces, by name
      specs_.push_back(spec_of(e.name));
      if (specs_.back().partial) partial_.push_back(specs_.size() - 1);
    }
    for (const auto& e : parameters().frozen_entries()) frozen_specs_.push_back(spec_of(e.name));
    if (experts_) {
      std::set<const nn::Parameter<T>*> mine;
      for (auto* moe : moe_layers(*model_))
        for (auto& p : moe->experts().named_parameters()) mine.insert(p.param);
      for (const auto& e : parameters().entries()) expert_.push_back(mine.count(e.param));
      for (const auto& e : parameters().frozen_entries()) frozen_expert_.push_back(mine.count(e.param));
      // Replica 0's dense values over the replicas, expert replica 0's experts over the expert replicas.
      auto broadcast = [&](Tensor<T> v, bool expert) {
        dist::Communicator& c = expert ? experts_->expert_data_group() : replicas();
        if (c.size() > 1) c.broadcast(v, 0);
      };
      for_runs(parameters().entries(), expert_, parameters().values(), broadcast);
      for_runs(parameters().frozen_entries(), frozen_expert_, parameters().frozen_values(), broadcast);
    } else if (!fsdp_ && pipe_) {
      // Replica 0's values, frozen ones too, as DDP (FSDP broadcasts its own over the replicas).
      mesh_->broadcast_parameters(parameters());
    } else if (!fsdp_ && replicas().size() > 1) {
      if (parameters().numel() > 0) replicas().broadcast(parameters().values(), 0);
      if (parameters().frozen_values().numel() > 0) replicas().broadcast(parameters().frozen_values(), 0);
    }
  }

  // fn(view of `flat`, expert) for each run of consecutive entries of one kind (dense or expert).
  template <class Entries, class Fn>
  static void for_runs(const Entries& entries, const std::vector<char>& expert, const Tensor<T>& flat, Fn&& fn) {
    for (std::size_t i = 0; i < entries.size();) {
      std::size_t j = i + 1;
      while (j < entries.size() && expert[j] == expert[i]) ++j;
      const std::int64_t begin = entries[i].offset, end = entries[j - 1].offset + entries[j - 1].numel();
      fn(flat.view(begin, {end - begin}), expert[i] != 0);
      i = j;
    }
  }

  // Every rank must pass the same plan and model: agreed with fixed-size
  // collectives first (check_same_model), so a mismatch ends every rank with
  // the reason instead of a hang in a split or an all-reduce of another size.
  void check_plan(const Model& m, const TensorParallelPlan& plan) {
    const std::string desc = ::ptrain::detail::cat(
        "TensorParallelPlan{.tp = ", plan.tp, ", .sequence_parallel = ", plan.sequence_parallel ? "true" : "false",
        ", .pp = ", plan.pp, ", .micro_batches = ", plan.micro_batches, ", .virtual_stages = ", plan.virtual_stages,
        ", .fsdp = ", plan.fsdp ? strategy_name(plan.fsdp->strategy) : "none", ", .cp = ", plan.cp,
        ", .kv_exchange = ", plan.kv_exchange == KVExchange::Ring ? "Ring" : "AllGather", ", .expert_parallel = ",
        plan.expert_parallel, "} ", m.describe);
    try {
      check_same_model(world_, {desc});
    } catch (const Error& e) {
      PTRAIN_THROW(Error, "[ptrain.tp.plan] the ranks were given different tensor-parallel plans or models; pass "
                          "every rank the same TensorParallelPlan and config. ", e.what());
    }
    if (plan.cp > 1) {  // Note [Context-parallel engine], "With tensor parallelism"
      PTRAIN_CHECK(plan.pp == 1, Error, "[ptrain.cp.pipeline] context parallelism with tensor parallelism runs "
                   "without a pipeline, but the plan has pp = ", plan.pp, "; set pp = 1 or cp = 1");
      PTRAIN_CHECK(!plan.sequence_parallel, Error, "[ptrain.cp.sequence_parallel] sequence parallelism and context "
                   "parallelism both cut the sequence and are not combined; drop sequence_parallel (cp already "
                   "divides the activations by cp)");
      PTRAIN_CHECK(m.dropout == 0, Error, "[ptrain.cp.dropout] context parallelism trains without dropout (a slice "
                   "of a sequence would draw other masks); build the GPT with dropout = 0");
    }
    PTRAIN_CHECK(plan.tp >= 1 && plan.pp >= 1 && plan.cp >= 1 && world_.size() % (plan.tp * plan.cp * plan.pp) == 0,
                 Error, "[ptrain.tp.world] tp = ", plan.tp, " x cp = ", plan.cp, " x pp = ", plan.pp,
                 " does not divide the world of ", world_.size(), " ranks; launch a multiple of tp * cp * pp "
                 "processes");
    PTRAIN_CHECK(m.heads % plan.tp == 0, Error, "[ptrain.tp.heads] tp = ", plan.tp, " does not divide the ", m.heads,
                 " heads of ", m.describe, " (key/value heads for Llama); choose a tp degree that divides them");
    PTRAIN_CHECK(plan.pp == 1 || !m.tied, Error, "[ptrain.tp.tied] pp = ", plan.pp, " puts the embedding and the "
                 "head of a tied model on different stages, which cannot share their weight; build the model with "
                 "tie_weights = false");
    PTRAIN_CHECK(!plan.fsdp || plan.pp == 1, Error, "[ptrain.tp.fsdp_pipeline] FSDP x TP runs without a pipeline, "
                 "but the plan has pp = ", plan.pp, "; set pp = 1, or drop TensorParallelPlan::fsdp (the replicas "
                 "of a pipeline all-reduce their gradients)");
    PTRAIN_CHECK(m.moe || plan.expert_parallel == 1, Error, "[ptrain.ep.model] expert_parallel = ",
                 plan.expert_parallel, " but ", m.describe, " has no mixture-of-experts layer; use "
                 "expert_parallel = 1");
    PTRAIN_CHECK(!m.moe || (plan.pp == 1 && !plan.sequence_parallel && !plan.fsdp && plan.cp == 1), Error,
                 "[ptrain.tp.moe] tensor parallelism of ", m.describe, " (mixture-of-experts layers) runs without "
                 "pipeline stages, sequence parallelism, FSDP x TP and context parallelism (Note [Expert parallelism "
                 "x TP]); set pp = 1, sequence_parallel = false, no fsdp and cp = 1, or use DDPOptions{.expert_parallel}");
    PTRAIN_CHECK(plan.unit_costs.empty() || plan.unit_costs.size() == m.names.size(), Error, "[ptrain.tp.costs] ",
                 plan.unit_costs.size(), " unit costs for ", m.names.size(), " units");
  }

  double run(const BatchInput<T>& in, const Targets<T>& targets, double grad_scale, bool training) override {
    double l;
    if (fsdp_) {
      std::optional<decltype(fsdp_->no_sync())> local;  // FSDP's strategies decide what no_sync() skips
      if (!this->syncing()) local.emplace(fsdp_->no_sync());
      l = run_unit_chain(*fsdp_, in, targets, grad_scale, training);
    } else if (pipe_) {
      std::optional<decltype(pipe_->no_sync())> local;  // the pipeline skips its dp average as this engine does
      if (!this->syncing()) local.emplace(pipe_->no_sync());
      if (!training) l = in.ids ? pipe_->eval_loss(*in.ids, targets) : pipe_->eval_loss(*in.x, targets);
      else l = in.ids ? pipe_->forward_backward(*in.ids, targets, grad_scale)
                      : pipe_->forward_backward(*in.x, targets, grad_scale);
    } else {
      l = run_unit_chain(*model_, in, targets, grad_scale, training);
    }
    if (training && this->syncing()) pending_ = true;  // finished by finish_gradient_sync()
    return l;
  }

  // pp = 1: the model (or its FSDP), with cp > 1 on this rank's slice of the sequences
  // and the loss over the whole sequences (set_loss() does not apply then).
  double run_unit_chain(nn::Module<T>& m, const BatchInput<T>& in, const Targets<T>& targets, double grad_scale,
                        bool training) {
    if (!batch_) return this->run_module(m, in, targets, grad_scale, training);
    VocabParallelCrossEntropy<T> ce(*group_, vocab_);
    return detail::context_parallel_run(*batch_, document_token_, m, ce, in, targets, grad_scale, training);
  }
  // The ranks that hold this rank's weights (pp = 1): the dp x cp ranks with its tp index.
  dist::Communicator& replicas() { return mesh_->data_context_group(); }

  // The gradient of entry i of parameters() (under FSDP a piece of a parameter).
  Tensor<T> grad(std::size_t i) {
    const auto& e = parameters().entries()[i];
    return parameters().grads().view(e.offset, e.shape);
  }

  // Note [Sequence parallelism]: the norms' gradients, summed over the tp group in one
  // all-reduce; under FSDP x TP their pieces, which lie alike on every tp rank (Note [FSDP x TP]).
  void sum_partial_gradients() {
    if (partial_.empty()) return;
    const auto& entries = parameters().entries();
    std::int64_t n = 0;
    for (std::size_t i : partial_) n += entries[i].numel();
    auto buf = Tensor<T>::empty({n}, parameters().grads().device());
    std::int64_t at = 0;
    for (std::size_t i : partial_) {
      buf.view(at, {entries[i].numel()}).copy_(grad(i));
      at += entries[i].numel();
    }
    group_->all_reduce(buf);
    at = 0;
    for (std::size_t i : partial_) {
      grad(i).copy_(buf.view(at, {entries[i].numel()}));
      at += entries[i].numel();
    }
  }

  // Note [Tensor-parallel engine]: sharded squares summed over tp, replicated ones
  // once, then the stages' sums added; under FSDP both first summed over the FSDP
  // shard group, whose pieces hold each gradient of a tp rank once (Note [FSDP x TP]).
  double sum_over_model(double) override {
    double sq[3] = {0, 0, 0};  // sharded, replicated, experts (Note [Expert parallelism x TP])
    const auto& entries = parameters().entries();
    for (std::size_t i = 0; i < entries.size(); ++i)
      sq[is_expert(i) ? 2 : specs_[i].sharded() ? 0 : 1] += ops::sum_squares(grad(i));
    if (experts_ && experts_->ep_size() > 1)
      experts_->expert_group().all_reduce(&sq[2], 1, DType::F64, dist::ReduceOp::Sum);
    if (dist::Communicator* s = fsdp_ ? fsdp_->shard_group() : nullptr; s && s->size() > 1)
      s->all_reduce(sq, 2, DType::F64, dist::ReduceOp::Sum);
    if (group_->size() > 1) group_->communicator().all_reduce(&sq[0], 1, DType::F64, dist::ReduceOp::Sum);
    double total = sq[0] + sq[1] + sq[2];
    if (mesh_->pp_size() > 1) mesh_->pipeline_group().all_reduce(&total, 1, DType::F64, dist::ReduceOp::Sum);
    return total;
  }

  dist::Communicator& world_;
  std::unique_ptr<Mesh> mesh_;
  std::unique_ptr<TensorParallelGroup> group_;
  std::unique_ptr<ExpertMesh> experts_;  // a model with MoE layers (the units' dispatches refer to its groups)
  std::unique_ptr<detail::StageModule<T>> model_;     // pp = 1
  std::unique_ptr<nn::FlatParameters<T>> own_params_;  // pp = 1
  std::unique_ptr<Pipeline<T>> pipe_;                  // pp > 1
  nn::FlatParameters<T>* params_ = nullptr;            // own_params_ or the pipeline's
  std::vector<ShardSpec> specs_;
  std::vector<ShardSpec> frozen_specs_;  // of parameters().frozen_entries()
  std::vector<std::size_t> partial_;  // entries whose gradients are partial sums over tp
  std::vector<std::pair<std::string, ShardSpec>> all_specs_;  // every sharded or partial parameter, by name
  bool pending_ = false;
  std::int64_t vocab_ = 0;
  std::int32_t document_token_ = -1;
  std::shared_ptr<ContextParallelBatch> batch_;  // cp > 1
  std::unique_ptr<FSDP<T>> fsdp_;  // pp = 1 with TensorParallelPlan::fsdp; destroyed before what it refers to
  std::vector<char> expert_, frozen_expert_;  // per (frozen) entry, with experts_
};

}  // namespace ptrain::parallel
