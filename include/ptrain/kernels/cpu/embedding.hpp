#pragma once
// Embedding lookups: token ids read from a floating-point tensor, rows of a
// table gathered by those ids, and the scatter-add that is their backward pass.

#include <cmath>
#include <cstdint>

namespace ptrain::kernels::cpu {

/// ids[i] = x[i] for n values that must be integers in [0, vocab). Returns the index of
/// the first value that is not (ids is then partly written), or -1 when all are ids.
template <class T>
std::int64_t token_ids(std::int64_t n, const T* x, std::int64_t vocab, std::int32_t* ids) {
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    if (!(std::floor(v) == v && v >= 0 && v < static_cast<double>(vocab))) return i;
    ids[i] = static_cast<std::int32_t>(v);
  }
  return -1;
}

/// out[r, :] = table[ids[r], :] + pos[r % seq, :] for r < rows (pos may be null).
template <class T>
void embedding_forward(std::int64_t rows, std::int64_t dim, const std::int32_t* ids, const T* table, const T* pos,
                       std::int64_t seq, T* out) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* t = table + static_cast<std::int64_t>(ids[r]) * dim;
    T* o = out + r * dim;
    if (pos) {
      const T* p = pos + (r % seq) * dim;
      for (std::int64_t c = 0; c < dim; ++c) o[c] = t[c] + p[c];
    } else {
      for (std::int64_t c = 0; c < dim; ++c) o[c] = t[c];
    }
  }
}

/// dtable[ids[r], :] += dout[r, :]; dpos[r % seq, :] += dout[r, :] (dpos may be null).
/// Rows are visited in order, so repeated ids accumulate deterministically.
template <class T>
void embedding_backward(std::int64_t rows, std::int64_t dim, const std::int32_t* ids, const T* dout, T* dtable,
                        T* dpos, std::int64_t seq) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* g = dout + r * dim;
    T* t = dtable + static_cast<std::int64_t>(ids[r]) * dim;
    for (std::int64_t c = 0; c < dim; ++c) t[c] += g[c];
    if (dpos) {
      T* p = dpos + (r % seq) * dim;
      for (std::int64_t c = 0; c < dim; ++c) p[c] += g[c];
    }
  }
}

}  // namespace ptrain::kernels::cpu
