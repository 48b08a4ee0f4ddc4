#pragma once
// Device-side helpers of the CUDA kernels: launch shapes, grid-stride indices,
// device math by element type, bf16 loads and stores (Note [bf16 kernels]).
// The host-side pieces live in plain headers that g++ compiles as well:
// check.hpp (error checks), stream.hpp (devices, streams, events; Note [Stream
// semantics]) and backend.hpp (the caching allocator and the cuda:N backend,
// which the CUDA translation unit of ptrain::cuda registers, src/cuda_register.cu).

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ptrain/core/dtype.hpp"
#include "ptrain/kernels/cuda/backend.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/stream.hpp"

namespace ptrain::kernels::cuda {

namespace detail {
/// Threads per block of the elementwise kernels (grid-stride loops).
inline constexpr int kBlock = 256;

/// Blocks for a grid-stride loop over n elements: enough to fill the GPU several
/// times over, capped so that each thread handles a few elements for large n.
inline unsigned grid_for(std::int64_t n, int block = kBlock) {
  const std::int64_t blocks = (n + block - 1) / block;
  return static_cast<unsigned>(blocks < 8192 ? (blocks < 1 ? 1 : blocks) : 8192);
}

/// Threads per block of a one-block-per-row kernel: a warp for short rows,
/// up to 512 threads (a few elements each) for long ones.
inline int block_for_cols(std::int64_t cols) {
  int b = 32;
  while (b < 512 && b < cols) b *= 2;
  return b;
}

/// Column sums (bias_grad, LayerNorm's dgamma/dbeta; detail::column_sums in
/// reduce.cuh): a block owns 32 adjacent columns, one per lane, so each warp
/// reads 32 consecutive elements of a row, and its 16 warps split the rows of
/// one chunk of at least kColChunkRows rows; chunks add up in a second pass.
inline constexpr int kColTile = 32;
inline constexpr int kColRows = 16;
inline constexpr std::int64_t kColChunkRows = 256;
inline constexpr std::int64_t kColTargetBlocks = 1024;

/// Blocks for a one-block-per-row kernel; kernels loop when rows exceed the grid.
inline unsigned grid_for_rows(std::int64_t rows) {
  return static_cast<unsigned>(rows < 65535 ? (rows < 1 ? 1 : rows) : 65535);
}

// Index of this thread in a 1-D grid, and the stride of a grid-stride loop;
// 64-bit so that arrays over 2^31 elements are covered.
__device__ __forceinline__ std::int64_t global_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_stride() { return static_cast<std::int64_t>(blockDim.x) * gridDim.x; }

// Device math by element type. The float forms are the accurate ones (expf,
// not __expf), so results stay within a few ulp of the CPU; do not build with
// --use_fast_math if the gpu tests' 1e-5 bounds matter to you.
__device__ __forceinline__ float dev_exp(float x) { return expf(x); }
__device__ __forceinline__ double dev_exp(double x) { return exp(x); }
__device__ __forceinline__ float dev_log(float x) { return logf(x); }
__device__ __forceinline__ double dev_log(double x) { return log(x); }
__device__ __forceinline__ float dev_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double dev_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float dev_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double dev_sqrt(double x) { return sqrt(x); }

template <class T>
inline constexpr bool is_float_or_double = std::is_same_v<T, float> || std::is_same_v<T, double>;

// Element types of the kernels: float and double, and bf16 as a storage type
// (Note [bf16 kernels]).
template <class T>
void check_element_type() {
  static_assert(is_float_or_double<T> || std::is_same_v<T, bf16>,
                "ptrain::kernels::cuda: element type must be float, double or bf16");
}
}  // namespace detail

// Note [bf16 kernels]
// A bf16 kernel reads bf16, computes in float and rounds once when it stores
// (to nearest even, as the CPU's bf16 does). Reductions (sums, means, the
// softmax denominator) accumulate in float. What a kernel keeps for backward
// beside its output (LayerNorm's mean and rstd, cross-entropy's log-sum-exp) is
// float, and so are scalars (eps, scale, dloss): acc_t<T> in the signatures,
// which is T itself for float and double.

using ::ptrain::acc_t;

namespace detail {
/// x converted to its arithmetic type (exact).
template <class T>
__device__ __forceinline__ acc_t<T> ld(T x) {
  return static_cast<acc_t<T>>(x);
}
/// v rounded to element type T (bf16: to nearest even; float, double: unchanged).
template <class T>
__device__ __forceinline__ T st(acc_t<T> v) {
  return T(v);
}
}  // namespace detail

}  // namespace ptrain::kernels::cuda
