#pragma once
// A mixture-of-experts layer inside a tensor-parallel model: the experts stay whole
// (Megatron-Core's expert-tensor-parallel size 1) and are split over an expert-parallel
// group instead; each tp rank routes its own 1/tp of the tokens.
//
//   auto engine = parallel::make_engine<float>(mixtral, *world, parallel::TensorParallelPlan{.tp = 2, .expert_parallel = 2});
//
// Note [Expert parallelism x TP]
// - Mesh: world = dp x tp as for any TensorParallelPlan (world rank r = replica * tp + t,
//   Note [Tensor-parallel engine]); the experts see the same world as dp' x ep with ep
//   innermost (r = replica' * ep + e, ExpertMesh, Note [Expert-parallel layout]), as
//   Megatron-Core orders its expert ranks tp-ep-dp with expert-tensor-parallel size 1.
//   So an expert-parallel group is ep consecutive ranks: the tp group itself at ep = tp,
//   several tp groups (of several replicas) at ep = k tp, a part of one at ep < tp.
//   ep must divide the world and the experts, nothing else: ep = 1 (every rank holds
//   every expert) works too.
// - Tokens: the tp ranks of a replica hold the same residual stream x [N, C] (no
//   sequence parallelism). In an MoE block tp rank t takes tokens [t N/tp, (t+1) N/tp)
//   and runs the whole layer on them (router, dispatch over its expert-parallel group,
//   experts, combine, shared experts); one all-gather over tp gives every rank the
//   layer's output [N, C] again. Backward takes rank t's slice of the (replicated)
//   output gradient and all-gathers the input gradient. So world rank r routes the r-th
//   slice of the global batch, every token once, and the capacity rule of the dispatch
//   (world-rank order) is one process's on the global batch.
// - Gradients: attention and dense MLPs as TP (shards and replicated norms averaged over
//   data_group()). The router, the shared experts and their gate saw only this rank's
//   slice: their gradients are partial over tp (ShardSpec::partial), summed over tp,
//   then averaged over dp. An expert's gradient sums the tokens of its expert-parallel
//   group, each scaled as its replica's mean loss is; the global mean's gradient is the
//   sum over all world ranks divided by dp, so expert gradients are averaged over the
//   expert_data_group() (world / ep ranks) and multiplied by tp / ep.
// - The auxiliary losses are each slice's, their gradients scaled by 1/tp
//   (nn::MoE::set_aux_loss_scale): the replica's loss is the mean over its slices, as
//   one process that takes each world rank's slice as one micro-batch.
// - Clipping: sharded squares summed over tp, expert squares over the expert-parallel
//   group, the rest (partial gradients after their sum) counted once.
// - Checkpoints hold every tensor under the full model's names: world rank 0 writes the
//   dense tensors, replica' 0 of each expert-parallel index (world ranks 0 .. ep-1) its
//   experts, so they load into one process and at any tp and ep.
// - Not offered ([ptrain.tp.moe]): sequence parallelism (its slices are not contiguous
//   in the global token order), pipeline stages and FSDP x TP.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ptrain/dist/flight_recorder.hpp"
#include "ptrain/nn/moe.hpp"
#include "ptrain/parallel/tp_group.hpp"

namespace ptrain::parallel {

/// An nn::MoE run on this tp rank's 1/tp of the tokens, its output all-gathered over
/// the group (Note [Expert parallelism x TP]). Names as the nn::MoE it wraps.
template <class T>
class TensorParallelMoE : public nn::Module<T>, public ShardedModule {
 public:
  /// `moe` (its experts may be sharded over an expert-parallel group: parallel::shard_experts).
  TensorParallelMoE(TensorParallelGroup& group, std::shared_ptr<nn::MoE<T>> moe)
      : group_(group), moe_(std::move(moe)) {
    this->register_module("", moe_);
    moe_->set_aux_loss_scale(1.0 / group.size());
  }

  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    const auto [first, n] = slice(x);
    auto y = gather(moe_->forward(x.reshape({-1, x.size(-1)}).narrow(first, n), cache.child(0)));
    return y.reshape(x.shape());
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    const auto [first, n] = slice(dy);
    auto dx = gather(moe_->backward(dy.reshape({-1, dy.size(-1)}).narrow(first, n), cache.child(0)));
    cache.clear();
    return dx.reshape(dy.shape());
  }
  /// The router and the shared experts see this rank's tokens only: partial gradients.
  std::vector<std::pair<std::string, ShardSpec>> shard_specs() const override {
    std::vector<std::pair<std::string, ShardSpec>> out;
    if (group_.size() == 1) return out;
    for (auto& p : moe_->named_parameters())
      if (p.name.rfind("experts.", 0) != 0) out.emplace_back(p.name, ShardSpec{.partial = true});
    return out;
  }
  std::string describe() const override {
    return "TensorParallelMoE(tp=" + std::to_string(group_.size()) + ", " + moe_->describe() + ")";
  }
  nn::MoE<T>& moe() { return *moe_; }

 private:
  // This rank's rows [first, first + n) of the tokens of x [..., C].
  std::pair<std::int64_t, std::int64_t> slice(const Tensor<T>& x) const {
    const std::int64_t N = x.numel() / x.size(-1), tp = group_.size();
    PTRAIN_CHECK(N % tp == 0, ShapeError, "[ptrain.tp.moe_tokens] the ", N, " tokens of a batch ", x.shape(),
                 " do not split over tp = ", tp, " ranks for the mixture of experts; use batch x sequence a multiple "
                 "of tp");
    return {group_.rank() * (N / tp), N / tp};
  }
  // [n, C] on every rank -> [tp n, C], rank-major.
  Tensor<T> gather(const Tensor<T>& mine) {
    if (group_.size() == 1) return mine;
    auto all = Tensor<T>::empty({mine.size(0) * group_.size(), mine.size(1)}, mine.device());
    dist::CollectiveLabel label("tp.moe_gather");
    group_.communicator().check_serves(mine.device(), "tensor parallelism");
    group_.communicator().all_gather(mine, all);
    return all;
  }

  TensorParallelGroup& group_;
  std::shared_ptr<nn::MoE<T>> moe_;
};

}  // namespace ptrain::parallel
