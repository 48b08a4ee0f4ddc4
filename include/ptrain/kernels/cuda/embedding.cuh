#pragma once
// Embedding lookups on device arrays: token ids read from a floating-point
// tensor, the row gather, and its scatter-add backward.
//
// Same names and arguments as kernels/cpu/embedding.hpp. The table may be float,
// double or bf16 (Note [bf16 kernels]); token ids come from float, double or int32.
//
// Note [Deterministic embedding backward]
// Several rows may carry the same id, so the backward pass adds several rows
// of dout into one row of dtable. Atomic adds would do that in whatever order
// the threads arrive, and float addition is not associative: the gradient
// would change in its last bits from run to run. Instead the ids are sorted
// (a stable radix sort of (id, row) pairs, CUB), which groups equal ids with
// their rows in increasing order; one block per group then adds the group's
// rows into the table row, each thread owning columns, in row order. That is
// the CPU kernel's order, so dtable is the same bits as on the CPU, on every
// run. The position gradient needs no sort: position s receives rows s,
// s + seq, s + 2 seq, ..., which one thread per (s, column) adds in order.

#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

// Writes ids and records the smallest index of a value that is not an id in
// *first_bad (which starts at ULLONG_MAX): the minimum does not depend on the
// order in which threads arrive, so the reported position is deterministic.
template <class T>
__global__ void token_ids_kernel(std::int64_t n, const T* x, std::int64_t vocab, std::int32_t* ids,
                                 unsigned long long* first_bad) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) {
    const double v = static_cast<double>(ld(x[i]));
    const bool ok = floor(v) == v && v >= 0 && v < static_cast<double>(vocab);
    ids[i] = ok ? static_cast<std::int32_t>(v) : 0;
    if (!ok) atomicMin(first_bad, static_cast<unsigned long long>(i));
  }
}

template <class T>
__global__ void embedding_forward_kernel(std::int64_t rows, std::int64_t dim, const std::int32_t* ids,
                                         const T* table, const T* pos, std::int64_t seq, T* out) {
  for (std::int64_t i = global_index(); i < rows * dim; i += grid_stride()) {
    const std::int64_t r = i / dim, c = i % dim;
    const T t = table[static_cast<std::int64_t>(ids[r]) * dim + c];
    out[i] = pos ? st<T>(ld(t) + ld(pos[(r % seq) * dim + c])) : t;
  }
}

template <class I>
__global__ void iota_kernel(std::int64_t n, I* out) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) out[i] = static_cast<I>(i);
}

// Block b looks at sorted position b; if it starts a run of equal ids, the
// block adds the run's rows of dout (in increasing row order, as the sort is
// stable) into that id's row of dtable. Blocks inside a run return at once.
template <class T>
__global__ void embedding_table_grad_kernel(std::int64_t rows, std::int64_t dim, const std::uint32_t* sorted_ids,
                                            const std::int32_t* sorted_rows, const T* dout, T* dtable) {
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const std::uint32_t id = sorted_ids[i];
    if (i > 0 && sorted_ids[i - 1] == id) continue;
    T* t = dtable + static_cast<std::int64_t>(id) * dim;
    for (std::int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
      acc_t<T> acc = ld(t[c]);
      for (std::int64_t j = i; j < rows && sorted_ids[j] == id; ++j)
        acc += ld(dout[static_cast<std::int64_t>(sorted_rows[j]) * dim + c]);
      t[c] = st<T>(acc);
    }
  }
}

// dpos[s, c] += dout[s, c] + dout[s + seq, c] + ..., added in that order.
template <class T>
__global__ void embedding_pos_grad_kernel(std::int64_t rows, std::int64_t dim, std::int64_t seq, const T* dout,
                                          T* dpos) {
  const std::int64_t n = (rows < seq ? rows : seq) * dim;
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) {
    const std::int64_t s = i / dim, c = i % dim;
    acc_t<T> acc = ld(dpos[i]);
    for (std::int64_t r = s; r < rows; r += seq) acc += ld(dout[r * dim + c]);
    dpos[i] = st<T>(acc);
  }
}

}  // namespace detail

/// ids[i] = x[i] for n device values that must be integers in [0, vocab). Returns the
/// index of the first value that is not, or -1; waits for the current stream.
template <class T>
std::int64_t token_ids(std::int64_t n, const T* x, std::int64_t vocab, std::int32_t* ids) {
  static_assert(detail::is_float_or_double<T> || std::is_same_v<T, std::int32_t>,
                "ptrain::kernels::cuda::token_ids: ids come as float, double or int32 (not bf16: ids above 256 "
                "are not exact in it)");
  if (n <= 0) return -1;
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  auto flag = Tensor<std::int64_t>::empty({1}, Device::cuda(device));
  auto* first_bad = reinterpret_cast<unsigned long long*>(flag.data());
  PTRAIN_CHECK_CUDA(cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned long long), stream));  // ULLONG_MAX
  detail::token_ids_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, stream>>>(n, x, vocab, ids, first_bad);
  PTRAIN_CHECK_CUDA_LAUNCH();
  // Reading the verdict waits for the stream, like cross_entropy_forward: an id
  // outside the table must become an exception before any kernel gathers with it.
  unsigned long long host = 0;
  PTRAIN_CHECK_CUDA(cudaMemcpyAsync(&host, first_bad, sizeof(host), cudaMemcpyDeviceToHost, stream));
  PTRAIN_CHECK_CUDA(cudaStreamSynchronize(stream));
  return host == ULLONG_MAX ? -1 : static_cast<std::int64_t>(host);
}

/// out[r, :] = table[ids[r], :] + pos[r % seq, :] for r < rows (pos may be null).
template <class T>
void embedding_forward(std::int64_t rows, std::int64_t dim, const std::int32_t* ids, const T* table, const T* pos,
                       std::int64_t seq, T* out) {
  detail::check_element_type<T>();
  if (rows <= 0 || dim <= 0) return;
  detail::embedding_forward_kernel<T><<<detail::grid_for(rows * dim), detail::kBlock, 0, current_stream()>>>(
      rows, dim, ids, table, pos, seq, out);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// dtable[ids[r], :] += dout[r, :]; dpos[r % seq, :] += dout[r, :] (dpos may be null).
/// Deterministic, and the same bits as the CPU (Note [Deterministic embedding backward]).
/// Ids must lie in [0, rows of dtable), as token_ids guarantees.
template <class T>
void embedding_backward(std::int64_t rows, std::int64_t dim, const std::int32_t* ids, const T* dout, T* dtable,
                        T* dpos, std::int64_t seq) {
  detail::check_element_type<T>();
  if (rows <= 0 || dim <= 0) return;
  PTRAIN_CHECK(rows <= INT_MAX, ShapeError, "[ptrain.cuda.embedding] ", rows,
               " ids exceed the 32-bit limit of the sort; split the batch");
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  const int n = static_cast<int>(rows);

  // Scratch from the device's allocator: sorted ids, row indices before and after the sort.
  auto keys = Tensor<std::int32_t>::empty({3 * rows}, Device::cuda(device));
  auto* sorted_ids = reinterpret_cast<std::uint32_t*>(keys.data());
  std::int32_t* row_in = keys.data() + rows;
  std::int32_t* row_out = row_in + rows;
  detail::iota_kernel<std::int32_t><<<detail::grid_for(rows), detail::kBlock, 0, stream>>>(rows, row_in);
  PTRAIN_CHECK_CUDA_LAUNCH();
  // Ids are non-negative, so as unsigned keys they sort the same; bit 31 is always 0.
  const auto* keys_in = reinterpret_cast<const std::uint32_t*>(ids);
  std::size_t temp_bytes = 0;
  PTRAIN_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, sorted_ids, row_in, row_out, n, 0,
                                                    31, stream));
  auto temp = Tensor<std::uint8_t>::empty({static_cast<std::int64_t>(temp_bytes) + 1}, Device::cuda(device));
  PTRAIN_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, keys_in, sorted_ids, row_in, row_out, n,
                                                    0, 31, stream));

  detail::embedding_table_grad_kernel<T>
      <<<detail::grid_for_rows(rows), detail::block_for_cols(dim), 0, stream>>>(rows, dim, sorted_ids, row_out, dout,
                                                                              dtable);
  PTRAIN_CHECK_CUDA_LAUNCH();
  if (dpos) {
    const std::int64_t positions = rows < seq ? rows : seq;
    detail::embedding_pos_grad_kernel<T>
        <<<detail::grid_for(positions * dim), detail::kBlock, 0, stream>>>(rows, dim, seq, dout, dpos);
    PTRAIN_CHECK_CUDA_LAUNCH();
  }
}

}  // namespace ptrain::kernels::cuda
