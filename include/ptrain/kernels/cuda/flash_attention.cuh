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
// Products run on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulation)
// with operands fetched from shared memory by ldmatrix. Scores, probabilities
// and accumulators stay in registers: an accumulator of one product holds, in
// each thread, the same (row, column) pairs as the A operand of the next, so
// the probabilities (rounded to bf16) enter the next product without a trip
// through shared memory (FlashAttention-2's layout).
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
// The forward and dQ grids start with the last query tiles, which have the
// most key tiles to visit (dK/dV's first key tiles have the most queries).
// Limits: bf16 only, head width D of 32, 64 or 128, a GPU of compute
// capability 8.0 or newer (bf16 mma.sync) whose per-block shared memory holds
// the kernels' four tiles (69 KiB at D = 128), qkv on a 16-byte boundary
// (flash_attention_supported); other cases take the materialised path, and so
// does everything after set_flash_attention(false).

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"

namespace ptrain::kernels::cuda {

namespace detail {
namespace flash {

inline constexpr int kTile = 64;      // queries and keys per tile
inline constexpr int kWarps = 4;      // 16 rows each
inline constexpr int kThreads = 32 * kWarps;
inline constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

template <int D>
struct Dims {
  // bf16 [64][D + 8] tiles: rows 16 bytes apart modulo 128, so the eight rows
  // one ldmatrix phase reads fall in different banks.
  static constexpr int kLd = D + 8;
};

// The tensor-core primitives (PTX). Fragments of mma.m16n8k16 (g = lane / 4,
// t = lane % 4): A (16 x 16, row-major) a[0] = (g, 2t..2t+1), a[1] = (g + 8, 2t..),
// a[2] = (g, 2t + 8..), a[3] = (g + 8, 2t + 8..); B (16 x 8) b0 = (k 2t..2t+1, n g),
// b1 = (k 2t + 8.., n g); C (16 x 8, fp32) c[0..1] = (g, 2t..2t+1), c[2..3] = (g + 8, 2t..).
__device__ __forceinline__ unsigned smem_address(const bf16* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 bf16 matrices; lanes 8m ... 8m + 7 give the row addresses of matrix m.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const bf16* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 mma needs sm_80; flash_attention_supported refuses older GPUs
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const bf16* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
#endif
}

// c += a . b (16 x 16 by 16 x 8).
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats as bf16 in one register, the first in the low half (the lower column).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

// The A fragment of rows [0, 16), columns [k, k + 16) of a [..][D + 8] tile.
template <int D>
__device__ __forceinline__ void load_a(unsigned (&a)[4], const bf16* tile, int k) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, tile + (lane % 16) * Dims<D>::kLd + k + (lane / 16) * 8);
}

// acc[n][.] += a-rows (16 x D, the warp's rows of a tile, A fragments) . b^T over
// b's 64 rows (a [64][D + 8] tile): the 16 x 64 product in eight 16 x 8 blocks.
template <int D>
__device__ __forceinline__ void product_abt(float (&acc)[8][4], const unsigned (&a)[D / 16][4], const bf16* b) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < D / 16; ++k)
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      unsigned f[4];
      ldmatrix_x4(f, b + (16 * n + lane % 8 + (lane / 16) * 8) * Dims<D>::kLd + 16 * k + ((lane / 8) % 2) * 8);
      mma(acc[2 * n], a[k], f[0], f[1]);
      mma(acc[2 * n + 1], a[k], f[2], f[3]);
    }
}

// out[n][.] += p (16 x 64, the bf16 rounding of a product_abt accumulator) . b,
// b being a [64][D + 8] tile: the 16 x D product in D / 8 blocks.
template <int D>
__device__ __forceinline__ void product_pb(float (&out)[D / 8][4], const float (&p)[8][4], const bf16* b) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const unsigned a[4] = {pack_bf16(p[2 * k][0], p[2 * k][1]), pack_bf16(p[2 * k][2], p[2 * k][3]),
                           pack_bf16(p[2 * k + 1][0], p[2 * k + 1][1]), pack_bf16(p[2 * k + 1][2], p[2 * k + 1][3])};
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      unsigned f[4];
      ldmatrix_x4_trans(f, b + (16 * k + lane % 8 + ((lane / 8) % 2) * 8) * Dims<D>::kLd + 16 * n + (lane / 16) * 8);
      mma(out[2 * n], a, f[0], f[1]);
      mma(out[2 * n + 1], a, f[2], f[3]);
    }
  }
}

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

// 1 / (1 - p): the factor of a kept element (1 without dropout).
__device__ __forceinline__ float keep_scale_of(double p) { return p > 0 ? static_cast<float>(1.0 / (1.0 - p)) : 1.0f; }

__device__ __forceinline__ bool keep(double p, std::uint64_t seed, std::uint64_t offset, std::int64_t bh,
                                     std::int64_t S, std::int64_t i, std::int64_t j) {
  return p == 0 || random_uniform(seed, offset + static_cast<std::uint64_t>((bh * S + i) * S + j)) >= p;
}

// Zeroes the dropped elements of a 16 x 64 accumulator (only called when p > 0).
// Rows are rows[0] and rows[1], column (8 n + e % 2) counts from col0; with
// `transposed` the accumulator's rows are keys and its columns queries.
template <bool transposed>
__device__ __forceinline__ void drop(float (&a)[8][4], double p, std::uint64_t seed, std::uint64_t offset,
                                     std::int64_t bh, std::int64_t S, const std::int64_t (&rows)[2], std::int64_t col0) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const std::int64_t r = rows[e / 2], c = col0 + 8 * n + e % 2;
      if (a[n][e] != 0.0f && r < S && c < S && !(transposed ? keep(p, seed, offset, bh, S, c, r) : keep(p, seed, offset, bh, S, r, c)))
        a[n][e] = 0.0f;
    }
}

template <int D>
constexpr std::size_t forward_smem() {
  return 3 * kTile * Dims<D>::kLd * sizeof(bf16);
}

// grid (B*H, query tiles): the heads go on x, whose limit is 2^31 - 1, as y and
// z stop at 65535. kThreads threads. Lane (g, t) of warp w holds query rows
// q0 + 16 w + g and + 8 (r = 0, 1), key columns 8 n + 2t, 2t + 1 of S's eight blocks.
// Scores are kept in log2 units (scale * log2 e), for exp2f.
template <int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(std::int64_t S, std::int64_t H, const bf16* qkv,
                                                           float scale, double p, std::uint64_t seed,
                                                           std::uint64_t offset, bf16* y, float* lse) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int L = Dims<D>::kLd;
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Ks = Qs + kTile * L;
  bf16* Vs = Ks + kTile * L;

  const std::int64_t bh = blockIdx.x, b = bh / H, h = bh % H, C = H * D, ld = 3 * C;
  const std::int64_t q0 = static_cast<std::int64_t>(gridDim.y - 1 - blockIdx.y) * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const bf16* base = qkv + b * S * ld;
  const std::int64_t row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  const float keep_scale = keep_scale_of(p), sl2 = scale * kLog2e;

  load_tile<D>(Qs, base + h * D, q0, S, ld);
  __syncthreads();
  unsigned qa[D / 16][4];
#pragma unroll
  for (int k = 0; k < D / 16; ++k) load_a<D>(qa[k], Qs + warp * 16 * L, 16 * k);
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  const std::int64_t last = (q0 + kTile < S ? q0 + kTile : S) - 1;
  for (std::int64_t k0 = 0; k0 <= last; k0 += kTile) {
    __syncthreads();  // every warp is done with the previous K and V
    load_tile<D>(Ks, base + C + h * D, k0, S, ld);
    load_tile<D>(Vs, base + 2 * C + h * D, k0, S, ld);
    __syncthreads();
    float s[8][4] = {};
    product_abt<D>(s, qa, Ks);
    // Key column c of the tile counts for row r when c <= last_col[r] (causal; rows past S: none).
    int last_col[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) last_col[r] = row[r] < S ? static_cast<int>(min(row[r] - k0, std::int64_t{kTile})) : -1;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = 8 * n + 2 * t + e % 2 <= last_col[e / 2] ? s[n][e] * sl2 : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
      }
    float m_use[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m[r], mx[r]);
      m_use[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet (or past S)
      alpha[r] = exp2f(m[r] - m_use[r]);
      m[r] = m_new;
    }
    float rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pr = exp2f(s[n][e] - m_use[e / 2]);  // 0 where masked
        rs[e / 2] += pr;
        s[n][e] = pr * keep_scale;
      }
    if (p > 0) drop<false>(s, p, seed, offset, bh, S, row, k0 + 2 * t);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 1);
      rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 2);
      l[r] = l[r] * alpha[r] + rs[r];
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e / 2];
    product_pb<D>(o, s, Vs);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= S) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    bf16* yr = y + (b * S + row[r]) * C + h * D + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      yr[8 * n] = bf16(o[n][2 * r] * inv);
      yr[8 * n + 1] = bf16(o[n][2 * r + 1] * inv);
    }
    if (t == 0) lse[bh * S + row[r]] = m[r] * kLn2 + logf(l[r]);
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

// The backward kernels: four bf16 tiles, and lse and D of 64 rows.
template <int D>
constexpr std::size_t backward_smem() {
  return 4 * kTile * Dims<D>::kLd * sizeof(bf16) + 2 * kTile * sizeof(float);
}

// lse (in log2 units) and D (dy . y) of query rows [q0, q0 + 64) into shared memory; 0 past S.
__device__ __forceinline__ void load_row_stats(float* lse_s, float* D_s, const float* lse, const float* Dv,
                                               std::int64_t bh, std::int64_t q0, std::int64_t S) {
  for (int c = threadIdx.x; c < kTile; c += kThreads) {
    lse_s[c] = q0 + c < S ? lse[bh * S + q0 + c] * kLog2e : 0.0f;
    D_s[c] = q0 + c < S ? Dv[bh * S + q0 + c] : 0.0f;
  }
}

// grid (B*H, key tiles). Warp w owns keys k0 + 16 w ... + 16; the products are
// transposed here: row = key (lane (g, t): keys j[0] = ... + g and j[1] = + 8),
// column = query (8 n + 2t, 2t + 1).
template <int D>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(std::int64_t S, std::int64_t H, const bf16* qkv,
                                                        const bf16* dy, const float* lse, const float* Dv,
                                                        float scale, double p, std::uint64_t seed,
                                                        std::uint64_t offset, bf16* dqkv) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int L = Dims<D>::kLd;
  bf16* Ks = reinterpret_cast<bf16*>(smem);
  bf16* Vs = Ks + kTile * L;
  bf16* Qs = Vs + kTile * L;
  bf16* dYs = Qs + kTile * L;
  float* lse_s = reinterpret_cast<float*>(dYs + kTile * L);
  float* D_s = lse_s + kTile;

  const std::int64_t bh = blockIdx.x, b = bh / H, h = bh % H, C = H * D, ld = 3 * C;
  const std::int64_t k0 = static_cast<std::int64_t>(blockIdx.y) * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const bf16* base = qkv + b * S * ld;
  const std::int64_t key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  const float keep_scale = keep_scale_of(p), sl2 = scale * kLog2e;

  load_tile<D>(Ks, base + C + h * D, k0, S, ld);
  load_tile<D>(Vs, base + 2 * C + h * D, k0, S, ld);
  __syncthreads();
  unsigned ka[D / 16][4], va[D / 16][4];
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    load_a<D>(ka[k], Ks + warp * 16 * L, 16 * k);
    load_a<D>(va[k], Vs + warp * 16 * L, 16 * k);
  }
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};

  for (std::int64_t q0 = k0; q0 < S; q0 += kTile) {
    __syncthreads();  // every warp is done with the previous query tile
    load_tile<D>(Qs, base + h * D, q0, S, ld);
    load_tile<D>(dYs, dy + b * S * C + h * D, q0, S, C);
    load_row_stats(lse_s, D_s, lse, Dv, bh, q0, S);
    __syncthreads();
    // Query column c of the tile counts for key r when first_col[r] <= c < end_col (causal, both < S).
    const int end_col = static_cast<int>(min(S - q0, std::int64_t{kTile}));
    int first_col[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) first_col[r] = key[r] < S ? static_cast<int>(max(key[r] - q0, std::int64_t{0})) : kTile;
    float pr[8][4], s[8][4] = {};
    product_abt<D>(s, ka, Qs);  // [key][query] = k . q
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * n + 2 * t + e % 2;
        pr[n][e] = first_col[e / 2] <= c && c < end_col ? exp2f(s[n][e] * sl2 - lse_s[c]) : 0.0f;
        s[n][e] = pr[n][e] * keep_scale;  // Pd^T
      }
    if (p > 0) drop<true>(s, p, seed, offset, bh, S, key, q0 + 2 * t);
    product_pb<D>(dv, s, dYs);  // dV += Pd^T dy
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
    product_abt<D>(s, va, dYs);  // [key][query] = v . dy = dPd^T
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] *= keep_scale;
    if (p > 0) drop<true>(s, p, seed, offset, bh, S, key, q0 + 2 * t);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) pr[n][e] *= s[n][e] - D_s[8 * n + 2 * t + e % 2];  // dS^T (0 where P is)
    product_pb<D>(dk, pr, Qs);  // dK += dS^T q (scaled at the end)
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= S) continue;
    bf16* dkr = dqkv + (b * S + key[r]) * ld + C + h * D + 2 * t;
    bf16* dvr = dkr + C;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        dkr[8 * n + e] = bf16(dk[n][2 * r + e] * scale);
        dvr[8 * n + e] = bf16(dv[n][2 * r + e]);
      }
  }
}

// grid (B*H, query tiles), the last first. Warp w owns queries q0 + 16 w ... + 16
// (lane (g, t): rows + g and + 8), columns = keys as in the forward.
template <int D>
__global__ void __launch_bounds__(kThreads) dq_kernel(std::int64_t S, std::int64_t H, const bf16* qkv,
                                                      const bf16* dy, const float* lse, const float* Dv, float scale,
                                                      double p, std::uint64_t seed, std::uint64_t offset,
                                                      bf16* dqkv) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int L = Dims<D>::kLd;
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* dYs = Qs + kTile * L;
  bf16* Ks = dYs + kTile * L;
  bf16* Vs = Ks + kTile * L;

  const std::int64_t bh = blockIdx.x, b = bh / H, h = bh % H, C = H * D, ld = 3 * C;
  const std::int64_t q0 = static_cast<std::int64_t>(gridDim.y - 1 - blockIdx.y) * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const bf16* base = qkv + b * S * ld;
  const std::int64_t row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  const float keep_scale = keep_scale_of(p), sl2 = scale * kLog2e;
  float lse2[2], D_i[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lse2[r] = row[r] < S ? lse[bh * S + row[r]] * kLog2e : 0.0f;
    D_i[r] = row[r] < S ? Dv[bh * S + row[r]] : 0.0f;
  }

  load_tile<D>(Qs, base + h * D, q0, S, ld);
  load_tile<D>(dYs, dy + b * S * C + h * D, q0, S, C);
  __syncthreads();
  unsigned qa[D / 16][4], ya[D / 16][4];
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    load_a<D>(qa[k], Qs + warp * 16 * L, 16 * k);
    load_a<D>(ya[k], dYs + warp * 16 * L, 16 * k);
  }
  float dq[D / 8][4] = {};

  const std::int64_t last = (q0 + kTile < S ? q0 + kTile : S) - 1;
  for (std::int64_t k0 = 0; k0 <= last; k0 += kTile) {
    __syncthreads();
    load_tile<D>(Ks, base + C + h * D, k0, S, ld);
    load_tile<D>(Vs, base + 2 * C + h * D, k0, S, ld);
    __syncthreads();
    float s[8][4] = {}, dp[8][4] = {};
    product_abt<D>(s, qa, Ks);   // q . k
    product_abt<D>(dp, ya, Vs);  // dy . v = dPd
    int last_col[2];  // as in the forward
#pragma unroll
    for (int r = 0; r < 2; ++r) last_col[r] = row[r] < S ? static_cast<int>(min(row[r] - k0, std::int64_t{kTile})) : -1;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[n][e] *= keep_scale;
    if (p > 0) drop<false>(dp, p, seed, offset, bh, S, row, k0 + 2 * t);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[n][e] = 8 * n + 2 * t + e % 2 <= last_col[e / 2]
                      ? exp2f(s[n][e] * sl2 - lse2[e / 2]) * (dp[n][e] - D_i[e / 2])
                      : 0.0f;
    product_pb<D>(dq, s, Ks);  // dQ += dS k (scaled at the end)
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= S) continue;
    bf16* dqr = dqkv + (b * S + row[r]) * ld + h * D + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      dqr[8 * n] = bf16(dq[n][2 * r] * scale);
      dqr[8 * n + 1] = bf16(dq[n][2 * r + 1] * scale);
    }
  }
}

// Note [Shared memory limits at the launch]: a kernel's dynamic shared memory
// limit is raised by the function that launches it, never by another one. nvcc
// 13 gives each translation unit its own host stub for a template kernel
// (-static-global-template-stub), and the linker keeps one copy of each inline
// function: a limit raised in `ready` could land on cuda_register.cu's
// forward_kernel<128> while the launch, kept from the program's own .cu file,
// starts that file's copy, which still has the 48 KiB default (D = 128 needs
// 51 KiB: cudaErrorInvalidValue at the launch). Taking the kernel's address in
// the launching function's own body keeps the two in one translation unit.
template <class Kernel>
void raise_smem_limit(Kernel kernel, std::size_t bytes, int device, std::array<std::atomic<bool>, kMaxDevices>& done) {
  auto& d = done[static_cast<std::size_t>(device)];
  if (bytes <= 48 * 1024 || d.load()) return;
  PTRAIN_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  d.store(true);
}

template <int D>
void forward(std::int64_t B, std::int64_t S, std::int64_t H, const bf16* qkv, float scale, double p,
             std::uint64_t seed, std::uint64_t offset, bf16* y, float* lse) {
  static std::array<std::atomic<bool>, kMaxDevices> raised{};
  raise_smem_limit(forward_kernel<D>, forward_smem<D>(), current_device(), raised);
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
  static std::array<std::atomic<bool>, kMaxDevices> raised_dkdv{}, raised_dq{};
  raise_smem_limit(dkdv_kernel<D>, backward_smem<D>(), device, raised_dkdv);
  raise_smem_limit(dq_kernel<D>, backward_smem<D>(), device, raised_dq);
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
  dkdv_kernel<D><<<grid, kThreads, backward_smem<D>(), stream>>>(S, H, qkv, dy, lse, dv.data(), scale, p, seed, offset,
                                                             dqkv);
  PTRAIN_CHECK_CUDA_LAUNCH();
  dq_kernel<D><<<grid, kThreads, backward_smem<D>(), stream>>>(S, H, qkv, dy, lse, dv.data(), scale, p, seed, offset, dqkv);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

inline std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> on{true};
  return on;
}

// Whether `device` can run the three kernels for head width D, decided once per
// device; flash_attention_forward/backward ask it before every launch. It needs
// compute capability 8.0 or newer, code compiled for sm_80 or newer (PTX for an
// older target, JIT-compiled for a newer GPU, would reach the __trap in the mma
// helpers), and a per-block shared memory limit that holds the largest request
// (69 KiB at D = 128; every GPU of compute capability 8.0 or newer has 99 KiB or
// more). The launches raise each kernel's dynamic shared memory limit, a
// per-device setting (Note [Shared memory limits at the launch]).
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
  const std::size_t need = std::max(forward_smem<D>(), backward_smem<D>());
  ok = ok && major >= 8 && !(attr.ptxVersion > 0 && attr.ptxVersion < 80) && static_cast<std::size_t>(optin) >= need;
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
