#pragma once
// Grouped-query flash attention on device arrays (float and bf16): causal, with
// optional document starts and a sliding window, the forward keeping each row's
// log-sum-exp instead of the [S, S] probabilities; its backward; and the KV-cache
// decode. Same names and arguments as kernels/cpu/gqa_attention.hpp's
// gqa_flash_forward, gqa_flash_backward and gqa_attention_decode.
//
// Note [GQA flash attention]
// Layout: query head h of token (b, i) is q[(b*S + i)*ldq + h*D ...], key/value
// head g of token (b, j) is k[(b*S + j)*ldkv + g*D ...] (v likewise); query head
// h reads key/value head h / (H / Hkv). The row strides let one kernel serve
// separate q [B, S, H, D], k, v [B, S, Hkv, D] (ldq = H*D, ldkv = Hkv*D) and
// GPT's packed qkv [B, S, 3C] (q = qkv, k = qkv + C, v = qkv + 2C, ldq = ldkv
// = 3C, H = Hkv). y, dy are [B, S, H*D]; dq has q's strides, dk and dv k's.
// Query i sees keys lo(i) .. i with lo(i) = max(starts[b, i], i - window + 1)
// (starts null: 0; window 0: no window): the mask of kernels/cpu/gqa_attention.hpp
// (Note [Sliding window]).
// One block of kRows warps owns kRows query rows of one (b, h), one warp per row;
// key and value tiles of 32 rows are staged in shared memory as float, lane j
// scores key j of the tile, and the output accumulates over the tile's keys
// (lane d owns columns d, d + 32, d + 64, d + 96: head widths up to 128).
// Arithmetic is float (Note [bf16 kernels]); the online softmax keeps a running
// max and sum per row, lse = max + log(sum).
//   backward  Dv_i = dy_i . y_i per row; a dq kernel (blocks as the forward)
//             recomputes P = exp(scale q k - lse) per key tile and accumulates
//             dq += dS k; a dk/dv kernel gives each warp one key row of one
//             key/value head and loops over that group's query heads in order,
//             then over the query tiles that can see the key, accumulating
//             dv += P^T dy and dk += dS^T q. No atomics: the same bits every run.
//   decode    the forward with a query offset: s queries at positions
//             n - s .. n - 1 against the n cached keys, window respected.
//   ring      the same kernels with any query offset q_off (query i at key
//             position q_off + i, keys past Skv - 1 clipped) and document starts
//             given in positions start_off ahead of the keys': context
//             parallelism's blocks (ring_attention.cuh, Note [CUDA ring attention blocks]).
// A straightforward kernel (no tensor cores): correctness and determinism first.

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/stream.hpp"

namespace ptrain::kernels::cuda {

namespace detail {
namespace gqa {

inline constexpr int kRows = 8;  // warps (query rows, or key rows in dk/dv) per block
inline constexpr int kThreads = 32 * kRows;
inline constexpr int kTile = 32;      // keys (or queries in dk/dv) per shared tile
inline constexpr int kMaxWidth = 128;  // four columns per lane

struct Args {
  std::int64_t B, Sq, Skv, q_off, H, Hkv, D, ldq, ldkv, window;
  const std::int32_t* starts;  // [B, Sq] or null
  float scale;
  std::int64_t start_off = 0;  // starts[...] - start_off is a key index
};

// Keys lo .. hi that query i (of row b) sees: pos = q_off + i is its position among the
// keys, hi = min(pos, Skv - 1); lo > hi when it sees none.
__device__ __forceinline__ void key_range(const Args& a, std::int64_t b, std::int64_t i, std::int64_t& lo,
                                          std::int64_t& hi) {
  const std::int64_t pos = a.q_off + i;
  hi = pos < a.Skv - 1 ? pos : a.Skv - 1;
  lo = 0;
  if (a.starts) {
    lo = a.starts[b * a.Sq + i] - a.start_off;
    lo = lo > pos ? pos : lo;
  }
  lo = lo < 0 ? 0 : lo;  // (pos < 0: lo = 0 > hi, no key)
  if (a.window > 0 && pos - a.window + 1 > lo) lo = pos - a.window + 1;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Rows r0 .. r0 + 31 (r < rows; others zero) of one head (D columns, row stride ld) into a
// float [32][L] tile.
template <class T>
__device__ void load_rows(float* dst, int L, const T* src, std::int64_t r0, std::int64_t rows, std::int64_t ld,
                          int D) {
  for (int idx = threadIdx.x; idx < kTile * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D;
    dst[r * L + d] = r0 + r < rows ? static_cast<float>(src[(r0 + r) * ld + d]) : 0.0f;
  }
}

// The key range every row of the block sees, into kb (min lo) and ke (max hi); rows
// of the block past Sq do not count. lo_s, hi_s: kRows shared slots each.
__device__ __forceinline__ void block_key_range(const Args& a, std::int64_t b, std::int64_t i0, std::int64_t* lo_s,
                                                std::int64_t* hi_s, std::int64_t& kb, std::int64_t& ke) {
  if (threadIdx.x < kRows) {
    std::int64_t lo = LLONG_MAX, hi = -1;
    if (i0 + threadIdx.x < a.Sq) key_range(a, b, i0 + threadIdx.x, lo, hi);
    lo_s[threadIdx.x] = lo;
    hi_s[threadIdx.x] = hi;
  }
  __syncthreads();
  kb = LLONG_MAX;
  ke = -1;
  for (int r = 0; r < kRows; ++r) {
    kb = lo_s[r] < kb ? lo_s[r] : kb;
    ke = hi_s[r] > ke ? hi_s[r] : ke;
  }
  if (ke < 0) kb = 0;
}

// grid (B*H, query tiles of kRows). y [B, Sq, H*D]; lse [B, H, Sq] or null.
template <class T>
__global__ void __launch_bounds__(kThreads) forward_kernel(Args a, const T* q, const T* k, const T* v, T* y,
                                                           float* lse) {
  extern __shared__ float smem[];
  __shared__ std::int64_t lo_s[kRows], hi_s[kRows];
  const int D = static_cast<int>(a.D), LK = D + 1;
  float* Ks = smem;            // [32][D + 1]: lane j reads row j
  float* Vs = Ks + kTile * LK;  // [32][D]
  float* Qs = Vs + kTile * D;   // [kRows][D], scaled
  const std::int64_t bh = blockIdx.x, b = bh / a.H, h = bh % a.H, g = h / (a.H / a.Hkv);
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t i = i0 + warp;
  const bool valid = i < a.Sq;
  std::int64_t lo = 1, hi = 0;
  if (valid) key_range(a, b, i, lo, hi);
  for (int d = lane; d < D; d += 32)
    Qs[warp * D + d] = valid ? static_cast<float>(q[(b * a.Sq + i) * a.ldq + h * D + d]) * a.scale : 0.0f;
  std::int64_t kb, ke;
  block_key_range(a, b, i0, lo_s, hi_s, kb, ke);  // (its __syncthreads also publishes Qs)
  const T* kh = k + b * a.Skv * a.ldkv + g * D;
  const T* vh = v + b * a.Skv * a.ldkv + g * D;
  float m = -INFINITY, l = 0.0f, o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (std::int64_t k0 = kb; k0 <= ke; k0 += kTile) {
    __syncthreads();  // every warp is done with the previous tile
    load_rows(Ks, LK, kh, k0, ke + 1, a.ldkv, D);
    load_rows(Vs, D, vh, k0, ke + 1, a.ldkv, D);
    __syncthreads();
    const std::int64_t j = k0 + lane;
    float s = -INFINITY;
    if (valid && j >= lo && j <= hi) {
      float dot = 0.0f;
      for (int d = 0; d < D; ++d) dot += Qs[warp * D + d] * Ks[lane * LK + d];
      s = dot;
    }
    const float tmax = warp_max(s);
    if (tmax == -INFINITY) continue;  // no key of this tile for this row (uniform in the warp)
    const float m_new = fmaxf(m, tmax);
    const float alpha = expf(m - m_new);  // 0 while m is -inf
    const float p = expf(s - m_new);      // 0 where masked
    l = l * alpha + warp_sum(p);
#pragma unroll
    for (int c = 0; c < 4; ++c) o[c] *= alpha;
    const int n = static_cast<int>(ke - k0 + 1 < kTile ? ke - k0 + 1 : kTile);
    for (int jj = 0; jj < n; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (lane + 32 * c < D) o[c] += pj * Vs[jj * D + lane + 32 * c];
    }
    m = m_new;
  }
  if (!valid) return;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  T* yr = y + (b * a.Sq + i) * a.H * D + h * D;
#pragma unroll
  for (int c = 0; c < 4; ++c)
    if (lane + 32 * c < D) yr[lane + 32 * c] = T(o[c] * inv);
  if (lse && lane == 0) lse[bh * a.Sq + i] = m + logf(l);
}

// Dv[(b*H + h)*S + i] = dy . y over head h's D columns of token (b, i); one warp per row.
template <class T>
__global__ void rowdot_kernel(std::int64_t rows, std::int64_t S, std::int64_t H, std::int64_t D, const T* dy,
                              const T* y, float* out) {
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  for (std::int64_t row = warp; row < rows; row += static_cast<std::int64_t>(gridDim.x) * blockDim.x / 32) {
    const std::int64_t bh = row / S, i = row % S, b = bh / H, h = bh % H;
    const std::int64_t at = (b * S + i) * H * D + h * D;
    float s = 0.0f;
    for (std::int64_t d = lane; d < D; d += 32) s += static_cast<float>(dy[at + d]) * static_cast<float>(y[at + d]);
    s = warp_sum(s);
    if (lane == 0) out[row] = s;
  }
}

// grid (B*H, query tiles of kRows): dq (q's strides), as the forward's blocks.
template <class T>
__global__ void __launch_bounds__(kThreads) dq_kernel(Args a, const T* q, const T* k, const T* v, const float* lse,
                                                      const float* Dv, const T* dy, T* dq) {
  extern __shared__ float smem[];
  __shared__ std::int64_t lo_s[kRows], hi_s[kRows];
  const int D = static_cast<int>(a.D), LK = D + 1;
  float* Ks = smem;              // [32][D + 1]
  float* Vs = Ks + kTile * LK;   // [32][D + 1]
  float* Qs = Vs + kTile * LK;   // [kRows][D], scaled
  float* dYs = Qs + kRows * D;   // [kRows][D]
  const std::int64_t bh = blockIdx.x, b = bh / a.H, h = bh % a.H, g = h / (a.H / a.Hkv), S = a.Sq;
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t i = i0 + warp;
  const bool valid = i < S;
  std::int64_t lo = 1, hi = 0;
  if (valid) key_range(a, b, i, lo, hi);
  for (int d = lane; d < D; d += 32) {
    Qs[warp * D + d] = valid ? static_cast<float>(q[(b * S + i) * a.ldq + h * D + d]) * a.scale : 0.0f;
    dYs[warp * D + d] = valid ? static_cast<float>(dy[(b * S + i) * a.H * D + h * D + d]) : 0.0f;
  }
  const float lse_i = valid ? lse[bh * S + i] : 0.0f, D_i = valid ? Dv[bh * S + i] : 0.0f;
  std::int64_t kb, ke;
  block_key_range(a, b, i0, lo_s, hi_s, kb, ke);
  const T* kh = k + b * a.Skv * a.ldkv + g * D;
  const T* vh = v + b * a.Skv * a.ldkv + g * D;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (std::int64_t k0 = kb; k0 <= ke; k0 += kTile) {
    __syncthreads();
    load_rows(Ks, LK, kh, k0, ke + 1, a.ldkv, D);
    load_rows(Vs, LK, vh, k0, ke + 1, a.ldkv, D);
    __syncthreads();
    const std::int64_t j = k0 + lane;
    float ds = 0.0f;
    if (valid && j >= lo && j <= hi) {
      float s = 0.0f, dp = 0.0f;
      for (int d = 0; d < D; ++d) {
        s += Qs[warp * D + d] * Ks[lane * LK + d];
        dp += dYs[warp * D + d] * Vs[lane * LK + d];
      }
      ds = expf(s - lse_i) * (dp - D_i);
    }
    const int n = static_cast<int>(ke - k0 + 1 < kTile ? ke - k0 + 1 : kTile);
    for (int jj = 0; jj < n; ++jj) {
      const float dj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (lane + 32 * c < D) acc[c] += dj * Ks[jj * LK + lane + 32 * c];
    }
  }
  if (!valid) return;
  T* dqr = dq + (b * S + i) * a.ldq + h * D;
#pragma unroll
  for (int c = 0; c < 4; ++c)
    if (lane + 32 * c < D) dqr[lane + 32 * c] = T(acc[c] * a.scale);
}

// grid (B*Hkv, key tiles of kRows): warp w owns key j = j0 + w of key/value head g and
// writes its dk and dv rows (k's strides), summing the group's query heads in order.
template <class T>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(Args a, const T* q, const T* k, const T* v, const float* lse,
                                                        const float* Dv, const T* dy, T* dk, T* dv) {
  extern __shared__ float smem[];
  const int D = static_cast<int>(a.D), LK = D + 1;
  float* Qt = smem;               // [32][D + 1]: lane i reads query row i
  float* dYt = Qt + kTile * LK;   // [32][D + 1]
  float* Kr = dYt + kTile * LK;   // [kRows][D], scaled
  float* Vr = Kr + kRows * D;     // [kRows][D]
  float* lse_t = Vr + kRows * D;  // [32]
  float* D_t = lse_t + kTile;     // [32]
  const std::int64_t bg = blockIdx.x, b = bg / a.Hkv, g = bg % a.Hkv, group = a.H / a.Hkv, S = a.Sq;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.y) * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t j = j0 + warp;
  const bool valid = j < a.Skv;
  for (int d = lane; d < D; d += 32) {
    Kr[warp * D + d] = valid ? static_cast<float>(k[(b * a.Skv + j) * a.ldkv + g * D + d]) * a.scale : 0.0f;
    Vr[warp * D + d] = valid ? static_cast<float>(v[(b * a.Skv + j) * a.ldkv + g * D + d]) : 0.0f;
  }
  // Queries that can see keys j0 .. j0 + kRows - 1: q_off + i >= j0 (causal), q_off + i <
  // last key + window.
  const std::int64_t qs = j0 - a.q_off > 0 ? j0 - a.q_off : 0;
  const std::int64_t qe = a.window > 0 ? min(S, j0 + kRows - 1 + a.window - a.q_off) : S;
  float ak[4] = {0.0f, 0.0f, 0.0f, 0.0f}, av[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
    const std::int64_t bh = b * a.H + h;
    for (std::int64_t q0 = qs; q0 < qe; q0 += kTile) {
      __syncthreads();  // every warp is done with the previous tile (and Kr, Vr are written)
      load_rows(Qt, LK, q + b * S * a.ldq + h * D, q0, qe, a.ldq, D);
      load_rows(dYt, LK, dy + b * S * a.H * D + h * D, q0, qe, a.H * D, D);
      for (int c = threadIdx.x; c < kTile; c += blockDim.x) {
        lse_t[c] = q0 + c < qe ? lse[bh * S + q0 + c] : 0.0f;
        D_t[c] = q0 + c < qe ? Dv[bh * S + q0 + c] : 0.0f;
      }
      __syncthreads();
      const std::int64_t i = q0 + lane;
      float p = 0.0f, ds = 0.0f;
      if (valid && i < qe) {
        std::int64_t lo, hi;
        key_range(a, b, i, lo, hi);
        if (j >= lo && j <= hi) {
          float s = 0.0f, dp = 0.0f;
          for (int d = 0; d < D; ++d) {
            s += Qt[lane * LK + d] * Kr[warp * D + d];
            dp += dYt[lane * LK + d] * Vr[warp * D + d];
          }
          p = expf(s - lse_t[lane]);
          ds = p * (dp - D_t[lane]);
        }
      }
      const int n = static_cast<int>(qe - q0 < kTile ? qe - q0 : kTile);
      for (int ii = 0; ii < n; ++ii) {
        const float pi = __shfl_sync(0xffffffffu, p, ii), di = __shfl_sync(0xffffffffu, ds, ii);
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (lane + 32 * c < D) {
            av[c] += pi * dYt[ii * LK + lane + 32 * c];
            ak[c] += di * Qt[ii * LK + lane + 32 * c];
          }
      }
    }
  }
  if (!valid) return;
  T* dkr = dk + (b * a.Skv + j) * a.ldkv + g * D;
  T* dvr = dv + (b * a.Skv + j) * a.ldkv + g * D;
#pragma unroll
  for (int c = 0; c < 4; ++c)
    if (lane + 32 * c < D) {
      dkr[lane + 32 * c] = T(ak[c] * a.scale);
      dvr[lane + 32 * c] = T(av[c]);
    }
}

inline std::size_t forward_smem(std::int64_t D) { return static_cast<std::size_t>(kTile * (2 * D + 1) + kRows * D) * 4; }
inline std::size_t backward_smem(std::int64_t D) {
  return static_cast<std::size_t>(2 * kTile * (D + 1) + 2 * kRows * D + 2 * kTile) * 4;
}

template <class T>
void check_case(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>,
                "the CUDA grouped-query attention has float and bf16 kernels");
  PTRAIN_CHECK(D >= 2 && D <= kMaxWidth && D % 2 == 0, ShapeError, "[ptrain.cuda.gqa_attention] head width ", D,
               " is not supported on CUDA (even widths 2 .. 128); run the model on the CPU");
  PTRAIN_CHECK(Hkv > 0 && H % Hkv == 0, ShapeError, "[ptrain.cuda.gqa_attention] ", Hkv,
               " key/value heads do not divide ", H, " query heads");
  PTRAIN_CHECK(B * H <= INT_MAX && (S + kRows - 1) / kRows <= 65535, ShapeError, "[ptrain.cuda.gqa_attention] B*H = ",
               B * H, " and S = ", S, " exceed the launch limits (B*H <= 2^31 - 1, S <= ", 65535 * kRows,
               "); split the batch or the sequence");
}

template <class T>
void launch_forward(const Args& a, const T* q, const T* k, const T* v, T* y, float* lse) {
  const dim3 grid(static_cast<unsigned>(a.B * a.H), static_cast<unsigned>((a.Sq + kRows - 1) / kRows));
  forward_kernel<T><<<grid, kThreads, forward_smem(a.D), current_stream()>>>(a, q, k, v, y, lse);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

// dq (q's strides, every element of the H heads), dk and dv (k's strides, every element)
// from y, lse [B, H, Sq] and dy [B, Sq, H*D].
template <class T>
void launch_backward(const Args& a, const T* q, const T* k, const T* v, const T* y, const float* lse, const T* dy,
                     T* dq, T* dk, T* dv) {
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  const std::int64_t rows = a.B * a.H * a.Sq;
  auto dvec = Tensor<float>::empty({rows}, Device::cuda(device));
  rowdot_kernel<T><<<detail::grid_for(rows * 32), detail::kBlock, 0, stream>>>(rows, a.Sq, a.H, a.D, dy, y,
                                                                                dvec.data());
  PTRAIN_CHECK_CUDA_LAUNCH();
  dq_kernel<T><<<dim3(static_cast<unsigned>(a.B * a.H), static_cast<unsigned>((a.Sq + kRows - 1) / kRows)), kThreads,
                 backward_smem(a.D), stream>>>(a, q, k, v, lse, dvec.data(), dy, dq);
  PTRAIN_CHECK_CUDA_LAUNCH();
  dkdv_kernel<T><<<dim3(static_cast<unsigned>(a.B * a.Hkv), static_cast<unsigned>((a.Skv + kRows - 1) / kRows)),
                   kThreads, backward_smem(a.D), stream>>>(a, q, k, v, lse, dvec.data(), dy, dk, dv);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace gqa
}  // namespace detail

/// Forward (Note [GQA flash attention]): y [B, S, H*D] and lse [B, H, S] (float) from
/// q (row stride ldq) and k, v (row stride ldkv); starts int32 [B, S] or null; window 0:
/// none. Runs on the current stream.
template <class T>
void gqa_flash_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                       std::int64_t ldq, const T* k, const T* v, std::int64_t ldkv, const std::int32_t* starts,
                       std::int64_t window, acc_t<T> scale, T* y, acc_t<T>* lse) {
  detail::gqa::check_case<T>(B, S, H, Hkv, D);
  if (B <= 0 || S <= 0 || H <= 0) return;
  const detail::gqa::Args a{B, S, S, 0, H, Hkv, D, ldq, ldkv, window, starts, static_cast<float>(scale)};
  detail::gqa::launch_forward(a, q, k, v, y, lse);
}

/// Backward: dq (q's strides), dk and dv (k's strides; every element, a key/value head
/// summing its query heads) from the forward's inputs, y, lse and dy [B, S, H*D].
template <class T>
void gqa_flash_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                        std::int64_t ldq, const T* k, const T* v, std::int64_t ldkv, const std::int32_t* starts,
                        std::int64_t window, const T* y, const acc_t<T>* lse, const T* dy, acc_t<T> scale, T* dq,
                        T* dk, T* dv) {
  detail::gqa::check_case<T>(B, S, H, Hkv, D);
  if (B <= 0 || S <= 0 || H <= 0) return;
  const detail::gqa::Args a{B, S, S, 0, H, Hkv, D, ldq, ldkv, window, starts, static_cast<float>(scale)};
  detail::gqa::launch_backward(a, q, k, v, y, lse, dy, dq, dk, dv);
}

/// KV-cache decode: y [s, H*D] for s queries q [s, H*D] at positions n - s .. n - 1
/// against n keys and values k, v [n, Hkv*D] (one sequence; query i sees keys
/// max(0, n - s + i - window + 1) .. n - s + i, window 0: all before it).
template <class T>
void gqa_attention_decode(std::int64_t s, std::int64_t n, std::int64_t H, std::int64_t Hkv, std::int64_t D,
                          const T* q, const T* k, const T* v, std::int64_t window, double scale, T* y) {
  detail::gqa::check_case<T>(1, s, H, Hkv, D);
  PTRAIN_CHECK(s <= n, ShapeError, "[ptrain.cuda.gqa_attention] ", s, " queries after ", n, " keys; the keys must "
               "include the queries' own");
  if (s <= 0 || H <= 0) return;
  const detail::gqa::Args a{1, s, n, n - s, H, Hkv, D, H * D, Hkv * D, window, nullptr, static_cast<float>(scale)};
  detail::gqa::launch_forward(a, q, k, v, y, static_cast<float*>(nullptr));
}

}  // namespace ptrain::kernels::cuda
