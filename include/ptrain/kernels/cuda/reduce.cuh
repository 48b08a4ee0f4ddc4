#pragma once
// Reductions on device arrays, and the warp/block reduction primitives the
// row-wise kernels (softmax, cross-entropy, LayerNorm) share.
//
// sum and sum_squares accumulate in double, as the CPU versions do, and return
// the result to the host, so they wait for the current stream. Partial sums go
// to a scratch tensor from the device's allocator (it shows up in the counters
// while the call runs, like any other allocation).

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

struct SumOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return b > a ? b : a;
  }
};

template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// Reduces v over the block and returns the result to every thread. Every
/// thread of the block must call it; blockDim.x a multiple of 32 (at most 1024),
/// blockDim.y == 1. `identity` is the value that leaves op unchanged.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T identity) {
  __shared__ T warp_results[32];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  v = warp_reduce(v, op);
  // This barrier also orders the write below after every thread read the
  // result of a previous call, since the shared array is reused across calls.
  __syncthreads();
  if (lane == 0) warp_results[warp] = v;
  __syncthreads();
  const unsigned warps = blockDim.x >> 5;
  v = lane < warps ? warp_results[lane] : identity;
  return warp_reduce(v, op);  // every warp reduces the same values, so no third barrier
}

template <class T>
__device__ __forceinline__ T block_sum(T v) {
  return block_reduce(v, SumOp{}, T(0));
}
template <class T>
__device__ __forceinline__ T block_max(T v) {
  return block_reduce(v, MaxOp{}, T(-INFINITY));
}

// ------------------------------------------------------- rows in registers ----
//
// The row kernels that read a row once (Note [Row kernels in one read] in
// layer_norm.cuh; softmax_rows_one_read) give a row a block of
// block_for_cols(cols) threads, each holding N elements of it in registers, N
// a compile-time power of two: rows up to kRowRegisterWidth wide.

inline constexpr int kRowThreads = 512;  // block_for_cols's largest block
inline constexpr int kRowMaxPerThread = 16;
inline constexpr std::int64_t kRowRegisterWidth = std::int64_t{kRowThreads} * kRowMaxPerThread;

/// Elements per thread of a row of d with `block` threads: the power of two >= d / block.
inline int row_per_thread(std::int64_t d, int block) {
  int n = 1;
  while (std::int64_t{n} * block < d) n *= 2;
  return n;
}

/// f(std::integral_constant<int, N>{}) for N = n, n a power of two in [1, kRowMaxPerThread].
template <class F>
void with_per_thread(int n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: f(std::integral_constant<int, 16>{}); break;
  }
  static_assert(kRowMaxPerThread == 16, "with_per_thread covers 1 .. 16");
}

// ------------------------------------------------------------ column sums ----
//
// out_k[c] += sum over rows r of term_k(r, c), k < K, for a [rows, cols] layout.
// One block per (32-column tile, chunk of rows) writes its partial sums to
// scratch; a second kernel adds the chunks of each column in chunk order. The
// split depends only on rows and cols, so the result is the same bits on every
// run, and narrow layers still fill the GPU: [8192, 768] runs 24 x 32 blocks
// where one block per tile gave 24.
//
// Terms is a struct with `static constexpr int K` and
// `__device__ void operator()(std::int64_t r, std::int64_t c, A* out) const`.

inline std::int64_t column_chunks(std::int64_t rows, std::int64_t cols) {
  const std::int64_t tiles = (cols + kColTile - 1) / kColTile;
  const std::int64_t by_rows = (rows + kColChunkRows - 1) / kColChunkRows;
  const std::int64_t by_grid = kColTargetBlocks / tiles > 1 ? kColTargetBlocks / tiles : 1;
  const std::int64_t chunks = by_rows < by_grid ? by_rows : by_grid;
  return chunks < 1 ? 1 : chunks > 65535 ? 65535 : chunks;
}

template <class A, class Terms>
__global__ void column_partials_kernel(std::int64_t rows, std::int64_t cols, std::int64_t chunk, Terms terms,
                                       A* partial) {
  constexpr int K = Terms::K;
  __shared__ A part[K][kColRows][kColTile + 1];  // +1: no bank conflicts when reading a column
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * chunk;
  const std::int64_t end = begin + chunk < rows ? begin + chunk : rows;
  A acc[K];
  for (int k = 0; k < K; ++k) acc[k] = A(0);
  if (col < cols)
    for (std::int64_t r = begin + threadIdx.y; r < end; r += kColRows) {
      A t[K];
      terms(r, col, t);
      for (int k = 0; k < K; ++k) acc[k] += t[k];
    }
  for (int k = 0; k < K; ++k) part[k][threadIdx.y][threadIdx.x] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && col < cols)
    for (int k = 0; k < K; ++k) {
      A s = A(0);
      for (int j = 0; j < kColRows; ++j) s += part[k][j][threadIdx.x];
      partial[(static_cast<std::int64_t>(k) * gridDim.y + blockIdx.y) * cols + col] = s;
    }
}

template <class T, int K>
struct ColumnOutputs {
  T* out[K];
};

template <class A, class T, int K>
__global__ void column_finish_kernel(std::int64_t cols, std::int64_t chunks, const A* partial,
                                     ColumnOutputs<T, K> outs) {
  for (std::int64_t c = global_index(); c < cols; c += grid_stride())
    for (int k = 0; k < K; ++k) {
      A s = A(0);
      for (std::int64_t j = 0; j < chunks; ++j) s += partial[(k * chunks + j) * cols + c];
      outs.out[k][c] = st<T>(ld(outs.out[k][c]) + s);
    }
}

/// outs[k][c] += sum_r terms(r, c)[k] on the current stream (see above).
template <class T, class Terms>
void column_sums(std::int64_t rows, std::int64_t cols, Terms terms, ColumnOutputs<T, Terms::K> outs) {
  using A = acc_t<T>;
  if (rows <= 0 || cols <= 0) return;
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  const std::int64_t chunks = column_chunks(rows, cols), chunk = (rows + chunks - 1) / chunks;
  auto scratch = Tensor<A>::empty({Terms::K * chunks * cols}, Device::cuda(device));
  const dim3 block(kColTile, kColRows);
  const dim3 grid(static_cast<unsigned>((cols + kColTile - 1) / kColTile), static_cast<unsigned>(chunks));
  column_partials_kernel<A, Terms><<<grid, block, 0, stream>>>(rows, cols, chunk, terms, scratch.data());
  PTRAIN_CHECK_CUDA_LAUNCH();
  column_finish_kernel<A, T, Terms::K><<<grid_for(cols), kBlock, 0, stream>>>(cols, chunks, scratch.data(), outs);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

inline constexpr int kReduceBlock = 256;
inline constexpr int kMaxPartials = 1024;

template <class T, bool Squares>
__global__ void sum_partial_kernel(std::int64_t n, const T* x, double* partial) {
  double acc = 0;
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) {
    const double v = static_cast<double>(ld(x[i]));
    acc += Squares ? v * v : v;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One block adds the per-block partials in a fixed order: the result does not
// depend on timing, only on n and the launch configuration. (A template, like
// every kernel in these headers: `inline` does not apply to __global__, and a
// plain kernel defined in a header would be defined again by every TU.)
template <class Acc>
__global__ void sum_final_kernel(int count, const Acc* partial, Acc* out) {
  Acc acc = 0;
  for (int i = static_cast<int>(threadIdx.x); i < count; i += static_cast<int>(blockDim.x)) acc += partial[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = acc;
}

template <class T, bool Squares>
double sum_impl(std::int64_t n, const T* x) {
  check_element_type<T>();
  if (n <= 0) return 0.0;
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  const unsigned blocks = grid_for(n, kReduceBlock) < kMaxPartials ? grid_for(n, kReduceBlock) : kMaxPartials;
  auto scratch = Tensor<double>::empty({static_cast<std::int64_t>(blocks) + 1}, Device::cuda(device));
  double* partial = scratch.data();
  sum_partial_kernel<T, Squares><<<blocks, kReduceBlock, 0, stream>>>(n, x, partial);
  PTRAIN_CHECK_CUDA_LAUNCH();
  sum_final_kernel<double><<<1, kMaxPartials, 0, stream>>>(static_cast<int>(blocks), partial, partial + blocks);
  PTRAIN_CHECK_CUDA_LAUNCH();
  double result = 0;
  PTRAIN_CHECK_CUDA(cudaMemcpyAsync(&result, partial + blocks, sizeof(double), cudaMemcpyDeviceToHost, stream));
  PTRAIN_CHECK_CUDA(cudaStreamSynchronize(stream));
  return result;
}

// First maximum of each row. A candidate (value, index) replaces the current
// one when its value is larger, or equal with a smaller index: that is the
// CPU's "first on ties" whatever order threads combine in. "No element yet" is
// (-inf, cols), which any real element replaces; NaN never wins a comparison.
template <class T>
__device__ __forceinline__ void argmax_combine(T& v, int& idx, T ov, int oi) {
  if (ov > v || (ov == v && oi < idx)) {
    v = ov;
    idx = oi;
  }
}

template <class T>
__device__ __forceinline__ void argmax_warp(T& v, int& idx) {
  for (int o = 16; o > 0; o >>= 1) {
    const T ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    argmax_combine(v, idx, ov, oi);
  }
}

template <class T>
__global__ void argmax_rows_kernel(std::int64_t rows, int cols, const T* x, std::int32_t* out) {
  using A = acc_t<T>;
  __shared__ A best_val[32];
  __shared__ int best_idx[32];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = x + r * cols;
    A v = -INFINITY;
    int idx = cols;
    for (int c = static_cast<int>(threadIdx.x); c < cols; c += static_cast<int>(blockDim.x))
      argmax_combine(v, idx, ld(row[c]), c);
    argmax_warp(v, idx);
    __syncthreads();  // the previous row's reads of best_* are done
    if (lane == 0) {
      best_val[warp] = v;
      best_idx[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
      const bool has = lane < (blockDim.x >> 5);
      v = has ? best_val[lane] : A(-INFINITY);
      idx = has ? best_idx[lane] : cols;
      argmax_warp(v, idx);
      if (lane == 0) out[r] = idx == cols ? 0 : idx;  // a row of NaN gives 0, as on the CPU
    }
  }
}

}  // namespace detail

/// Sum of n elements, accumulated in double; waits for the current stream.
template <class T>
double sum(std::int64_t n, const T* x) {
  return detail::sum_impl<T, false>(n, x);
}

/// Sum of squares (for gradient norms), accumulated in double; waits for the current stream.
template <class T>
double sum_squares(std::int64_t n, const T* x) {
  return detail::sum_impl<T, true>(n, x);
}

/// out[r] = index of the largest element of row r of a [rows, cols] array (first on ties).
/// NaN elements are skipped (on the CPU a NaN in column 0 wins instead; rows with NaN differ there).
template <class T>
void argmax_rows(std::int64_t rows, std::int64_t cols, const T* x, std::int32_t* out) {
  detail::check_element_type<T>();
  if (rows <= 0 || cols <= 0) return;
  PTRAIN_CHECK(cols <= INT32_MAX, ShapeError, "[ptrain.cuda.argmax] ", cols,
               " columns do not fit the int32 indices argmax_rows returns");
  detail::argmax_rows_kernel<T><<<detail::grid_for_rows(rows), detail::block_for_cols(cols), 0, current_stream()>>>(
      rows, static_cast<int>(cols), x, out);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
