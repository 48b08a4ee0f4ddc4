#pragma once
// The vocabulary-parallel pieces of tensor parallelism (parallel/tp_vocab.hpp):
// the embedding lookup and its scatter-add restricted to this rank's rows
// [lo, lo + local) of the token table, and the per-row statistics of the
// vocabulary-parallel cross-entropy (Note [Vocabulary-parallel cross-entropy]).
//
// A rank holds `local` vocabulary rows (columns of its logits), of which the first
// `real` are real classes and the rest padding (Note [Tensor parallel shards]).
// T is float, double or bf16, computed in acc_t<T> and rounded once where a value
// of T is stored.
//
// The cross-entropy's statistics live in one acc_t<T> array `stats` of 3 * rows
// values, M | Z | x_t - M: row_max writes M (this rank's max), the caller
// all-reduces it (max); row_sums writes Z and x_t - M from the global M, the
// caller all-reduces them (sum); loss and loss_backward read the global values.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "ptrain/core/dtype.hpp"

namespace ptrain::kernels::cpu {

/// out[r, :] = table[ids[r] - lo, :] where lo <= ids[r] < lo + local, else 0;
/// plus pos[r % seq, :] when pos is not null (added in acc_t<T>).
template <class T>
void vocab_parallel_embedding_forward(std::int64_t rows, std::int64_t dim, const std::int32_t* ids, std::int64_t lo,
                                      std::int64_t local, const T* table, const T* pos, std::int64_t seq, T* out) {
  using A = acc_t<T>;
  for (std::int64_t r = 0; r < rows; ++r) {
    T* o = out + r * dim;
    const std::int64_t id = ids[r];
    if (id >= lo && id < lo + local) std::copy_n(table + (id - lo) * dim, dim, o);
    else std::fill_n(o, dim, T(A(0)));
    if (pos) {
      const T* p = pos + (r % seq) * dim;
      for (std::int64_t c = 0; c < dim; ++c) o[c] = static_cast<T>(static_cast<A>(o[c]) + static_cast<A>(p[c]));
    }
  }
}

/// dtable[ids[r] - lo, :] += dout[r, :] for the ids in [lo, lo + local);
/// dpos[r % seq, :] += dout[r, :] for every row when dpos is not null. Rows in
/// order, each addition in acc_t<T> rounded to T, so repeated ids accumulate
/// deterministically.
template <class T>
void vocab_parallel_embedding_backward(std::int64_t rows, std::int64_t dim, const std::int32_t* ids, std::int64_t lo,
                                       std::int64_t local, const T* dout, T* dtable, T* dpos, std::int64_t seq) {
  using A = acc_t<T>;
  auto add_row = [dim](T* dst, const T* src) {
    for (std::int64_t c = 0; c < dim; ++c) dst[c] = static_cast<T>(static_cast<A>(dst[c]) + static_cast<A>(src[c]));
  };
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* g = dout + r * dim;
    const std::int64_t id = ids[r];
    if (dpos) add_row(dpos + (r % seq) * dim, g);
    if (id >= lo && id < lo + local) add_row(dtable + (id - lo) * dim, g);
  }
}

/// stats[r] = max over the first `real` of the `cols` logits of row r (the lowest
/// finite value when real is 0).
template <class T>
void vocab_parallel_row_max(std::int64_t rows, std::int64_t cols, std::int64_t real, const T* logits,
                            acc_t<T>* stats) {
  using A = acc_t<T>;
  for (std::int64_t r = 0; r < rows; ++r) {
    A m = std::numeric_limits<A>::lowest();
    for (std::int64_t j = 0; j < real; ++j) m = std::max(m, static_cast<A>(logits[r * cols + j]));
    stats[r] = m;
  }
}

/// From the global max M = stats[0, rows): Z = stats[rows + r] = sum over the real
/// columns of exp(x - M), and stats[2 rows + r] = x[target] - M where this rank
/// holds the target's column (target in [lo, lo + real)), else 0 (ignored rows too).
template <class T>
void vocab_parallel_row_sums(std::int64_t rows, std::int64_t cols, std::int64_t real, std::int64_t lo,
                             const T* logits, const std::int32_t* targets, std::int32_t ignore_index,
                             acc_t<T>* stats) {
  using A = acc_t<T>;
  const A* M = stats;
  A* Z = stats + rows;
  A* xt = Z + rows;
  for (std::int64_t r = 0; r < rows; ++r) {
    A z = 0;
    for (std::int64_t j = 0; j < real; ++j) z += std::exp(static_cast<A>(logits[r * cols + j]) - M[r]);
    Z[r] = z;
    const std::int64_t t = targets[r];
    xt[r] = t != ignore_index && t >= lo && t < lo + real ? static_cast<A>(logits[r * cols + (t - lo)]) - M[r] : A(0);
  }
}

/// The summed loss of the counted rows, sum of log Z - (x_t - M) in double in row
/// order, from the global statistics. valid: rows whose target is not
/// ignore_index; bad_row: the first row whose target is neither ignore_index nor in
/// [0, vocab), or -1 (its row then does not count). A is acc_t<T> of the logits'
/// type T (the statistics alone take part).
template <class A>
double vocab_parallel_loss(std::int64_t rows, std::int64_t vocab, const A* stats, const std::int32_t* targets,
                           std::int32_t ignore_index, std::int64_t& valid, std::int64_t& bad_row) {
  const A* Z = stats + rows;
  const A* xt = Z + rows;
  double loss = 0;
  valid = 0;
  bad_row = -1;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int32_t t = targets[r];
    if (t == ignore_index) continue;
    if (t < 0 || t >= vocab) {
      if (bad_row < 0) bad_row = r;
      continue;
    }
    ++valid;
    loss += std::log(static_cast<double>(Z[r])) - static_cast<double>(xt[r]);
  }
  return loss;
}

/// dlogits = scale * (exp(x - M) / Z - [column is the target]) on the real columns of
/// counted rows; 0 on padding columns and ignored rows.
template <class T>
void vocab_parallel_loss_backward(std::int64_t rows, std::int64_t cols, std::int64_t real, std::int64_t lo,
                                  const T* logits, const acc_t<T>* stats, const std::int32_t* targets,
                                  std::int32_t ignore_index, acc_t<T> scale, T* dlogits) {
  using A = acc_t<T>;
  const A* M = stats;
  const A* Z = stats + rows;
  for (std::int64_t r = 0; r < rows; ++r) {
    T* d = dlogits + r * cols;
    std::fill_n(d, cols, T(A(0)));
    const std::int32_t t = targets[r];
    if (t == ignore_index) continue;
    for (std::int64_t j = 0; j < real; ++j) {
      A p = std::exp(static_cast<A>(logits[r * cols + j]) - M[r]) / Z[r];
      if (lo + j == t) p -= 1;
      d[j] = static_cast<T>(p * scale);
    }
  }
}

}  // namespace ptrain::kernels::cpu
