#pragma once
// Tensor parallelism (Megatron-LM) as an Engine: every layer of a GPT is split
// over tp ranks (parallel/tp_gpt.hpp), and world / tp replicas of that split
// model train on their own part of the global batch.
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
// - Mesh: dp x tp (parallel/mesh.hpp), tp innermost, so the tp ranks of a
//   replica are consecutive world ranks (one node first).
// - Every tp rank of a replica runs forward_backward on the same batch; the
//   data-parallel rank (data_parallel_group()) says which slice of the global batch.
// - Gradients: sharded and replicated parameters alike are averaged over the
//   data_group() (the replicas holding the same shard), in one all-reduce of the
//   flat gradient buffer after backward (no overlap with backward: the tp
//   all-reduces of backward and the dp all-reduce never run at once). Replicated
//   parameters (LayerNorms, wpe, row-parallel biases) need no tp communication:
//   their gradients are equal on every tp rank by construction (Note [Tensor
//   parallel f and g] in tp_group.hpp).
// - Sequence parallelism (TensorParallelPlan::sequence_parallel, Note [Sequence
//   parallelism] in tp_group.hpp): the norms' partial gradients are summed over
//   the tp group in one all-reduce before the dp average, when the gradients are
//   synced; a batch's sequence length must then be a multiple of tp.
// - clip_grad_norm_: the squares of sharded gradients are summed over the tp
//   group, those of replicated ones are counted once.
// - The loss is VocabParallelCrossEntropy (set_loss() replaces it with a loss
//   that must itself take vocabulary-parallel logits).
// - Checkpoints (ckpt/tp_checkpoint.hpp) hold full tensors under nn::GPT's names.

#include <memory>
#include <string>
#include <vector>

#include "ptrain/parallel/engine.hpp"
#include "ptrain/parallel/mesh.hpp"
#include "ptrain/parallel/model_check.hpp"
#include "ptrain/parallel/tp_gpt.hpp"

namespace ptrain::parallel {

/// Tensor parallelism over tp consecutive ranks, data parallelism over world / tp replicas.
struct TensorParallelPlan {
  int tp = 1;
  /// Cut the residual stream along the sequence between the tensor-parallel regions
  /// (Note [Sequence parallelism] in tp_group.hpp): activations outside them shrink by tp.
  bool sequence_parallel = false;
};

template <class T>
class TensorParallel : public Engine<T> {
 public:
  /// The shards of nn::GPT<T>(cfg, gen), built unit by unit; collective over `world`
  /// (which must outlive the engine), every rank with the same plan and config.
  TensorParallel(const nn::GPTConfig& cfg, dist::Communicator& world, TensorParallelPlan plan,
                 const Generator& gen = default_generator())
      : world_(world) {
    init(cfg, plan, [&](TensorParallelGroup& g) { return std::make_unique<TensorParallelGPT<T>>(cfg, g, gen); });
  }
  /// The shards of an nn::GPT that every rank built alike (same config and values).
  TensorParallel(nn::GPT<T>& full, dist::Communicator& world, TensorParallelPlan plan) : world_(world) {
    init(full.config(), plan, [&](TensorParallelGroup& g) { return std::make_unique<TensorParallelGPT<T>>(full, g); });
  }

  Mode mode() const override { return Mode::TensorParallel; }
  nn::FlatParameters<T>& parameters() override { return *params_; }
  nn::Module<T>& local_module() override { return *model_; }
  dist::Communicator& communicator() override { return world_; }
  dist::Communicator* data_parallel_group() override { return &mesh_->data_group(); }
  void zero_grad() override {
    finish_gradient_sync();
    params_->zero_grad();
  }
  void finish_gradient_sync() override {
    if (!pending_) return;
    pending_ = false;
    sum_partial_gradients();
    if (mesh_->dp_size() > 1) {
      dist::CollectiveLabel label("tp.dp_gradients");
      mesh_->data_group().all_reduce(params_->grads(), dist::ReduceOp::Avg);
    }
  }

  TensorParallelGPT<T>& model() { return *model_; }
  Mesh& mesh() { return *mesh_; }
  TensorParallelGroup& group() { return *group_; }
  /// How entry i of parameters() is cut (Note [Tensor parallel shards]) and its full shape.
  const ShardSpec& spec(std::size_t i) const { return specs_.at(i); }
  Shape full_shape(std::size_t i) const { return detail::full_shape(params_->entries().at(i).shape, specs_.at(i)); }

 private:
  template <class Build>
  void init(const nn::GPTConfig& cfg, TensorParallelPlan plan, Build&& build) {
    check_plan(cfg, plan);
    mesh_ = std::make_unique<Mesh>(world_, MeshShape{.dp = world_.size() / plan.tp, .tp = plan.tp, .pp = 1});
    group_ = std::make_unique<TensorParallelGroup>(mesh_->tensor_group(), plan.sequence_parallel);
    model_ = build(*group_);
    params_ = std::make_unique<nn::FlatParameters<T>>(*model_);
    for (const auto& e : params_->entries()) specs_.push_back(model_->shard_spec(e.name));
    for (std::size_t i = 0; i < specs_.size(); ++i)
      if (specs_[i].partial) partial_.push_back(i);
    mesh_->broadcast_parameters(*params_);  // replica 0's values, as DDP
    const std::int64_t vocab = cfg.vocab_size;
    TensorParallelGroup* g = group_.get();
    this->set_loss([g, vocab](const Tensor<T>& out, const Targets<T>& targets, Tensor<T>* dout, acc_t<T> scale) {
      VocabParallelCrossEntropy<T> ce(*g, vocab);
      nn::Cache<T> cache;
      const double l = ce.forward(out, targets, cache);
      if (dout) *dout = ce.backward(cache, scale);
      return l;
    });
  }

  // Every rank must pass the same plan and model: agreed with fixed-size
  // collectives first (check_same_model), so a mismatch ends every rank with
  // the reason instead of a hang in a split or an all-reduce of another size.
  void check_plan(const nn::GPTConfig& cfg, TensorParallelPlan plan) {
    const std::string desc = ::ptrain::detail::cat("TensorParallelPlan{.tp = ", plan.tp, ", .sequence_parallel = ",
                                                   plan.sequence_parallel ? "true" : "false", "} GPT(vocab ", cfg.vocab_size,
                                                   ", block ", cfg.block_size, ", layers ", cfg.n_layer, ", heads ",
                                                   cfg.n_head, ", embd ", cfg.n_embd, ")");
    try {
      check_same_model(world_, {desc});
    } catch (const Error& e) {
      PTRAIN_THROW(Error, "[ptrain.tp.plan] the ranks were given different tensor-parallel plans or models; pass "
                          "every rank the same TensorParallelPlan and config. ", e.what());
    }
    PTRAIN_CHECK(plan.tp >= 1 && world_.size() % plan.tp == 0, Error, "[ptrain.tp.world] tp = ", plan.tp,
                 " does not divide the world of ", world_.size(), " ranks; launch a multiple of tp processes");
    PTRAIN_CHECK(cfg.n_head % plan.tp == 0, Error, "[ptrain.tp.heads] tp = ", plan.tp, " does not divide n_head ",
                 cfg.n_head, "; choose a tp degree that divides the number of heads");
  }

  double run(const BatchInput<T>& in, const Targets<T>& targets, double grad_scale, bool training) override {
    const double l = this->run_module(*model_, in, targets, grad_scale, training);
    if (training && this->syncing()) pending_ = true;  // reduced over dp by finish_gradient_sync()
    return l;
  }

  // Note [Sequence parallelism]: the norms' gradients, summed over the tp group in one all-reduce.
  void sum_partial_gradients() {
    if (partial_.empty()) return;
    const auto& entries = params_->entries();
    std::int64_t n = 0;
    for (std::size_t i : partial_) n += entries[i].param->grad.numel();
    auto buf = Tensor<T>::empty({n}, params_->grads().device());
    std::int64_t at = 0;
    for (std::size_t i : partial_) {
      const Tensor<T>& g = entries[i].param->grad;
      buf.view(at, {g.numel()}).copy_(g);
      at += g.numel();
    }
    group_->all_reduce(buf);
    at = 0;
    for (std::size_t i : partial_) {
      Tensor<T>& g = entries[i].param->grad;
      g.copy_(buf.view(at, {g.numel()}));
      at += g.numel();
    }
  }

  // Note [Tensor-parallel engine]: sharded squares summed over tp, replicated ones once.
  double sum_over_model(double) override {
    double sharded = 0, replicated = 0;
    const auto& entries = params_->entries();
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const double sq = ops::sum_squares(entries[i].param->grad);
      (specs_[i].sharded() ? sharded : replicated) += sq;
    }
    if (group_->size() > 1) group_->communicator().all_reduce(&sharded, 1, DType::F64, dist::ReduceOp::Sum);
    return sharded + replicated;
  }

  dist::Communicator& world_;
  std::unique_ptr<Mesh> mesh_;
  std::unique_ptr<TensorParallelGroup> group_;
  std::unique_ptr<TensorParallelGPT<T>> model_;
  std::unique_ptr<nn::FlatParameters<T>> params_;
  std::vector<ShardSpec> specs_;
  std::vector<std::size_t> partial_;  // entries whose gradients are partial sums over tp
  bool pending_ = false;
};

}  // namespace ptrain::parallel
