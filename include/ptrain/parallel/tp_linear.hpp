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
#include <memory>
#include <string>

#include "ptrain/nn/linear.hpp"
#include "ptrain/parallel/tp_group.hpp"

namespace ptrain::parallel {

namespace detail {
// The rows a column-parallel layer keeps on each rank, after checking that they split.
inline std::int64_t column_shard_rows(const TensorParallelGroup& group, std::int64_t in, std::int64_t out,
                                      std::int64_t blocks) {
  PTRAIN_CHECK(in > 0 && out > 0 && blocks > 0 && out % blocks == 0, ShapeError, "[ptrain.tp.shape] a column-"
               "parallel linear needs positive sizes and blocks dividing its outputs, got ", in, " -> ", out,
               " in ", blocks, " blocks");
  PTRAIN_CHECK(blocks == 1 || (out / blocks) % group.size() == 0, ShapeError, "[ptrain.tp.divide] ", out / blocks,
               " features per block do not split over ", group.size(), " tensor-parallel ranks; choose a tp "
               "degree that divides them (heads, hidden width)");
  return ShardSpec{0, blocks, out}.local(group.size());
}
// The input columns a row-parallel layer keeps on each rank, after checking that they split.
inline std::int64_t row_shard_columns(const TensorParallelGroup& group, std::int64_t in, std::int64_t out) {
  PTRAIN_CHECK(in > 0 && out > 0, ShapeError, "[ptrain.tp.shape] a row-parallel linear needs positive sizes, got ",
               in, " -> ", out);
  PTRAIN_CHECK(in % group.size() == 0, ShapeError, "[ptrain.tp.divide] ", in, " input features do not split over ",
               group.size(), " tensor-parallel ranks; choose a tp degree that divides them");
  return in / group.size();
}
}  // namespace detail

/// y = x W^T + b with W's rows (the output features) split over the group; f in
/// front (Note [Tensor parallel f and g]): the input is replicated, the output a
/// shard of the features, and backward all-reduces dx. `blocks` > 1 splits each of
/// that many equal row blocks separately (fused q|k|v). An nn::Linear of the
/// local shape, so modules built from Linears (SwiGLU, GroupedQueryAttention)
/// take it as it is.
template <class T>
class ColumnParallelLinear : public nn::Linear<T>, public ShardedModule {
 public:
  ColumnParallelLinear(TensorParallelGroup& group, std::int64_t in, std::int64_t out, bool bias = true,
                       std::int64_t blocks = 1, Generator& gen = default_generator())
      : nn::Linear<T>(in, detail::column_shard_rows(group, in, out, blocks), bias, gen), group_(group), in_(in),
        spec_{0, blocks, out}, has_bias_(bias) {}

  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    if (f_outside_) return nn::Linear<T>::forward(x, cache);
    cache.tensors = {x};  // under sequence parallelism the slice, gathered again in backward
    return ops::linear(group_.whole(x), this->weight().value, bias_value());
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    if (f_outside_) return nn::Linear<T>::backward(dy, cache);
    PTRAIN_CHECK(!cache.tensors.empty(), Error, "[ptrain.backward] ColumnParallelLinear::backward without a forward");
    nn::Parameter<T>& w = this->weight();
    nn::Parameter<T>* b = this->bias();
    const bool need_dx = this->need_input_grad();
    auto dx = ops::linear_backward(group_.whole(cache.tensors[0]), w.value, dy, w.grad, b ? &b->grad : nullptr,
                                   need_dx);
    w.mark_grad_ready();
    if (b) b->mark_grad_ready();
    cache.clear();
    return need_dx ? group_.sum_partials(dx) : dx;  // f's backward: each rank holds part of dx
  }
  std::string describe() const override {
    return "ColumnParallelLinear(" + std::to_string(in_) + ", " + std::to_string(spec_.full) + ", tp=" +
           std::to_string(group_.size()) + ")";
  }
  std::vector<std::pair<std::string, ShardSpec>> shard_specs() const override {
    if (has_bias_) return {{"weight", spec_}, {"bias", spec_}};
    return {{"weight", spec_}};
  }
  /// The caller applies f once for several layers that read the same input (q, k
  /// and v; SwiGLU's gate and up: ColumnParallelRegion): forward then takes the
  /// whole input and backward returns this layer's part of dx, as a plain Linear.
  void set_f_outside(bool outside) { f_outside_ = outside; }

 private:
  Tensor<T> bias_value() { return this->bias() ? this->bias()->value : Tensor<T>(); }

  TensorParallelGroup& group_;
  std::int64_t in_;
  ShardSpec spec_;
  bool has_bias_, f_outside_ = false;
};

/// y = x W^T + b with W's columns (the input features) split over the group; g
/// behind (Note [Tensor parallel f and g]): the input is a shard of the features,
/// the partial products are all-reduced, and the output is replicated. The bias is
/// replicated and added once, by tp rank 0, before the sum. Initialised as the
/// full layer would be (bound 1/sqrt(in)).
template <class T>
class RowParallelLinear : public nn::Linear<T>, public ShardedModule {
 public:
  RowParallelLinear(TensorParallelGroup& group, std::int64_t in, std::int64_t out, bool bias = true,
                    Generator& gen = default_generator())
      : nn::Linear<T>(detail::row_shard_columns(group, in, out), out, bias, *std::make_unique<Generator>(0)),
        group_(group), out_(out), spec_{1, 1, in} {
    this->weight().value.copy_(nn::detail::fan_in_uniform<T>({out, in / group.size()}, in, gen));
    if (this->bias()) this->bias()->value.copy_(nn::detail::fan_in_uniform<T>({out}, in, gen));
  }

  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    cache.tensors = {x};
    nn::Parameter<T>* b = this->bias();
    return group_.sum_partials(ops::linear(x, this->weight().value, b && group_.rank() == 0 ? b->value : Tensor<T>()));
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    PTRAIN_CHECK(!cache.tensors.empty(), Error, "[ptrain.backward] RowParallelLinear::backward without a forward");
    // dy is replicated (gathered under sequence parallelism: g's backward), so the
    // bias gradient (a sum of dy) is the same on every tp rank.
    nn::Parameter<T>& w = this->weight();
    nn::Parameter<T>* b = this->bias();
    auto dx = ops::linear_backward(cache.tensors[0], w.value, group_.whole(dy), w.grad, b ? &b->grad : nullptr);
    w.mark_grad_ready();
    if (b) b->mark_grad_ready();
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    return "RowParallelLinear(" + std::to_string(spec_.full) + ", " + std::to_string(out_) + ", tp=" +
           std::to_string(group_.size()) + ")";
  }
  std::vector<std::pair<std::string, ShardSpec>> shard_specs() const override { return {{"weight", spec_}}; }

 private:
  TensorParallelGroup& group_;
  std::int64_t out_;
  ShardSpec spec_;
};

/// f around a module whose column-parallel layers all read its input with f
/// outside (ColumnParallelLinear::set_f_outside): forward gathers the input once
/// (under sequence parallelism), backward sums the layers' parts of dx once. Its
/// names are the inner module's (registered under ""), as nn::Recompute's.
template <class T>
class ColumnParallelRegion : public nn::Module<T> {
 public:
  ColumnParallelRegion(TensorParallelGroup& group, std::shared_ptr<nn::Module<T>> inner)
      : group_(group), inner_(std::move(inner)) {
    this->register_module("", inner_);
  }
  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    return inner_->forward(group_.whole(x), cache.child(0));
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    auto dx = group_.sum_partials(inner_->backward(dy, cache.child(0)));
    cache.clear();
    return dx;
  }
  std::string describe() const override { return "ColumnParallelRegion(" + inner_->describe() + ")"; }
  nn::Module<T>& inner() { return *inner_; }

 private:
  TensorParallelGroup& group_;
  std::shared_ptr<nn::Module<T>> inner_;
};

}  // namespace ptrain::parallel
