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
// Note [Sequence parallelism]
// With sequence parallelism on (Megatron-LM's), the residual stream between the
// tensor-parallel regions is cut along the sequence: each rank holds the tokens
// [t * S / tp, (t + 1) * S / tp) of x [B, S, C], and the norms, the residual
// adds and the dropouts run on that slice only. f and g change form:
//   f: all-gather along the sequence in forward (the column-parallel layer needs
//      every token), reduce-scatter of the input gradient in backward;
//   g: reduce-scatter along the sequence in forward (each rank keeps the sum for
//      its own tokens), all-gather of the output gradient in backward.
// A ring all-reduce is a reduce-scatter followed by an all-gather, so a region
// costs the same bytes on the wire as without it, but the activations outside
// the regions (norm inputs and outputs, residuals, dropout masks) shrink by tp.
// A column-parallel layer keeps its input slice, not the gathered input, and
// gathers it again in backward (one more all-gather per layer in backward, the
// price of keeping only S / tp tokens; Megatron does the same).
// The norms' parameters stay replicated, but each rank's gradient now covers only
// its tokens: the engine sums these "partial" gradients over the group before
// anything reads them (ShardSpec::partial). Dropout outside the regions draws a
// stream per tp rank, since each rank masks other tokens.
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
/// Its collectives run on the tensors' device, which the communicator must serve
/// (the CPU with MPI or Gloo, the GPU with NCCL); the sequence regrouping copies
/// blocks on that device.
class TensorParallelGroup {
 public:
  /// `comm` must outlive the group. `sequence_parallel`: Note [Sequence parallelism].
  explicit TensorParallelGroup(dist::Communicator& comm, bool sequence_parallel = false)
      : comm_(comm), sequence_parallel_(sequence_parallel) {}
  TensorParallelGroup(const TensorParallelGroup&) = delete;
  TensorParallelGroup& operator=(const TensorParallelGroup&) = delete;

  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  dist::Communicator& communicator() { return comm_; }
  /// Whether the residual stream between the regions is cut along the sequence.
  bool sequence_parallel() const { return sequence_parallel_ && size() > 1; }

  /// Sums t over the group in place (f's backward, g's forward); collective.
  template <class E>
  void all_reduce(Tensor<E>& t, dist::ReduceOp op = dist::ReduceOp::Sum) {
    if (size() < 2) return;
    dist::CollectiveLabel label("tp.all_reduce");
    count(t);
    comm_.all_reduce(t, op);
  }

  /// f's forward and g's backward: the whole tensor [B, S, ...] from this rank's
  /// sequence slice under sequence parallelism; `x` itself otherwise.
  template <class E>
  Tensor<E> whole(const Tensor<E>& x) {
    return sequence_parallel() ? all_gather_sequence(x) : x;
  }
  /// g's forward and f's backward: the sum over the group of every rank's partial
  /// tensor (all-reduce), or this rank's sequence slice of it under sequence parallelism.
  template <class E>
  Tensor<E> sum_partials(Tensor<E> x) {
    if (sequence_parallel()) return reduce_scatter_sequence(x);
    all_reduce(x);
    return x;
  }

  /// The full sequence [B, S, ...] from every rank's slice [B, S / tp, ...]
  /// (f's forward and g's backward under sequence parallelism); collective.
  template <class E>
  Tensor<E> all_gather_sequence(const Tensor<E>& slice) {
    if (size() < 2) return slice;
    PTRAIN_CHECK(slice.dim() >= 2, ShapeError, "[ptrain.tp.sequence] a sequence slice must be [batch, sequence, ...], "
                 "got ", slice.shape());
    const int tp = size();
    Shape full = slice.shape();
    full[1] *= tp;
    auto all = Tensor<E>::empty({slice.numel() * tp}, slice.device());  // [tp][B][S / tp][...]
    dist::CollectiveLabel label("tp.all_gather");
    count(all);
    comm_.all_gather(slice, all);
    auto out = Tensor<E>::empty(full, slice.device());  // [B][tp][S / tp][...]
    regroup(all, out, slice.size(0), false);
    return out;
  }
  /// This rank's slice [B, S / tp, ...] of the sum over the group of `full`
  /// [B, S, ...] (g's forward and f's backward under sequence parallelism); collective.
  template <class E>
  Tensor<E> reduce_scatter_sequence(const Tensor<E>& full) {
    if (size() < 2) return full;
    const int tp = size();
    PTRAIN_CHECK(full.dim() >= 2 && full.size(1) % tp == 0, ShapeError, "[ptrain.tp.sequence] sequence parallelism "
                 "cuts the sequence of ", full.shape(), " into ", tp, " equal slices; use a sequence length that is a "
                 "multiple of tp = ", tp, " or turn sequence parallelism off");
    Shape slice = full.shape();
    slice[1] /= tp;
    auto send = Tensor<E>::empty({full.numel()}, full.device());  // [tp][B][S / tp][...]
    regroup(full, send, full.size(0), true);
    auto out = Tensor<E>::empty(slice, full.device());
    dist::CollectiveLabel label("tp.reduce_scatter");
    count(send);
    comm_.reduce_scatter(send, out, dist::ReduceOp::Sum);
    return out;
  }
  /// Bytes of the full tensors handed to all-reduces, all-gathers (their output)
  /// and reduce-scatters (their input) since the last reset (payload, not wire bytes).
  std::int64_t bytes() const { return bytes_; }
  std::int64_t calls() const { return calls_; }
  void reset_counters() { bytes_ = calls_ = 0; }

 private:
  // Copies the B x tp blocks of `src` into `dst`: from [B][tp][block] to
  // [tp][B][block] order (the layout of the collectives' rank chunks) or back.
  template <class E>
  void regroup(const Tensor<E>& src, Tensor<E>& dst, std::int64_t B, bool to_rank_major) const {
    const int tp = size();
    const std::int64_t block = src.numel() / (B * tp);
    for (int r = 0; r < tp; ++r)
      for (std::int64_t b = 0; b < B; ++b) {
        const std::int64_t batch_major = (b * tp + r) * block, rank_major = (r * B + b) * block;
        dst.view(to_rank_major ? rank_major : batch_major, {block})
            .copy_(src.view(to_rank_major ? batch_major : rank_major, {block}));
      }
  }
  template <class E>
  void count(const Tensor<E>& full) {
    comm_.check_serves(full.device(), "tensor parallelism");
    bytes_ += full.numel() * static_cast<std::int64_t>(sizeof(E));
    ++calls_;
  }

  dist::Communicator& comm_;
  bool sequence_parallel_;
  std::int64_t bytes_ = 0, calls_ = 0;
};

/// How one parameter is cut over the tp group (Note [Tensor parallel shards]).
struct ShardSpec {
  int dim = -1;              ///< the cut dimension; -1: replicated on every tp rank
  std::int64_t blocks = 1;   ///< equal blocks of the dimension, each cut separately (3 for fused q|k|v)
  std::int64_t full = 0;     ///< the dimension's full (unpadded) size
  /// Replicated, but each rank's gradient is a part of the sum over the group (Note [Sequence parallelism]).
  bool partial = false;

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

/// The parameters of `norm` (named "prefix.<name>") as partial under sequence
/// parallelism, none otherwise (Note [Sequence parallelism]).
template <class T>
std::vector<std::pair<std::string, ShardSpec>> sequence_norm_specs(const TensorParallelGroup& group,
                                                                  const std::string& prefix, nn::Module<T>& norm) {
  std::vector<std::pair<std::string, ShardSpec>> out;
  if (group.sequence_parallel())
    for (auto& p : norm.named_parameters()) out.emplace_back(prefix + "." + p.name, ShardSpec{.partial = true});
  return out;
}

/// The seed of a dropout on the residual stream: one stream per tp rank under
/// sequence parallelism, where each rank masks its own tokens; `seed` otherwise.
inline std::uint64_t residual_dropout_seed(std::uint64_t seed, const TensorParallelGroup& group) {
  return group.sequence_parallel() ? seed ^ (0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(group.rank() + 1))
                                   : seed;
}

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

/// Rank's shard of `full` (any device; cut on the host, returned on full's device; padding zero).
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

/// The full tensor of which `local` (on any device) is this rank's shard:
/// all-gathers the shards over `group` (collective) and drops the padding. A host
/// tensor. The shards are gathered on local's device where the communicator serves
/// it (a GPU with NCCL), on the host otherwise; the padding is dropped on the host.
template <class E>
Tensor<E> gather_full(const Tensor<E>& local, const ShardSpec& s, TensorParallelGroup& group) {
  if (!s.sharded()) return local.to(Device::cpu());
  const int tp = group.size();
  const Device at = group.communicator().serves(local.device()) ? local.device() : Device::cpu();
  const Tensor<E> mine = local.to(at);
  Tensor<E> gathered = Tensor<E>::empty({local.numel() * tp}, at);
  if (tp > 1) group.communicator().all_gather(mine, gathered);
  else gathered.copy_(mine.view(0, {mine.numel()}));
  const Tensor<E> all = gathered.to(Device::cpu());
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
