#pragma once
// The vocabulary-parallel ops of tensor parallelism (parallel/tp_vocab.hpp): an
// embedding lookup and its backward over this rank's rows [lo, lo + local) of a
// token table, and the per-row statistics, loss and gradient of the
// vocabulary-parallel cross-entropy (Note [Vocabulary-parallel cross-entropy]).
// They compute one rank's part; the caller runs the collectives between them.
// The statistics are one acc_t<T> tensor [3 * rows]: M | Z | x_t - M
// (kernels/cpu/vocab_parallel.hpp).

#include <cstdint>

#include "ptrain/kernels/cpu/vocab_parallel.hpp"
#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

/// out [B, S, dim] = table[ids - lo] for ids in [lo, lo + table rows), zero rows for
/// the others, plus pos[s] at sequence position s when pos is defined. ids [B, S]
/// must be class ids (token_ids checks them).
template <class T>
Tensor<T> vocab_parallel_embedding(const Tensor<std::int32_t>& ids, std::int64_t lo, const Tensor<T>& table,
                                   const Tensor<T>& pos) {
  PTRAIN_CHECK(ids.dim() == 2 && table.dim() == 2, ShapeError, "[ptrain.tp.embedding] expected ids [batch, seq] and "
               "a table [rows, dim], got ", ids.shape(), " and ", table.shape());
  const std::int64_t dim = table.size(1), seq = ids.size(1);
  detail::check_devices("vocab_parallel_embedding", table.device(), ids);
  if (pos.defined()) {
    PTRAIN_CHECK(pos.dim() == 2 && pos.size(1) == dim && seq <= pos.size(0), ShapeError,
                 "[ptrain.embedding.positions] sequence of ", seq, " tokens but positions ", pos.shape(),
                 "; use sequences of at most block_size tokens");
    detail::check_devices("vocab_parallel_embedding", table.device(), pos);
  }
  auto out = Tensor<T>::empty({ids.size(0), seq, dim}, table.device());
  PTRAIN_DISPATCH(table.device(), T, vocab_parallel_embedding_forward, ids.numel(), dim, ids.data(), lo,
                  table.size(0), table.data(), pos.defined() ? pos.data() : static_cast<const T*>(nullptr), seq,
                  out.data());
  return out;
}

/// dtable[ids - lo] += dout for ids in [lo, lo + dtable rows) (rows in order:
/// deterministic); dpos[s] += dout at every position s when dpos is given.
template <class T>
void vocab_parallel_embedding_backward(const Tensor<std::int32_t>& ids, std::int64_t lo, const Tensor<T>& dout,
                                       Tensor<T>& dtable, Tensor<T>* dpos) {
  PTRAIN_CHECK(ids.dim() == 2 && dtable.dim() == 2 && dout.numel() == ids.numel() * dtable.size(1), ShapeError,
               "[ptrain.tp.embedding] output gradient ", dout.shape(), " does not match ids ", ids.shape(),
               " and table ", dtable.shape());
  detail::check_devices("vocab_parallel_embedding_backward", dtable.device(), ids, dout);
  if (dpos) detail::check_devices("vocab_parallel_embedding_backward", dtable.device(), *dpos);
  PTRAIN_DISPATCH(dtable.device(), T, vocab_parallel_embedding_backward, ids.numel(), dtable.size(1), ids.data(), lo,
                  dtable.size(0), dout.data(), dtable.data(), dpos ? dpos->data() : static_cast<T*>(nullptr),
                  ids.size(1));
}

/// Statistics [3 * rows] of logits [..., cols] (rows = all but the last dimension)
/// with M filled: each row's max over its first `real` columns (this rank's real
/// vocabulary); Z and x_t - M are left for vocab_parallel_row_sums.
template <class T>
Tensor<acc_t<T>> vocab_parallel_row_max(const Tensor<T>& logits, std::int64_t real) {
  const std::int64_t rows = rows_of(logits, "vocabulary-parallel logits"), cols = logits.size(-1);
  PTRAIN_CHECK(real >= 0 && real <= cols, ShapeError, "[ptrain.tp.logits] ", real, " real columns of ", cols);
  auto stats = Tensor<acc_t<T>>::empty({3 * rows}, logits.device());
  PTRAIN_DISPATCH(logits.device(), T, vocab_parallel_row_max, rows, cols, real, logits.data(), stats.data());
  return stats;
}

/// Fills Z and x_t - M of `stats` from its (global) M: this rank's sum of exp(x - M)
/// over its real columns [lo, lo + real) of the vocabulary, and the target's
/// x_t - M where this rank holds the target (0 elsewhere and on ignored rows).
template <class T>
void vocab_parallel_row_sums(const Tensor<T>& logits, const Tensor<std::int32_t>& targets, std::int64_t lo,
                             std::int64_t real, std::int32_t ignore_index, Tensor<acc_t<T>>& stats) {
  const std::int64_t rows = rows_of(logits, "vocabulary-parallel logits"), cols = logits.size(-1);
  PTRAIN_CHECK(targets.numel() == rows && stats.numel() == 3 * rows && real >= 0 && real <= cols, ShapeError,
               "[ptrain.tp.logits] logits ", logits.shape(), " with ", real, " real columns, ", targets.numel(),
               " targets and ", stats.numel(), " statistics do not match");
  detail::check_devices("vocab_parallel_row_sums", logits.device(), targets, stats);
  PTRAIN_DISPATCH(logits.device(), T, vocab_parallel_row_sums, rows, cols, real, lo, logits.data(), targets.data(),
                  ignore_index, stats.data());
}

/// The mean loss log Z - (x_t - M) over the rows whose target is not ignore_index,
/// from the global statistics (0 when none counts); `valid` gets their number.
/// ShapeError [ptrain.tp.target] for a target outside [0, vocab) (on a cuda device
/// this reads the verdict back, so it waits for the current stream).
template <class T>
double vocab_parallel_loss(const Tensor<acc_t<T>>& stats, const Tensor<std::int32_t>& targets, std::int64_t vocab,
                           std::int32_t ignore_index, std::int64_t& valid) {
  const std::int64_t rows = targets.numel();
  PTRAIN_CHECK(stats.numel() == 3 * rows, ShapeError, "[ptrain.tp.logits] ", stats.numel(), " statistics for ", rows,
               " targets");
  detail::check_devices("vocab_parallel_loss", stats.device(), targets);
  std::int64_t bad = -1;
  const double total = PTRAIN_DISPATCH(stats.device(), T, vocab_parallel_loss, rows, vocab, stats.data(),
                                       targets.data(), ignore_index, valid, bad);
  if (bad >= 0) {
    const std::int32_t t = targets.reshape({rows}).view(bad, {1}).to(Device::cpu()).data()[0];
    PTRAIN_THROW(ShapeError, "[ptrain.tp.target] target ", t, " at row ", bad, " is not a class id in [0, ", vocab,
                 ") nor ignore_index ", ignore_index, "; check the labels and the vocabulary size");
  }
  return valid > 0 ? total / static_cast<double>(valid) : 0.0;
}

/// Gradient of dloss * the mean loss with respect to this rank's logits, from the
/// global statistics and the count of `valid` rows; no communication.
template <class T>
Tensor<T> vocab_parallel_loss_backward(const Tensor<T>& logits, const Tensor<acc_t<T>>& stats,
                                       const Tensor<std::int32_t>& targets, std::int64_t lo, std::int64_t real,
                                       std::int64_t valid, acc_t<T> dloss, std::int32_t ignore_index) {
  using A = acc_t<T>;
  const std::int64_t rows = rows_of(logits, "vocabulary-parallel logits"), cols = logits.size(-1);
  PTRAIN_CHECK(targets.numel() == rows && stats.numel() == 3 * rows && real >= 0 && real <= cols, ShapeError,
               "[ptrain.tp.logits] logits ", logits.shape(), " with ", real, " real columns, ", targets.numel(),
               " targets and ", stats.numel(), " statistics do not match");
  detail::check_devices("vocab_parallel_loss_backward", logits.device(), targets, stats);
  const A scale = valid > 0 ? dloss / static_cast<A>(valid) : A(0);
  auto d = Tensor<T>::empty(logits.shape(), logits.device());
  PTRAIN_DISPATCH(logits.device(), T, vocab_parallel_loss_backward, rows, cols, real, lo, logits.data(), stats.data(),
                  targets.data(), ignore_index, scale, d.data());
  return d;
}

}  // namespace ptrain::ops
