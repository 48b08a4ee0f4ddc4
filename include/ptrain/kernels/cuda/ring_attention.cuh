#pragma once
// Blocks of ring attention (context parallelism, parallel/context_parallel.hpp) on
// device arrays: ring_attention_block_forward and _backward (float and bf16) and
// copy_strided_rows (every element type), with the names and arguments of
// kernels/cpu/ring_attention.hpp (Note [Ring attention blocks]).
//
// Note [CUDA ring attention blocks]
// A block is grouped-query flash attention whose queries stand q0 - k0 positions after
// its keys, with the queries' document starts k0 ahead of the keys' indices:
// gqa_attention.cuh's kernels take both offsets (Note [GQA flash attention], "ring").
//   forward   the gqa forward writes the block's own output y_b and log-sum-exp l
//             into scratch; merge_kernel (one warp per row and head) folds them into
//             the running y and lse, L = logaddexp(lse, l), y = exp(lse - L) y +
//             exp(l - L) y_b, lse = L. A row that sees no key of the block (l = -inf)
//             keeps its y and lse; a row that has seen none before (lse = -inf) takes
//             y_b and l without reading y.
//   backward  the gqa backward on the final y and lse (lse copied from stride ld_lse
//             into [H, n]) writes the block's dq, dk and dv into scratch of the same
//             strides; add_rows_kernel adds them to dq, dk and dv. No atomics: the
//             same bits every run.
// y and dy of the backward have contiguous heads (ldy = H*D), as the gqa kernels read
// them. bf16: y_b and the block's gradients are rounded to bf16 once before the merge
// or the add (the CPU kernel keeps them in float until then).

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/gqa_attention.cuh"
#include "ptrain/kernels/cuda/stream.hpp"

namespace ptrain::kernels::cuda {

namespace detail {
namespace ring {

// y[i, h] (row stride ldy) and lse[h * ld_lse + i] merged with the block's y_b [n, H*D]
// and l [H, n]; one warp per (h, i).
template <class T>
__global__ void merge_kernel(std::int64_t n, std::int64_t H, std::int64_t D, const T* yb, const float* lb, T* y,
                             std::int64_t ldy, float* lse, std::int64_t ld_lse) {
  const int lane = threadIdx.x % 32;
  for (std::int64_t row = global_index() / 32; row < n * H; row += grid_stride() / 32) {
    const std::int64_t h = row / n, i = row % n;
    const float l = lb[h * n + i];
    if (l == -INFINITY) continue;  // no key of the block for this row (uniform in the warp)
    const float run = lse[h * ld_lse + i];
    const bool first = run == -INFINITY;
    const float L = first ? l : fmaxf(run, l) + log1pf(expf(-fabsf(run - l)));
    const float a = first ? 0.0f : expf(run - L), b = first ? 1.0f : expf(l - L);
    T* yr = y + i * ldy + h * D;
    const T* br = yb + i * H * D + h * D;
    for (std::int64_t d = lane; d < D; d += 32)
      yr[d] = T((first ? 0.0f : a * static_cast<float>(yr[d])) + b * static_cast<float>(br[d]));
    __syncwarp();  // every lane has read the old lse
    if (lane == 0) lse[h * ld_lse + i] = L;
  }
}

// dst[r * ld + c] += src[r * ld + c] for `rows` rows of `width` elements.
template <class T>
__global__ void add_rows_kernel(std::int64_t rows, std::int64_t width, const T* src, std::int64_t ld, T* dst) {
  for (std::int64_t idx = global_index(); idx < rows * width; idx += grid_stride()) {
    const std::int64_t at = (idx / width) * ld + idx % width;
    dst[at] = T(static_cast<float>(dst[at]) + static_cast<float>(src[at]));
  }
}

template <class T>
void add_rows(std::int64_t rows, std::int64_t width, const T* src, std::int64_t ld, T* dst, cudaStream_t stream) {
  add_rows_kernel<T><<<grid_for(rows * width), kBlock, 0, stream>>>(rows, width, src, ld, dst);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

// The gqa kernels' arguments for a block: n queries at q0 .., n keys at k0 ...
template <class T>
gqa::Args block_args(std::int64_t n, std::int64_t H, std::int64_t Hkv, std::int64_t D, std::int64_t ldq,
                     std::int64_t q0, const std::int32_t* starts, std::int64_t ldkv, std::int64_t k0,
                     std::int64_t window, float scale) {
  gqa::check_case<T>(1, n, H, Hkv, D);
  return gqa::Args{1, n, n, q0 - k0, H, Hkv, D, ldq, ldkv, window, starts, scale, k0};
}

}  // namespace ring
}  // namespace detail

/// Merges the attention of n queries (positions q0 ..) against n keys (positions k0 ..)
/// into y and lse (Note [CUDA ring attention blocks]); runs on the current stream.
template <class T>
void ring_attention_block_forward(std::int64_t n, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                                  std::int64_t ldq, std::int64_t q0, const std::int32_t* starts, const T* k,
                                  const T* v, std::int64_t ldkv, std::int64_t k0, std::int64_t window,
                                  acc_t<T> scale, T* y, std::int64_t ldy, acc_t<T>* lse, std::int64_t ld_lse) {
  using namespace detail::ring;
  const auto a = block_args<T>(n, H, Hkv, D, ldq, q0, starts, ldkv, k0, window, static_cast<float>(scale));
  if (n <= 0 || H <= 0) return;
  const int device = current_device();
  auto yb = Tensor<T>::empty({n * H * D}, Device::cuda(device));
  auto lb = Tensor<float>::empty({H * n}, Device::cuda(device));
  detail::gqa::launch_forward(a, q, k, v, yb.data(), lb.data());
  merge_kernel<T><<<detail::grid_for(n * H * 32), detail::kBlock, 0, current_stream(device)>>>(
      n, H, D, yb.data(), lb.data(), y, ldy, lse, ld_lse);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// Adds the block's gradients to dq, dk and dv from the final y and lse of the rows
/// (Note [CUDA ring attention blocks]); ldy must be H*D.
template <class T>
void ring_attention_block_backward(std::int64_t n, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                                   std::int64_t ldq, std::int64_t q0, const std::int32_t* starts, const T* k,
                                   const T* v, std::int64_t ldkv, std::int64_t k0, std::int64_t window,
                                   acc_t<T> scale, const T* y, std::int64_t ldy, const acc_t<T>* lse,
                                   std::int64_t ld_lse, const T* dy, T* dq, T* dk, T* dv) {
  using namespace detail::ring;
  const auto a = block_args<T>(n, H, Hkv, D, ldq, q0, starts, ldkv, k0, window, static_cast<float>(scale));
  PTRAIN_CHECK(ldy == H * D, ShapeError, "[ptrain.cuda.ring_attention] the CUDA ring attention backward takes y and "
               "dy with contiguous heads (row stride H*D = ", H * D, "), got row stride ", ldy, "; pass contiguous "
               "[n, H, D] tensors");
  if (n <= 0 || H <= 0) return;
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  auto lc = Tensor<float>::empty({H * n}, Device::cuda(device));
  PTRAIN_CHECK_CUDA(cudaMemcpy2DAsync(lc.data(), n * sizeof(float), lse, ld_lse * sizeof(float), n * sizeof(float),
                                      H, cudaMemcpyDeviceToDevice, stream));
  auto gq = Tensor<T>::empty({n * ldq}, Device::cuda(device));
  auto gk = Tensor<T>::empty({n * ldkv}, Device::cuda(device)), gv = Tensor<T>::empty({n * ldkv}, Device::cuda(device));
  detail::gqa::launch_backward(a, q, k, v, y, lc.data(), dy, gq.data(), gk.data(), gv.data());
  add_rows(n, H * D, gq.data(), ldq, dq, stream);
  add_rows(n, Hkv * D, gk.data(), ldkv, dk, stream);
  add_rows(n, Hkv * D, gv.data(), ldkv, dv, stream);
}

/// dst[r * ld_dst + i] = src[r * ld_src + i] for `rows` rows of `width` elements (one
/// strided copy on the current stream).
template <class T>
void copy_strided_rows(std::int64_t rows, std::int64_t width, const T* src, std::int64_t ld_src, T* dst,
                       std::int64_t ld_dst) {
  if (rows <= 0 || width <= 0) return;
  PTRAIN_CHECK_CUDA(cudaMemcpy2DAsync(dst, ld_dst * sizeof(T), src, ld_src * sizeof(T), width * sizeof(T), rows,
                                      cudaMemcpyDeviceToDevice, current_stream()));
}

}  // namespace ptrain::kernels::cuda
