#pragma once
// Column- and row-parallel linear layers (Megatron-LM): the building blocks of
// tensor-parallel attention and MLPs, for GPT and any model that pairs a layer
// that widens (q/k/v, c_fc, SwiGLU's gate and up) with one that narrows back
// (c_proj, down).
//
//   parallel::TensorParallelGroup tp(mesh.tensor_group());
//   parallel::ColumnParallelLinear<float> up(tp, 64, 256);    // x [.., 64]  -> [.., 256 / tp]
//   parallel::RowParallelLinear<float> down(tp, 256, 64);     // [.., 256 / tp] -> [.., 64], summed over tp
//
// Parameter names and full shapes are nn::Linear's ("weight" [out, in], "bias"
// [out]); each rank holds its shard (Note [Tensor parallel shards] in tp_group.hpp).
// With the group's sequence parallelism on, the replicated side of each layer
// (a column-parallel layer's input, a row-parallel layer's output) is this rank's
// slice of the sequence instead (Note [Sequence parallelism]).

#include <cmath>
#include <string>

#include "ptrain/nn/linear.hpp"
#include "ptrain/parallel/tp_group.hpp"

namespace ptrain::parallel {

/// y = x W^T + b with W's rows (the output features) split over the group; f in
/// front (Note [Tensor parallel f and g]): the input is replicated, the output a
/// shard of the features, and backward all-reduces dx. `blocks` > 1 splits each of
/// that many equal row blocks separately (fused q|k|v).
template <class T>
class ColumnParallelLinear : public nn::Module<T>, public ShardedModule {
 public:
  ColumnParallelLinear(TensorParallelGroup& group, std::int64_t in, std::int64_t out, bool bias = true,
                       std::int64_t blocks = 1, Generator& gen = default_generator())
      : group_(group), in_(in), spec_{0, blocks, out} {
    PTRAIN_CHECK(in > 0 && out > 0 && blocks > 0 && out % blocks == 0, ShapeError, "[ptrain.tp.shape] a column-"
                 "parallel linear needs positive sizes and blocks dividing its outputs, got ", in, " -> ", out,
                 " in ", blocks, " blocks");
    PTRAIN_CHECK(blocks == 1 || (out / blocks) % group.size() == 0, ShapeError, "[ptrain.tp.divide] ", out / blocks,
                 " features per block do not split over ", group.size(), " tensor-parallel ranks; choose a tp "
                 "degree that divides them (heads, hidden width)");
    const std::int64_t local = spec_.local(group.size());
    weight_ = &this->register_parameter("weight", nn::detail::fan_in_uniform<T>({local, in}, in, gen));
    if (bias) bias_ = &this->register_parameter("bias", nn::detail::fan_in_uniform<T>({local}, in, gen));
  }

  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    cache.tensors = {x};  // under sequence parallelism the slice, gathered again in backward
    return ops::linear(full_input(x), weight_->value, bias_ ? bias_->value : Tensor<T>());
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    PTRAIN_CHECK(!cache.tensors.empty(), Error, "[ptrain.backward] ColumnParallelLinear::backward without a forward");
    auto dx = ops::linear_backward(full_input(cache.tensors[0]), weight_->value, dy, weight_->grad,
                                   bias_ ? &bias_->grad : nullptr, need_input_grad_);
    weight_->mark_grad_ready();
    if (bias_) bias_->mark_grad_ready();
    // f's backward: each rank holds part of dx.
    if (need_input_grad_) {
      if (group_.sequence_parallel()) dx = group_.reduce_scatter_sequence(dx);
      else group_.all_reduce(dx);
    }
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    return "ColumnParallelLinear(" + std::to_string(in_) + ", " + std::to_string(spec_.full) + ", tp=" +
           std::to_string(group_.size()) + ")";
  }
  std::vector<std::pair<std::string, ShardSpec>> shard_specs() const override {
    if (bias_) return {{"weight", spec_}, {"bias", spec_}};
    return {{"weight", spec_}};
  }
  /// The first layer of a model needs no dx (and then no all-reduce of it).
  void set_need_input_grad(bool need) { need_input_grad_ = need; }
  nn::Parameter<T>& weight() { return *weight_; }
  nn::Parameter<T>* bias() { return bias_; }

 private:
  // f's forward: the whole input (gathered from the sequence slices under sequence parallelism).
  Tensor<T> full_input(const Tensor<T>& x) {
    return group_.sequence_parallel() ? group_.all_gather_sequence(x) : x;
  }

  TensorParallelGroup& group_;
  std::int64_t in_;
  ShardSpec spec_;
  nn::Parameter<T>* weight_ = nullptr;
  nn::Parameter<T>* bias_ = nullptr;
  bool need_input_grad_ = true;
};

/// y = x W^T + b with W's columns (the input features) split over the group; g
/// behind (Note [Tensor parallel f and g]): the input is a shard of the features,
/// the partial products are all-reduced, and the output is replicated. The bias is
/// replicated and added once, by tp rank 0, before the sum.
template <class T>
class RowParallelLinear : public nn::Module<T>, public ShardedModule {
 public:
  RowParallelLinear(TensorParallelGroup& group, std::int64_t in, std::int64_t out, bool bias = true,
                    Generator& gen = default_generator())
      : group_(group), out_(out), spec_{1, 1, in} {
    PTRAIN_CHECK(in > 0 && out > 0, ShapeError, "[ptrain.tp.shape] a row-parallel linear needs positive sizes, got ",
                 in, " -> ", out);
    PTRAIN_CHECK(in % group.size() == 0, ShapeError, "[ptrain.tp.divide] ", in, " input features do not split over ",
                 group.size(), " tensor-parallel ranks; choose a tp degree that divides them");
    weight_ = &this->register_parameter("weight", nn::detail::fan_in_uniform<T>({out, spec_.local(group.size())}, in, gen));
    if (bias) bias_ = &this->register_parameter("bias", nn::detail::fan_in_uniform<T>({out}, in, gen));
  }

  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    cache.tensors = {x};
    auto y = ops::linear(x, weight_->value, bias_ && group_.rank() == 0 ? bias_->value : Tensor<T>());
    // g's forward
    if (group_.sequence_parallel()) return group_.reduce_scatter_sequence(y);
    group_.all_reduce(y);
    return y;
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    PTRAIN_CHECK(!cache.tensors.empty(), Error, "[ptrain.backward] RowParallelLinear::backward without a forward");
    // dy is replicated (gathered under sequence parallelism: g's backward), so the
    // bias gradient (a sum of dy) is the same on every tp rank.
    const Tensor<T> full_dy = group_.sequence_parallel() ? group_.all_gather_sequence(dy) : dy;
    auto dx = ops::linear_backward(cache.tensors[0], weight_->value, full_dy, weight_->grad,
                                   bias_ ? &bias_->grad : nullptr);
    weight_->mark_grad_ready();
    if (bias_) bias_->mark_grad_ready();
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    return "RowParallelLinear(" + std::to_string(spec_.full) + ", " + std::to_string(out_) + ", tp=" +
           std::to_string(group_.size()) + ")";
  }
  std::vector<std::pair<std::string, ShardSpec>> shard_specs() const override { return {{"weight", spec_}}; }
  nn::Parameter<T>& weight() { return *weight_; }
  nn::Parameter<T>* bias() { return bias_; }

 private:
  TensorParallelGroup& group_;
  std::int64_t out_;
  ShardSpec spec_;
  nn::Parameter<T>* weight_ = nullptr;
  nn::Parameter<T>* bias_ = nullptr;
};

}  // namespace ptrain::parallel
