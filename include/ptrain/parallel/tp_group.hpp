#pragma once
// The tensor-parallel group and how a full tensor is cut into its shards.
//
// A TensorParallelGroup is the communicator of the tp ranks that share one
// layer's shards, plus a count of the bytes its layers hand to all-reduces
// (checked against the Megatron formula in tests and docs/tensor_parallel.md).
//
// Note [Tensor parallel f and g]
// Megatron's two conjugate operators, on the tensor-parallel group:
//   f: identity in forward, all-reduce (sum) of the input gradient in backward;
//      it sits in front of a column-parallel layer, whose ranks each read the
//      whole (replicated) input and contribute a part of its gradient.
//   g: all-reduce (sum) in forward, identity in backward; it sits behind a
//      row-parallel layer, whose ranks each produce a partial sum of the output.
// A column-parallel layer followed by a row-parallel one (attention: q/k/v by
// heads then c_proj by rows; MLP: c_fc by columns then c_proj by rows) therefore
// costs one all-reduce of the activations in forward and one in backward, and
// everything between them (attention per head, GELU) runs on local shards.
// Outside these pairs the residual stream, the norms and their gradients are
// replicated: every tp rank computes the same values from the same inputs, so
// replicated parameters get equal gradients on every tp rank without any
// communication of their own.
//
// Note [Tensor parallel shards]
// A sharded parameter is cut along one dimension into tp equal contiguous parts,
// rank r holding part r. A dimension made of several equal blocks (GPT's fused
// q|k|v rows of c_attn) is cut block by block, so each rank holds q, k and v of
// its own heads, in that order, and ops::causal_attention runs on them unchanged.
// A single-block dimension that tp does not divide (a vocabulary) is padded up to
// a multiple of tp; padding rows are zero, are masked out of the loss, get zero
// gradients and so stay zero; they are never saved (checkpoints hold the full,
// unpadded tensors).

#include <cstdint>
#include <string>
#include <vector>

#include "ptrain/core/tensor.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/flight_recorder.hpp"
#include "ptrain/nn/module.hpp"

namespace ptrain::parallel {

/// The ranks that hold the shards of one layer, and what they sent (Note [Tensor parallel f and g]).
class TensorParallelGroup {
 public:
  /// `comm` must outlive the group.
  explicit TensorParallelGroup(dist::Communicator& comm) : comm_(comm) {}
  TensorParallelGroup(const TensorParallelGroup&) = delete;
  TensorParallelGroup& operator=(const TensorParallelGroup&) = delete;

  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  dist::Communicator& communicator() { return comm_; }

  /// Sums t over the group in place (f's backward, g's forward); collective.
  template <class E>
  void all_reduce(Tensor<E>& t, dist::ReduceOp op = dist::ReduceOp::Sum) {
    if (size() < 2) return;
    comm_.check_serves(t.device(), "tensor parallelism");
    dist::CollectiveLabel label("tp.all_reduce");
    bytes_ += t.numel() * static_cast<std::int64_t>(sizeof(E));
    ++calls_;
    comm_.all_reduce(t, op);
  }
  /// Bytes handed to all-reduces since the last reset (payload, not wire bytes).
  std::int64_t bytes() const { return bytes_; }
  std::int64_t calls() const { return calls_; }
  void reset_counters() { bytes_ = calls_ = 0; }

 private:
  dist::Communicator& comm_;
  std::int64_t bytes_ = 0, calls_ = 0;
};

/// How one parameter is cut over the tp group (Note [Tensor parallel shards]).
struct ShardSpec {
  int dim = -1;              ///< the cut dimension; -1: replicated on every tp rank
  std::int64_t blocks = 1;   ///< equal blocks of the dimension, each cut separately (3 for fused q|k|v)
  std::int64_t full = 0;     ///< the dimension's full (unpadded) size

  bool sharded() const { return dim >= 0; }
  /// Size of the cut dimension on each of tp ranks (padded up where tp does not divide a single block).
  std::int64_t local(int tp) const { return blocks * ((full / blocks + tp - 1) / tp); }
};

/// A module that holds sharded parameters names them (its own parameter names, without prefix).
class ShardedModule {
 public:
  virtual ~ShardedModule() = default;
  virtual std::vector<std::pair<std::string, ShardSpec>> shard_specs() const = 0;
};

namespace detail {

/// Every sharded parameter of `m`'s tree by full dotted name (what named_parameters() calls it).
template <class T>
void collect_shard_specs(nn::Module<T>& m, const std::string& prefix, std::vector<std::pair<std::string, ShardSpec>>& out) {
  if (auto* s = dynamic_cast<ShardedModule*>(&m))
    for (auto& [name, spec] : s->shard_specs()) out.emplace_back(prefix + name, spec);
  for (auto& [name, child] : m.children()) collect_shard_specs(*child, name.empty() ? prefix : prefix + name + ".", out);
}

/// The shape of the full tensor of a shard of shape `local`.
inline Shape full_shape(const Shape& local, const ShardSpec& s) {
  if (!s.sharded()) return local;
  Shape d = local;
  d[s.dim] = s.full;
  return d;
}

// Walks the elements a shard shares with the full tensor: calls fn(full_index,
// local_index) for every element of rank's shard that is not padding.
template <class Fn>
void for_shard_elements(const Shape& full, const ShardSpec& s, int rank, int tp, Fn&& fn) {
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < s.dim; ++i) outer *= full[i];
  for (int i = s.dim + 1; i < full.size(); ++i) inner *= full[i];
  const std::int64_t per = s.full / s.blocks, per_pad = (per + tp - 1) / tp, local = s.local(tp);
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t j = 0; j < local; ++j) {
      const std::int64_t b = j / per_pad, k = rank * per_pad + j % per_pad;
      if (k >= per) continue;  // padding
      const std::int64_t fi = (o * s.full + b * per + k) * inner, li = (o * local + j) * inner;
      for (std::int64_t i = 0; i < inner; ++i) fn(fi + i, li + i);
    }
}

/// Rank's shard of `full` (on full's device; padding zero).
template <class E>
Tensor<E> shard_of(const Tensor<E>& full, const ShardSpec& s, int rank, int tp) {
  if (!s.sharded()) return full;
  const Tensor<E> host = full.to(Device::cpu());
  Shape d = full.shape();
  d[s.dim] = s.local(tp);
  auto out = Tensor<E>::zeros(d);
  for_shard_elements(full.shape(), s, rank, tp, [&](std::int64_t fi, std::int64_t li) { out.data()[li] = host.data()[fi]; });
  return out.to(full.device());
}

/// The full tensor of which `local` is this rank's shard: all-gathers the shards
/// over `group` (collective) and drops the padding. A host tensor.
template <class E>
Tensor<E> gather_full(const Tensor<E>& local, const ShardSpec& s, TensorParallelGroup& group) {
  const Tensor<E> host = local.to(Device::cpu());
  if (!s.sharded()) return host;
  const int tp = group.size();
  Tensor<E> all = Tensor<E>::empty({local.numel() * tp});
  if (tp > 1) group.communicator().all_gather(host, all);
  else all.copy_(host.view(0, {host.numel()}));
  const Shape full = full_shape(local.shape(), s);
  auto out = Tensor<E>::empty(full);
  for (int r = 0; r < tp; ++r)
    for_shard_elements(full, s, r, tp, [&](std::int64_t fi, std::int64_t li) {
      out.data()[fi] = all.data()[r * local.numel() + li];
    });
  return out;
}

}  // namespace detail
}  // namespace ptrain::parallel
