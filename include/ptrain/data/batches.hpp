#pragma once
// Shuffled mini-batches: a per-epoch permutation and a row gather.
//
// The permutation depends only on (n, seed, epoch) and is drawn from ptrain's
// counter-based Generator, so every rank and every machine computes the same
// order without communicating, and a resumed run needs only (seed, epoch) and
// its position in the epoch to continue exactly where it stopped.
//
//   auto order = shuffled_indices(train.labels.numel(), seed, epoch);
//   for (std::int64_t b = 0; b < num_batches(n, batch, false); ++b) {
//     const std::int64_t count = std::min(batch, n - b * batch);
//     gather_rows(train.images, order.data() + b * batch, count, x);   // x: [batch, 784]
//     gather_rows(train.labels, order.data() + b * batch, count, y);   // y: [batch]
//   }

#include <cstdint>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"

namespace ptrain {

namespace detail {
/// SplitMix64 finaliser: spreads nearby inputs (epoch 0, 1, 2...) over unrelated keys.
inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace detail

/// Random stream key for one epoch of one run; distinct for distinct (seed, epoch) pairs in practice.
inline std::uint64_t epoch_seed(std::uint64_t seed, std::uint64_t epoch) {
  return detail::splitmix64(detail::splitmix64(seed) ^ epoch);
}

/// A permutation of 0..n-1 for (seed, epoch): Fisher-Yates driven by Generator(epoch_seed(seed, epoch)).
/// Pure: the same arguments give the same order on every machine and rank.
inline std::vector<std::int64_t> shuffled_indices(std::int64_t n, std::uint64_t seed, std::uint64_t epoch) {
  PTRAIN_CHECK(n >= 0, Error, "[ptrain.data.shuffle] cannot shuffle ", n, " items; pass n >= 0");
  std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
  std::iota(idx.begin(), idx.end(), std::int64_t{0});
  Generator gen(epoch_seed(seed, epoch));
  // Position i swaps with a uniform j in [0, i]; below() is unbiased, so every
  // permutation is equally likely.
  for (std::int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(gen.below(static_cast<std::uint64_t>(i) + 1));
    std::swap(idx[static_cast<std::size_t>(i)], idx[static_cast<std::size_t>(j)]);
  }
  return idx;
}

/// Number of batches of size `batch` in n items; the last partial batch counts unless drop_last.
inline std::int64_t num_batches(std::int64_t n, std::int64_t batch, bool drop_last) {
  PTRAIN_CHECK(n >= 0 && batch > 0, Error, "[ptrain.data.batches] invalid n = ", n, " or batch = ", batch,
               "; pass n >= 0 and batch > 0");
  return drop_last ? n / batch : (n + batch - 1) / batch;
}

/// Copies rows src[idx[0]], ..., src[idx[count-1]] into dst's first `count` rows (CPU tensors).
/// src [N, ...] and dst [M >= count, ...] must have the same shape after the first dimension.
template <class T>
void gather_rows(const Tensor<T>& src, const std::int64_t* idx, std::int64_t count, Tensor<T>& dst) {
  PTRAIN_CHECK(src.device().is_cpu() && dst.device().is_cpu(), Error, "[ptrain.data.gather] gather_rows needs cpu "
               "tensors, got src on ", src.device(), " and dst on ", dst.device(),
               "; gather on the cpu, then copy the batch to the device");
  PTRAIN_CHECK(src.dim() >= 1 && dst.dim() == src.dim(), ShapeError, "[ptrain.data.gather] src ", src.shape(),
               " and dst ", dst.shape(), " need the same number of dimensions (at least 1)");
  for (int d = 1; d < src.dim(); ++d)
    PTRAIN_CHECK(src.size(d) == dst.size(d), ShapeError, "[ptrain.data.gather] rows of src ", src.shape(),
                 " and dst ", dst.shape(), " differ in dimension ", d);
  PTRAIN_CHECK(count >= 0 && count <= dst.size(0), ShapeError, "[ptrain.data.gather] ", count,
               " rows do not fit in dst ", dst.shape());
  const std::int64_t rows = src.size(0);
  const std::int64_t row = rows == 0 ? 0 : src.numel() / rows;
  const std::size_t row_bytes = static_cast<std::size_t>(row) * sizeof(T);
  const T* s = src.data();
  T* o = dst.data();
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t r = idx[i];
    PTRAIN_CHECK(r >= 0 && r < rows, Error, "[ptrain.data.gather] index ", r, " at position ", i,
                 " is out of range for ", rows, " rows");
    std::memcpy(o + i * row, s + r * row, row_bytes);
  }
}

}  // namespace ptrain
