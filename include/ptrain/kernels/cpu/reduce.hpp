#pragma once
// Reductions. Sums accumulate in double so float results do not depend on
// the length of the array as much as a running float sum would.

#include <cstdint>

namespace ptrain::kernels::cpu {

template <class T>
double sum(std::int64_t n, const T* x) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]);
  return s;
}

/// Sum of squares (for gradient norms).
template <class T>
double sum_squares(std::int64_t n, const T* x) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return s;
}

/// out[r] = index of the largest element of row r of a [rows, cols] array (first on ties).
template <class T>
void argmax_rows(std::int64_t rows, std::int64_t cols, const T* x, std::int32_t* out) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * cols;
    std::int64_t best = 0;
    for (std::int64_t c = 1; c < cols; ++c)
      if (row[c] > row[best]) best = c;
    out[r] = static_cast<std::int32_t>(best);
  }
}

}  // namespace ptrain::kernels::cpu
