#pragma once
// Fused causal attention for bf16 (flash-style): the [S, S] scores and
// probabilities never leave the chip; the forward pass keeps only the output
// and each row's log-sum-exp.
//
// Note [Flash attention]
// Same layout and arguments as causal_attention_forward/backward (attention.cuh):
// packed qkv [B, S, 3C], y [B, S, C], dropout keep decisions from
// random_uniform(seed, offset + ((b*H + h)*S + i)*S + j) >= p, so masks equal
// the CPU's and the materialised path's. Tiles of 64 queries x 64 keys; a block
// of 4 warps owns one (b, h) and one tile of 64 rows, each warp 16 of them.
// Products run on tensor cores through WMMA (16x16x16 bf16, fp32 accumulation);
// scores, probabilities and running sums stay in shared memory in fp32, and the
// probabilities are rounded to bf16 only to enter the next product.
//   forward   for each key tile up to the diagonal: S = Q K^T, the online
//             softmax (running max m and sum l per row, the partial output
//             rescaled by exp(m_old - m_new)), O += dropout(P) V; at the end
//             y = O / l and lse = m + log l (float [B, H, S]).
//   backward  D_i = dy_i . y_i per row (which equals sum_j P_ij dP_ij, dropout
//             included); one kernel per key tile accumulates dV += Pd^T dy and
//             dK += dS^T Q over the query tiles at or below the diagonal, and
//             one per query tile accumulates dQ += dS K over the key tiles up to
//             it, recomputing P = exp(scale q k - lse) both times. No atomics:
//             gradients are the same bits on every run.
// Limits: bf16 only, head width D of 32, 64 or 128, a GPU of compute
// capability 8.0 or newer (bf16 WMMA) whose per-block shared memory holds the
// kernels' tiles (up to 178 KiB at D = 128: sm_90 takes every width, sm_80
// D <= 64, sm_86/89 D = 32), qkv on a 16-byte boundary
// (flash_attention_supported); other cases take the materialised path, and so
// does everything after set_flash_attention(false).

#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.cuh"
#include "ptrain/kernels/cuda/device.cuh"

namespace ptrain::kernels::cuda {

namespace detail {
namespace flash {

namespace wmma = nvcuda::wmma;

inline constexpr int kTile = 64;      // queries and keys per tile
inline constexpr int kWarps = 4;      // 16 rows each
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kStripLd = kTile + 4;  // float [16][kTile] strips (WMMA: ld multiple of 4)
inline constexpr int kPLd = kTile + 8;      // bf16 [16][kTile] strips (ld multiple of 8)

template <int D>
struct Dims {
  static constexpr int kLd = D + 8;    // bf16 [64][D] tiles
  static constexpr int kAccLd = D + 4;  // float [rows][D] accumulators
};

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

__device__ __forceinline__ const __nv_bfloat16* as_nv(const bf16* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }

// Rows [row0, row0 + 64) of one head's D columns (row stride `stride` elements)
// into a [64][D + 8] shared tile; rows at or past S read as zeros.
template <int D>
__device__ void load_tile(bf16* dst, const bf16* src, std::int64_t row0, std::int64_t S, std::int64_t stride) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int c = threadIdx.x; c < kTile * kChunks; c += kThreads) {
    const int r = c / kChunks, k = (c % kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + r < S) v = *reinterpret_cast<const uint4*>(src + (row0 + r) * stride + k);
    *reinterpret_cast<uint4*>(dst + r * Dims<D>::kLd + k) = v;
  }
}

// out[16][64] (float, ld kStripLd) = a[16 rows][D] . b^T, b being [64][D] (both bf16, ld D + 8).
template <int D>
__device__ void strip_abt(float* out, const bf16* a, const bf16* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 WMMA needs sm_80; flash_attention_supported refuses older GPUs
#else
  for (int n = 0; n < kTile / 16; ++n) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k = 0; k < D / 16; ++k) {
      FragA fa;
      FragBT fb;
      wmma::load_matrix_sync(fa, as_nv(a + k * 16), Dims<D>::kLd);
      wmma::load_matrix_sync(fb, as_nv(b + n * 16 * Dims<D>::kLd + k * 16), Dims<D>::kLd);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + n * 16, acc, kStripLd, wmma::mem_row_major);
  }
#endif
}

// acc[16][D] (float, ld D + 4) += p[16][64] (bf16, ld kPLd) . b[64][D] (bf16, ld D + 8).
template <int D>
__device__ void strip_acc_pb(float* acc, const bf16* p, const bf16* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  for (int n = 0; n < D / 16; ++n) {
    FragC c;
    wmma::load_matrix_sync(c, acc + n * 16, Dims<D>::kAccLd, wmma::mem_row_major);
    for (int k = 0; k < kTile / 16; ++k) {
      FragA fa;
      FragB fb;
      wmma::load_matrix_sync(fa, as_nv(p + k * 16), kPLd);
      wmma::load_matrix_sync(fb, as_nv(b + k * 16 * Dims<D>::kLd + n * 16), Dims<D>::kLd);
      wmma::mma_sync(c, fa, fb, c);
    }
    wmma::store_matrix_sync(acc + n * 16, c, Dims<D>::kAccLd, wmma::mem_row_major);
  }
#endif
}

// 1 / (1 - p): the factor of a kept element (1 without dropout).
__device__ __forceinline__ float keep_scale_of(double p) { return p > 0 ? static_cast<float>(1.0 / (1.0 - p)) : 1.0f; }

__device__ __forceinline__ bool keep(double p, std::uint64_t seed, std::uint64_t offset, std::int64_t bh,
                                     std::int64_t S, std::int64_t i, std::int64_t j) {
  return p == 0 || random_uniform(seed, offset + static_cast<std::uint64_t>((bh * S + i) * S + j)) >= p;
}

template <int D>
constexpr std::size_t forward_smem() {
  return 3 * kTile * Dims<D>::kLd * sizeof(bf16) + kWarps * 16 * kStripLd * sizeof(float) +
         kWarps * 16 * kPLd * sizeof(bf16) + kWarps * 16 * Dims<D>::kAccLd * sizeof(float);
}

// grid (B*H, query tiles): the heads go on x, whose limit is 2^31 - 1, as y and
// z stop at 65535. kThreads threads. In a warp, lane l looks after row
// l / 2 of the warp's 16, columns (l % 2) * 32 ... + 32 of each strip.
template <int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(std::int64_t S, std::int64_t H, const bf16* qkv,
                                                           float scale, double p, std::uint64_t seed,
                                                           std::uint64_t offset, bf16* y, float* lse) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int L = Dims<D>::kLd;
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Ks = Qs + kTile * L;
  bf16* Vs = Ks + kTile * L;
  float* Ss = reinterpret_cast<float*>(Vs + kTile * L);
  bf16* Ps = reinterpret_cast<bf16*>(Ss + kWarps * 16 * kStripLd);
  float* Os = reinterpret_cast<float*>(Ps + kWarps * 16 * kPLd);

  const std::int64_t bh = blockIdx.x, b = bh / H, h = bh % H, C = H * D, ld = 3 * C;
  const std::int64_t q0 = static_cast<std::int64_t>(blockIdx.y) * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 2, half = lane % 2;
  const bf16* base = qkv + b * S * ld;
  float* Sw = Ss + warp * 16 * kStripLd;
  bf16* Pw = Ps + warp * 16 * kPLd;
  float* Ow = Os + warp * 16 * Dims<D>::kAccLd;
  const std::int64_t i = q0 + warp * 16 + r;  // this lane's query row
  const float keep_scale = keep_scale_of(p);

  load_tile<D>(Qs, base + h * D, q0, S, ld);
  for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) Ow[r * Dims<D>::kAccLd + d] = 0.0f;
  float m = -INFINITY, l = 0.0f;

  const std::int64_t last = (q0 + kTile < S ? q0 + kTile : S) - 1;
  for (std::int64_t k0 = 0; k0 <= last; k0 += kTile) {
    __syncthreads();  // every warp is done with the previous K and V
    load_tile<D>(Ks, base + C + h * D, k0, S, ld);
    load_tile<D>(Vs, base + 2 * C + h * D, k0, S, ld);
    __syncthreads();
    strip_abt<D>(Sw, Qs + warp * 16 * L, Ks);
    __syncwarp();
    float mx = -INFINITY;
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const std::int64_t j = k0 + c;
      if (j <= i && i < S) mx = fmaxf(mx, Sw[r * kStripLd + c] * scale);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = fmaxf(m, mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet (or past S)
    const float alpha = expf(m - m_use);
    float rs = 0.0f;
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const std::int64_t j = k0 + c;
      float e = 0.0f;
      if (j <= i && i < S) e = expf(Sw[r * kStripLd + c] * scale - m_use);
      rs += e;
      const float kept = e != 0.0f && keep(p, seed, offset, bh, S, i, j) ? e * keep_scale : 0.0f;
      Pw[r * kPLd + c] = bf16(kept);
    }
    rs += __shfl_xor_sync(0xffffffffu, rs, 1);
    l = l * alpha + rs;
    m = m_new;
    for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) Ow[r * Dims<D>::kAccLd + d] *= alpha;
    __syncwarp();
    strip_acc_pb<D>(Ow, Pw, Vs);
    __syncwarp();
  }
  if (i < S) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    bf16* yr = y + (b * S + i) * C + h * D;
    for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) yr[d] = bf16(Ow[r * Dims<D>::kAccLd + d] * inv);
    if (half == 0) lse[bh * S + i] = m + logf(l);
  }
}

// Dv[bh * S + i] = dy_i . y_i over the head's D columns; one warp per row.
// (A template so that the header defines it once per program.)
template <class T>
__global__ void rowdot_kernel(std::int64_t rows, std::int64_t S, std::int64_t H, std::int64_t D, const T* dy,
                              const T* y, float* out) {
  const std::int64_t C = H * D;
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  for (std::int64_t row = warp; row < rows; row += static_cast<std::int64_t>(gridDim.x) * blockDim.x / 32) {
    const std::int64_t bh = row / S, i = row % S, b = bh / H, h = bh % H;
    const std::int64_t at = (b * S + i) * C + h * D;
    float s = 0.0f;
    for (std::int64_t d = lane; d < D; d += 32) s += static_cast<float>(dy[at + d]) * static_cast<float>(y[at + d]);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) out[row] = s;
  }
}

// The backward kernels: four bf16 tiles, lse and D of 64 rows, two float strips
// and a bf16 strip per warp, and `accumulators` float [64][D] tiles (dK and dV, or dQ).
template <int D>
constexpr std::size_t backward_smem(int accumulators) {
  return 4 * kTile * Dims<D>::kLd * sizeof(bf16) + 2 * kTile * sizeof(float) +
         2 * kWarps * 16 * kStripLd * sizeof(float) + kWarps * 16 * kPLd * sizeof(bf16) +
         accumulators * kTile * Dims<D>::kAccLd * sizeof(float);
}

// lse and D (dy . y) of query rows [q0, q0 + 64) into shared memory; 0 past S.
__device__ __forceinline__ void load_row_stats(float* lse_s, float* D_s, const float* lse, const float* Dv,
                                               std::int64_t bh, std::int64_t q0, std::int64_t S) {
  for (int c = threadIdx.x; c < kTile; c += kThreads) {
    lse_s[c] = q0 + c < S ? lse[bh * S + q0 + c] : 0.0f;
    D_s[c] = q0 + c < S ? Dv[bh * S + q0 + c] : 0.0f;
  }
}

// grid (B*H, key tiles). Warp w owns keys k0 + 16 w ... + 16; strips are
// transposed here: row = key, column = query.
template <int D>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(std::int64_t S, std::int64_t H, const bf16* qkv,
                                                        const bf16* dy, const float* lse, const float* Dv,
                                                        float scale, double p, std::uint64_t seed,
                                                        std::uint64_t offset, bf16* dqkv) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int L = Dims<D>::kLd, A = Dims<D>::kAccLd;
  bf16* Ks = reinterpret_cast<bf16*>(smem);
  bf16* Vs = Ks + kTile * L;
  bf16* Qs = Vs + kTile * L;
  bf16* dYs = Qs + kTile * L;
  float* lse_s = reinterpret_cast<float*>(dYs + kTile * L);
  float* D_s = lse_s + kTile;
  float* Ss = D_s + kTile;                    // scores, then dP (per warp [16][64])
  float* Pf = Ss + kWarps * 16 * kStripLd;    // undropped probabilities
  bf16* Ps = reinterpret_cast<bf16*>(Pf + kWarps * 16 * kStripLd);  // Pd, then dS
  float* dKs = reinterpret_cast<float*>(Ps + kWarps * 16 * kPLd);
  float* dVs = dKs + kTile * A;

  const std::int64_t bh = blockIdx.x, b = bh / H, h = bh % H, C = H * D, ld = 3 * C;
  const std::int64_t k0 = static_cast<std::int64_t>(blockIdx.y) * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 2, half = lane % 2;
  const bf16* base = qkv + b * S * ld;
  float* Sw = Ss + warp * 16 * kStripLd;
  float* Pfw = Pf + warp * 16 * kStripLd;
  bf16* Pw = Ps + warp * 16 * kPLd;
  const std::int64_t j = k0 + warp * 16 + r;  // this lane's key row
  const float keep_scale = keep_scale_of(p);

  load_tile<D>(Ks, base + C + h * D, k0, S, ld);
  load_tile<D>(Vs, base + 2 * C + h * D, k0, S, ld);
  for (int e = threadIdx.x; e < kTile * A; e += kThreads) dKs[e] = dVs[e] = 0.0f;

  for (std::int64_t q0 = k0; q0 < S; q0 += kTile) {
    __syncthreads();  // every warp is done with the previous query tile
    load_tile<D>(Qs, base + h * D, q0, S, ld);
    load_tile<D>(dYs, dy + b * S * C + h * D, q0, S, C);
    load_row_stats(lse_s, D_s, lse, Dv, bh, q0, S);
    __syncthreads();
    strip_abt<D>(Sw, Ks + warp * 16 * L, Qs);  // [key][query] = k . q
    __syncwarp();
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const std::int64_t i = q0 + c;
      const bool valid = j <= i && i < S && j < S;
      const float pr = valid ? expf(Sw[r * kStripLd + c] * scale - lse_s[c]) : 0.0f;
      Pfw[r * kStripLd + c] = pr;
      Pw[r * kPLd + c] = bf16(valid && keep(p, seed, offset, bh, S, i, j) ? pr * keep_scale : 0.0f);
    }
    __syncwarp();
    strip_acc_pb<D>(dVs + warp * 16 * A, Pw, dYs);  // dV += Pd^T dy
    strip_abt<D>(Sw, Vs + warp * 16 * L, dYs);      // [key][query] = v . dy = dPd^T
    __syncwarp();
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const std::int64_t i = q0 + c;
      const bool valid = j <= i && i < S && j < S;
      const float dp = valid && keep(p, seed, offset, bh, S, i, j) ? Sw[r * kStripLd + c] * keep_scale : 0.0f;
      Pw[r * kPLd + c] = bf16(valid ? Pfw[r * kStripLd + c] * (dp - D_s[c]) : 0.0f);  // dS^T
    }
    __syncwarp();
    strip_acc_pb<D>(dKs + warp * 16 * A, Pw, Qs);  // dK += dS^T q (scaled at the end)
  }
  __syncwarp();
  if (j < S) {
    bf16* dk = dqkv + (b * S + j) * ld + C + h * D;
    bf16* dv = dk + C;
    for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) {
      dk[d] = bf16(dKs[(warp * 16 + r) * A + d] * scale);
      dv[d] = bf16(dVs[(warp * 16 + r) * A + d]);
    }
  }
}

// grid (B*H, query tiles). Warp w owns queries q0 + 16 w ... + 16.
template <int D>
__global__ void __launch_bounds__(kThreads) dq_kernel(std::int64_t S, std::int64_t H, const bf16* qkv,
                                                      const bf16* dy, const float* lse, const float* Dv, float scale,
                                                      double p, std::uint64_t seed, std::uint64_t offset,
                                                      bf16* dqkv) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int L = Dims<D>::kLd, A = Dims<D>::kAccLd;
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* dYs = Qs + kTile * L;
  bf16* Ks = dYs + kTile * L;
  bf16* Vs = Ks + kTile * L;
  float* lse_s = reinterpret_cast<float*>(Vs + kTile * L);
  float* D_s = lse_s + kTile;
  float* Ss = D_s + kTile;                   // scores
  float* dPs = Ss + kWarps * 16 * kStripLd;  // dPd
  bf16* Ps = reinterpret_cast<bf16*>(dPs + kWarps * 16 * kStripLd);  // dS
  float* dQs = reinterpret_cast<float*>(Ps + kWarps * 16 * kPLd);

  const std::int64_t bh = blockIdx.x, b = bh / H, h = bh % H, C = H * D, ld = 3 * C;
  const std::int64_t q0 = static_cast<std::int64_t>(blockIdx.y) * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 2, half = lane % 2;
  const bf16* base = qkv + b * S * ld;
  float* Sw = Ss + warp * 16 * kStripLd;
  float* dPw = dPs + warp * 16 * kStripLd;
  bf16* Pw = Ps + warp * 16 * kPLd;
  const std::int64_t i = q0 + warp * 16 + r;  // this lane's query row
  const float keep_scale = keep_scale_of(p);

  load_tile<D>(Qs, base + h * D, q0, S, ld);
  load_tile<D>(dYs, dy + b * S * C + h * D, q0, S, C);
  load_row_stats(lse_s, D_s, lse, Dv, bh, q0, S);
  for (int e = threadIdx.x; e < kTile * A; e += kThreads) dQs[e] = 0.0f;

  const std::int64_t last = (q0 + kTile < S ? q0 + kTile : S) - 1;
  for (std::int64_t k0 = 0; k0 <= last; k0 += kTile) {
    __syncthreads();
    load_tile<D>(Ks, base + C + h * D, k0, S, ld);
    load_tile<D>(Vs, base + 2 * C + h * D, k0, S, ld);
    __syncthreads();
    strip_abt<D>(Sw, Qs + warp * 16 * L, Ks);    // q . k
    strip_abt<D>(dPw, dYs + warp * 16 * L, Vs);  // dy . v = dPd
    __syncwarp();
    const float lse_i = lse_s[warp * 16 + r], D_i = D_s[warp * 16 + r];
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const std::int64_t j = k0 + c;
      const bool valid = j <= i && i < S;
      float ds = 0.0f;
      if (valid) {
        const float pr = expf(Sw[r * kStripLd + c] * scale - lse_i);
        const float dp = keep(p, seed, offset, bh, S, i, j) ? dPw[r * kStripLd + c] * keep_scale : 0.0f;
        ds = pr * (dp - D_i);
      }
      Pw[r * kPLd + c] = bf16(ds);
    }
    __syncwarp();
    strip_acc_pb<D>(dQs + warp * 16 * A, Pw, Ks);  // dQ += dS k (scaled at the end)
  }
  __syncwarp();
  if (i < S) {
    bf16* dq = dqkv + (b * S + i) * ld + h * D;
    for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) dq[d] = bf16(dQs[(warp * 16 + r) * A + d] * scale);
  }
}

template <int D>
void forward(std::int64_t B, std::int64_t S, std::int64_t H, const bf16* qkv, float scale, double p,
             std::uint64_t seed, std::uint64_t offset, bf16* y, float* lse) {
  const dim3 grid(static_cast<unsigned>(B * H), static_cast<unsigned>((S + kTile - 1) / kTile));
  forward_kernel<D><<<grid, kThreads, forward_smem<D>(), current_stream()>>>(S, H, qkv, scale, p, seed, offset, y,
                                                                            lse);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <int D>
void backward(std::int64_t B, std::int64_t S, std::int64_t H, const bf16* qkv, const bf16* y, const float* lse,
              double p, std::uint64_t seed, std::uint64_t offset, const bf16* dy, float scale, bf16* dqkv) {
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  const std::int64_t rows = B * H * S;
  // load_tile reads dy in 16-byte chunks, and unlike qkv nothing has checked
  // its alignment (a view may start anywhere): such a dy is read through a copy.
  Tensor<bf16> dy_copy;
  if (reinterpret_cast<std::uintptr_t>(dy) % 16 != 0) {
    dy_copy = Tensor<bf16>::empty({B * S * H * D}, Device::cuda(device));
    PTRAIN_CHECK_CUDA(cudaMemcpyAsync(dy_copy.data(), dy, static_cast<std::size_t>(B * S * H * D) * sizeof(bf16),
                                      cudaMemcpyDeviceToDevice, stream));
    dy = dy_copy.data();
  }
  auto dv = Tensor<float>::empty({rows}, Device::cuda(device));
  rowdot_kernel<bf16><<<grid_for(rows * 32), kBlock, 0, stream>>>(rows, S, H, D, dy, y, dv.data());
  PTRAIN_CHECK_CUDA_LAUNCH();
  const dim3 grid(static_cast<unsigned>(B * H), static_cast<unsigned>((S + kTile - 1) / kTile));
  dkdv_kernel<D><<<grid, kThreads, backward_smem<D>(2), stream>>>(S, H, qkv, dy, lse, dv.data(), scale, p, seed, offset,
                                                             dqkv);
  PTRAIN_CHECK_CUDA_LAUNCH();
  dq_kernel<D><<<grid, kThreads, backward_smem<D>(1), stream>>>(S, H, qkv, dy, lse, dv.data(), scale, p, seed, offset, dqkv);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

inline std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> on{true};
  return on;
}

// Whether `device` can run the three kernels for head width D, decided once per
// device; flash_attention_forward/backward ask it before every launch. It needs compute capability 8.0 or newer, code compiled for sm_80 or
// newer (PTX for an older target, JIT-compiled for a newer GPU, would reach the
// __trap in strip_abt), and a per-block shared memory limit that holds the
// largest request: 227 KiB on sm_90, but 163 KiB on sm_80 (too small for D =
// 128's backward) and 99 KiB on sm_86/89 (too small for D = 64's backward and
// D = 128). Where it can, it raises each kernel's dynamic shared memory limit,
// a per-device setting, to what its launch asks for.
template <int D>
bool ready(int device) {
  static std::array<std::atomic<int>, kMaxDevices> state{};  // 0 not yet known, 1 ready, 2 not supported
  PTRAIN_CHECK(device >= 0 && device < kMaxDevices, CudaError, "[ptrain.cuda.device] device index ", device,
               " is out of range [0, ", kMaxDevices, ")");
  auto& s = state[static_cast<std::size_t>(device)];
  if (const int v = s.load(); v != 0) return v == 1;
  // A failed device query is an error (e.g. one left by an earlier kernel), not an answer to cache.
  int major = 0, optin = 0;
  PTRAIN_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  PTRAIN_CHECK_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr{};
  bool ok = cudaFuncGetAttributes(&attr, forward_kernel<D>) == cudaSuccess;
  if (!ok) (void)cudaGetLastError();  // no usable image here: an answer (not supported), not an error
  const std::size_t need = std::max(forward_smem<D>(), std::max(backward_smem<D>(2), backward_smem<D>(1)));
  ok = ok && major >= 8 && !(attr.ptxVersion > 0 && attr.ptxVersion < 80) && static_cast<std::size_t>(optin) >= need;
  if (ok) {
    const auto allow = [](auto kernel, std::size_t bytes) {
      PTRAIN_CHECK_CUDA(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    };
    allow(forward_kernel<D>, forward_smem<D>());
    allow(dkdv_kernel<D>, backward_smem<D>(2));
    allow(dq_kernel<D>, backward_smem<D>(1));
  }
  s.store(ok ? 1 : 2);
  return ok;
}

// The grids are (B*H, tiles of 64 rows): x holds up to 2^31 - 1, y 65535.
inline void check_grid(std::int64_t B, std::int64_t S, std::int64_t H) {
  PTRAIN_CHECK(B * H <= INT_MAX && (S + kTile - 1) / kTile <= 65535, ShapeError, "[ptrain.cuda.flash] B*H = ", B * H,
               " and S = ", S, " exceed the launch limits (B*H <= 2^31 - 1, S <= ", 65535 * kTile, ")");
}

}  // namespace flash
}  // namespace detail

/// Lets ops:: use the fused attention where it applies (default on); off, every
/// case takes the materialised path (for comparisons, or to rule it out).
inline void set_flash_attention(bool enabled) { detail::flash::enabled_flag().store(enabled); }
inline bool flash_attention_enabled() { return detail::flash::enabled_flag().load(); }

/// Whether flash_attention_forward/backward can run this case: bf16, head width D
/// of 32, 64 or 128, qkv on a 16-byte boundary, a GPU of compute capability 8.0
/// or newer with the shared memory the kernels need for D (and code built for
/// sm_80 or newer).
template <class T>
bool flash_attention_capable(std::int64_t D, const T* qkv) {
  if (!(std::is_same_v<T, bf16> && (D == 32 || D == 64 || D == 128) && reinterpret_cast<std::uintptr_t>(qkv) % 16 == 0))
    return false;
  const int device = current_device();
  return D == 32 ? detail::flash::ready<32>(device)
                 : D == 64 ? detail::flash::ready<64>(device) : detail::flash::ready<128>(device);
}

/// Whether ops:: take the fused path for a forward: enabled (set_flash_attention)
/// and capable. Otherwise they use causal_attention_*. A forward that took it keeps
/// a backward that can (the backward asks only flash_attention_capable).
template <class T>
bool flash_attention_supported(std::int64_t D, const T* qkv) {
  return flash_attention_enabled() && flash_attention_capable(D, qkv);
}

/// Forward (Note [Flash attention]): y [B, S, C] and lse [B, H, S] (float) from qkv
/// [B, S, 3C], with dropout p on the probabilities. Runs on the current stream.
template <class T>
void flash_attention_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D, const T* qkv,
                             acc_t<T> scale, double p, std::uint64_t seed, std::uint64_t offset, T* y,
                             acc_t<T>* lse) {
  PTRAIN_CHECK(flash_attention_capable<T>(D, qkv), Error, "[ptrain.cuda.flash] unsupported case (bf16 with head "
               "width 32, 64 or 128, qkv 16-byte aligned, compute capability 8.0+; got width ", D,
               "); use causal_attention_forward");
  if constexpr (std::is_same_v<T, bf16>) {
    if (B <= 0 || S <= 0 || H <= 0) return;
    detail::flash::check_grid(B, S, H);
    if (D == 32) detail::flash::forward<32>(B, S, H, qkv, scale, p, seed, offset, y, lse);
    else if (D == 64) detail::flash::forward<64>(B, S, H, qkv, scale, p, seed, offset, y, lse);
    else detail::flash::forward<128>(B, S, H, qkv, scale, p, seed, offset, y, lse);
  }
}

/// Backward: dqkv [B, S, 3C] (every element) from the forward's qkv, y and lse and dy [B, S, C].
template <class T>
void flash_attention_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D, const T* qkv,
                              const T* y, const acc_t<T>* lse, double p, std::uint64_t seed,
                              std::uint64_t offset, const T* dy, acc_t<T> scale, T* dqkv) {
  PTRAIN_CHECK(flash_attention_capable<T>(D, qkv), Error, "[ptrain.cuda.flash] unsupported case (bf16 with head "
               "width 32, 64 or 128, qkv 16-byte aligned, compute capability 8.0+; got width ", D,
               "); use causal_attention_backward");
  if constexpr (std::is_same_v<T, bf16>) {
    if (B <= 0 || S <= 0 || H <= 0) return;
    detail::flash::check_grid(B, S, H);
    if (D == 32) detail::flash::backward<32>(B, S, H, qkv, y, lse, p, seed, offset, dy, scale, dqkv);
    else if (D == 64) detail::flash::backward<64>(B, S, H, qkv, y, lse, p, seed, offset, dy, scale, dqkv);
    else detail::flash::backward<128>(B, S, H, qkv, y, lse, p, seed, offset, dy, scale, dqkv);
  }
}

}  // namespace ptrain::kernels::cuda
