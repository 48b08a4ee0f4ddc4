#pragma once
// The vocabulary-parallel pieces of tensor parallelism on device arrays: the
// embedding lookup and scatter-add restricted to rows [lo, lo + local) of the
// token table, and the statistics, loss and gradient of the vocabulary-parallel
// cross-entropy.
//
// Same names and arguments as kernels/cpu/vocab_parallel.hpp (read its header for
// the layout of `stats`). Float, double and bf16 (Note [bf16 kernels]; the
// statistics are float for bf16).
//
// The table's gradient is deterministic as in embedding.cuh (Note [Deterministic
// embedding backward]): each id becomes its local row, or `local` when another
// rank holds it; a stable radix sort of (local row, row) pairs groups the rows of
// each local row in increasing order, and one block per group adds them into the
// table in that order; the group of `local` is skipped. The cross-entropy runs a
// block per row (block reductions, as softmax.cuh), and the loss one block with a
// fixed summation order, so every result is the same bits from run to run.

#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/embedding.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

template <class T>
__global__ void vocab_embedding_forward_kernel(std::int64_t rows, std::int64_t dim, const std::int32_t* ids,
                                               std::int64_t lo, std::int64_t local, const T* table, const T* pos,
                                               std::int64_t seq, T* out) {
  for (std::int64_t i = global_index(); i < rows * dim; i += grid_stride()) {
    const std::int64_t r = i / dim, c = i % dim;
    const std::int64_t id = ids[r];
    const T t = id >= lo && id < lo + local ? table[(id - lo) * dim + c] : st<T>(acc_t<T>(0));
    out[i] = pos ? st<T>(ld(t) + ld(pos[(r % seq) * dim + c])) : t;
  }
}

// key[r] = ids[r] - lo for the ids this rank holds, `local` for the others.
template <class I>
__global__ void vocab_local_keys_kernel(std::int64_t rows, const I* ids, std::int64_t lo, std::int64_t local,
                                        std::uint32_t* keys) {
  for (std::int64_t r = global_index(); r < rows; r += grid_stride()) {
    const std::int64_t id = ids[r];
    keys[r] = static_cast<std::uint32_t>(id >= lo && id < lo + local ? id - lo : local);
  }
}

// As embedding_table_grad_kernel, skipping the group of key `local` (ids of other ranks).
template <class T>
__global__ void vocab_table_grad_kernel(std::int64_t rows, std::int64_t dim, std::uint32_t local,
                                        const std::uint32_t* sorted_keys, const std::int32_t* sorted_rows,
                                        const T* dout, T* dtable) {
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const std::uint32_t key = sorted_keys[i];
    if (key >= local || (i > 0 && sorted_keys[i - 1] == key)) continue;
    T* t = dtable + static_cast<std::int64_t>(key) * dim;
    for (std::int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
      acc_t<T> acc = ld(t[c]);
      for (std::int64_t j = i; j < rows && sorted_keys[j] == key; ++j)
        acc += ld(dout[static_cast<std::int64_t>(sorted_rows[j]) * dim + c]);
      t[c] = st<T>(acc);
    }
  }
}

template <class T>
__global__ void vocab_row_max_kernel(std::int64_t rows, std::int64_t cols, std::int64_t real, const T* logits,
                                     acc_t<T>* stats) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * cols;
    A m = std::numeric_limits<A>::lowest();
    for (std::int64_t c = threadIdx.x; c < real; c += blockDim.x) m = ld(xr[c]) > m ? ld(xr[c]) : m;
    m = block_max(m);
    if (threadIdx.x == 0) stats[r] = m;
  }
}

template <class T>
__global__ void vocab_row_sums_kernel(std::int64_t rows, std::int64_t cols, std::int64_t real, std::int64_t lo,
                                      const T* logits, const std::int32_t* targets, std::int32_t ignore_index,
                                      acc_t<T>* stats) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * cols;
    const A m = stats[r];
    A s = A(0);
    for (std::int64_t c = threadIdx.x; c < real; c += blockDim.x) s += dev_exp(ld(xr[c]) - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
      const std::int64_t t = targets[r];
      stats[rows + r] = s;
      stats[2 * rows + r] = t != ignore_index && t >= lo && t < lo + real ? ld(xr[t - lo]) - m : A(0);
    }
  }
}

// One block: out = {summed loss, counted rows}, first_bad = the first row whose
// target is outside [0, vocab) and not ignore_index (ULLONG_MAX: none).
template <class A>
__global__ void vocab_loss_kernel(std::int64_t rows, std::int64_t vocab, const A* stats, const std::int32_t* targets,
                                  std::int32_t ignore_index, double* out, unsigned long long* first_bad) {
  double total = 0, valid = 0;
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const std::int32_t t = targets[r];
    if (t == ignore_index) continue;
    if (t < 0 || t >= vocab) {
      atomicMin(first_bad, static_cast<unsigned long long>(r));
      continue;
    }
    total += log(static_cast<double>(stats[rows + r])) - static_cast<double>(stats[2 * rows + r]);
    valid += 1;
  }
  total = block_sum(total);
  valid = block_sum(valid);
  if (threadIdx.x == 0) {
    out[0] = total;
    out[1] = valid;
  }
}

template <class T>
__global__ void vocab_loss_backward_kernel(std::int64_t rows, std::int64_t cols, std::int64_t real, std::int64_t lo,
                                           const T* logits, const acc_t<T>* stats, const std::int32_t* targets,
                                           std::int32_t ignore_index, acc_t<T> scale, T* dlogits) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * cols;
    T* dr = dlogits + r * cols;
    const std::int32_t t = targets[r];
    const bool counted = t != ignore_index;
    const A m = stats[r], z = stats[rows + r];
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      A d = A(0);
      if (counted && c < real) {
        A p = dev_exp(ld(xr[c]) - m) / z;
        if (lo + c == t) p -= A(1);
        d = p * scale;
      }
      dr[c] = st<T>(d);
    }
  }
}

}  // namespace detail

/// out[r, :] = table[ids[r] - lo, :] for ids in [lo, lo + local), else 0; plus
/// pos[r % seq, :] when pos is not null.
template <class T>
void vocab_parallel_embedding_forward(std::int64_t rows, std::int64_t dim, const std::int32_t* ids, std::int64_t lo,
                                      std::int64_t local, const T* table, const T* pos, std::int64_t seq, T* out) {
  detail::check_element_type<T>();
  if (rows <= 0 || dim <= 0) return;
  detail::vocab_embedding_forward_kernel<T><<<detail::grid_for(rows * dim), detail::kBlock, 0, current_stream()>>>(
      rows, dim, ids, lo, local, table, pos, seq, out);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// dtable[ids[r] - lo, :] += dout[r, :] for ids in [lo, lo + local); dpos[r % seq, :]
/// += dout[r, :] for every row when dpos is not null. Deterministic (see the header).
template <class T>
void vocab_parallel_embedding_backward(std::int64_t rows, std::int64_t dim, const std::int32_t* ids, std::int64_t lo,
                                       std::int64_t local, const T* dout, T* dtable, T* dpos, std::int64_t seq) {
  detail::check_element_type<T>();
  if (rows <= 0 || dim <= 0) return;
  PTRAIN_CHECK(rows <= INT_MAX && local < INT_MAX, ShapeError, "[ptrain.cuda.embedding] ", rows, " ids or ", local,
               " table rows exceed the 32-bit limit of the sort; split the batch");
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  const int n = static_cast<int>(rows);
  int bits = 1;  // keys lie in [0, local]
  while (bits < 32 && (std::int64_t(1) << bits) <= local) ++bits;

  auto scratch = Tensor<std::int32_t>::empty({4 * rows}, Device::cuda(device));
  auto* keys = reinterpret_cast<std::uint32_t*>(scratch.data());
  auto* sorted_keys = keys + rows;
  std::int32_t* row_in = scratch.data() + 2 * rows;
  std::int32_t* row_out = row_in + rows;
  detail::vocab_local_keys_kernel<std::int32_t><<<detail::grid_for(rows), detail::kBlock, 0, stream>>>(rows, ids, lo, local, keys);
  PTRAIN_CHECK_CUDA_LAUNCH();
  detail::iota_kernel<std::int32_t><<<detail::grid_for(rows), detail::kBlock, 0, stream>>>(rows, row_in);
  PTRAIN_CHECK_CUDA_LAUNCH();
  std::size_t temp_bytes = 0;
  PTRAIN_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, sorted_keys, row_in, row_out, n, 0,
                                                    bits, stream));
  auto temp = Tensor<std::uint8_t>::empty({static_cast<std::int64_t>(temp_bytes) + 1}, Device::cuda(device));
  PTRAIN_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, keys, sorted_keys, row_in, row_out, n,
                                                    0, bits, stream));
  detail::vocab_table_grad_kernel<T><<<detail::grid_for_rows(rows), detail::block_for_cols(dim), 0, stream>>>(
      rows, dim, static_cast<std::uint32_t>(local), sorted_keys, row_out, dout, dtable);
  PTRAIN_CHECK_CUDA_LAUNCH();
  if (dpos) {
    const std::int64_t positions = rows < seq ? rows : seq;
    detail::embedding_pos_grad_kernel<T>
        <<<detail::grid_for(positions * dim), detail::kBlock, 0, stream>>>(rows, dim, seq, dout, dpos);
    PTRAIN_CHECK_CUDA_LAUNCH();
  }
}

/// stats[r] = max of the first `real` logits of row r (of `cols`).
template <class T>
void vocab_parallel_row_max(std::int64_t rows, std::int64_t cols, std::int64_t real, const T* logits,
                            acc_t<T>* stats) {
  detail::check_element_type<T>();
  if (rows <= 0) return;
  detail::vocab_row_max_kernel<T><<<detail::grid_for_rows(rows), detail::block_for_cols(real), 0, current_stream()>>>(
      rows, cols, real, logits, stats);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// Z and x_t - M of each row from the global max in stats[0, rows).
template <class T>
void vocab_parallel_row_sums(std::int64_t rows, std::int64_t cols, std::int64_t real, std::int64_t lo,
                             const T* logits, const std::int32_t* targets, std::int32_t ignore_index,
                             acc_t<T>* stats) {
  detail::check_element_type<T>();
  if (rows <= 0) return;
  detail::vocab_row_sums_kernel<T><<<detail::grid_for_rows(rows), detail::block_for_cols(real), 0, current_stream()>>>(
      rows, cols, real, lo, logits, targets, ignore_index, stats);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// The summed loss of the counted rows from the global statistics, the counted rows
/// (valid) and the first row with a target outside [0, vocab) (bad_row, -1: none);
/// waits for the current stream.
template <class T>
double vocab_parallel_loss(std::int64_t rows, std::int64_t vocab, const acc_t<T>* stats,
                           const std::int32_t* targets, std::int32_t ignore_index, std::int64_t& valid,
                           std::int64_t& bad_row) {
  detail::check_element_type<T>();
  valid = 0;
  bad_row = -1;
  if (rows <= 0) return 0.0;
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  auto scratch = Tensor<double>::empty({3}, Device::cuda(device));  // total, valid, first bad row
  double* out = scratch.data();
  auto* first_bad = reinterpret_cast<unsigned long long*>(out + 2);
  PTRAIN_CHECK_CUDA(cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned long long), stream));  // ULLONG_MAX
  detail::vocab_loss_kernel<acc_t<T>><<<1, 1024, 0, stream>>>(rows, vocab, stats, targets, ignore_index, out,
                                                              first_bad);
  PTRAIN_CHECK_CUDA_LAUNCH();
  double host[3] = {0, 0, 0};
  PTRAIN_CHECK_CUDA(cudaMemcpyAsync(host, out, sizeof(host), cudaMemcpyDeviceToHost, stream));
  PTRAIN_CHECK_CUDA(cudaStreamSynchronize(stream));
  unsigned long long bad = 0;
  static_assert(sizeof(bad) == sizeof(double));
  std::memcpy(&bad, &host[2], sizeof(bad));
  valid = static_cast<std::int64_t>(host[1]);
  bad_row = bad == ULLONG_MAX ? -1 : static_cast<std::int64_t>(bad);
  return host[0];
}

/// dlogits = scale * (exp(x - M) / Z - [column is the target]) on real columns of
/// counted rows, 0 elsewhere.
template <class T>
void vocab_parallel_loss_backward(std::int64_t rows, std::int64_t cols, std::int64_t real, std::int64_t lo,
                                  const T* logits, const acc_t<T>* stats, const std::int32_t* targets,
                                  std::int32_t ignore_index, acc_t<T> scale, T* dlogits) {
  detail::check_element_type<T>();
  if (rows <= 0 || cols <= 0) return;
  detail::vocab_loss_backward_kernel<T>
      <<<detail::grid_for_rows(rows), detail::block_for_cols(cols), 0, current_stream()>>>(
          rows, cols, real, lo, logits, stats, targets, ignore_index, scale, dlogits);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
