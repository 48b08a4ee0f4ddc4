#pragma once
// bf16 flash attention for sm_80 and newer, tuned for Hopper's mma.sync path:
// grouped-query layout by row strides, causal or not, forward and backward.
//
// Note [Tensor-core flash attention]
// Layout and contract of gqa_flash_forward/backward (Note [GQA flash attention])
// without document starts and sliding window: query head h of token (b, i) is
// q[(b*S + i)*ldq + h*D ...], key/value head g = h / (H / Hkv) of token j is
// k[(b*S + j)*ldkv + g*D ...] (v likewise); y, dy [B, S, H*D]; dq has q's strides,
// dk and dv k's, so GPT's packed qkv [B, S, 3C] is q = qkv, k = qkv + C,
// v = qkv + 2C with ldq = ldkv = 3C. lse [B, H, S] is each row's natural
// log-sum-exp of the scaled scores, so either family's backward serves either
// forward. Head width D of 64 or 128; causal (query i sees keys 0 .. i) or not.
// FlashAttention-2's structure:
//   forward   a block of 8 warps owns 128 query rows of one (b, h), each warp 16
//             (the m16 of mma.m16n8k16); its Q fragments stay in registers.
//             Key/value tiles of 64 rows go to shared memory by cp.async, double
//             buffered: tile j + 1 is in flight while tile j is computed. S = Q K^T
//             and O += P V on tensor cores (ldmatrix, mma.sync m16n8k16, bf16 in,
//             fp32 accumulation), the scores' accumulator reused as the A operand
//             of P V (flash_attention.cuh's layout, whose primitives this file
//             shares); online softmax in fp32 registers with exp2 and the scale
//             folded with log2 e. Causal: tiles past a warp's last row are skipped
//             (the warp idles at the barriers), and only tiles that cross a warp's
//             diagonal or the sequence end are masked. The grid starts with the
//             query blocks that have the most key tiles.
//   backward  D_i = dy_i . y_i per row (gqa_attention.cuh's rowdot); a dk/dv
//             kernel gives a block of 8 warps 128 keys of one (b, g), each warp 16
//             (the products transposed: rows keys, columns queries), keeps K and V
//             in shared memory and loops over the group's query heads in order
//             and, per head, over the 64-row query tiles that see the keys
//             (causal: from the block's first key), Q, dY, lse and D double
//             buffered by cp.async, accumulating dV += P^T dY and dK += dS^T Q in
//             registers; a dq kernel (blocks as the forward, Q and dY in shared
//             memory, K and V tiles double buffered) accumulates dQ += dS K. No
//             atomics: every gradient element is summed by one thread in a fixed
//             order, the same bits on every run. The price is two recomputed
//             products (dq recomputes Q K^T and dY V^T): 7 tile products where
//             FlashAttention-2's atomic dQ needs 5.
// Shared memory per block (bytes; tiles [rows][D + 8] bf16, rows 16 bytes apart
// modulo 128 so an ldmatrix phase hits eight banks): forward (128 + 4 x 64) rows =
// 55,296 at D = 64 and 104,448 at D = 128; dq (2 x 128 + 4 x 64) rows = 73,728 and
// 139,264; dk/dv (2 x 128 + 4 x 64) rows + 1 KiB of lse and D = 74,752 and
// 140,288. ptxas (nvcc 13, sm_90, -Xptxas -v), registers per thread, no spill
// stores or loads and no stack frame in any of the six:
//   forward   D = 64: 128 (launch bounds ask two blocks, 16 warps, per SM),
//             D = 128: 226 (one block, 8 warps)
//   dq        D = 64: 189, D = 128: 231 (one block)
//   dk/dv     D = 64: 221, D = 128: 252 (one block)
// (dq at two blocks per SM spilled 200 bytes at D = 64, and at D = 128 fully
// unrolled A-fragment loads spilled 40; product_abt_smem unrolls its k loop by 2.)
// Limits: bf16 only; D 64 or 128; no dropout, document starts or window (those
// stay with flash_attention.cuh and gqa_attention.cuh); q, k, v, dy on 16-byte
// boundaries with row strides a multiple of 8 elements, y, dq, dk, dv on 4-byte
// boundaries; a GPU of compute capability 8.0+ whose per-block shared memory
// holds the largest block (137 KiB at D = 128: sm_80, sm_90; not sm_86/sm_89's
// 99 KiB). Anything else: the entry points return false, having done nothing,
// and the caller takes another kernel.

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/flash_attention.cuh"
#include "ptrain/kernels/cuda/gqa_attention.cuh"
#include "ptrain/kernels/cuda/stream.hpp"

namespace ptrain::kernels::cuda {

namespace detail {
namespace flash_tc {

using flash::kLn2;
using flash::kLog2e;

inline constexpr int kBlockRows = 128;  // query rows (forward, dq) or keys (dk/dv) per block
inline constexpr int kTile = 64;        // keys (forward, dq) or queries (dk/dv) per streamed tile
inline constexpr int kWarps = 8;        // 16 of the block's rows each
inline constexpr int kThreads = 32 * kWarps;

struct Args {
  std::int64_t S, H, Hkv, ldq, ldkv;
  float scale;
  bool causal;
};

// cp.async (sm_80): 16 bytes global -> shared, zero-filled when !valid (src then
// only needs to be a valid address; nothing is read).
__device__ __forceinline__ void cp_async16(bf16* dst, const bf16* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // ready() refuses GPUs older than sm_80
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(flash::smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(static_cast<unsigned>(
                   __cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 4 : 0)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Rows [row0, row0 + ROWS) of one head's D columns (row stride ld) into a
// [ROWS][D + 8] shared tile by cp.async; rows at or past S are zero-filled.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile_async(bf16* dst, const bf16* src, std::int64_t row0, std::int64_t S,
                                                std::int64_t ld) {
  constexpr int kChunks = D / 8, L = D + 8;
  static_assert(ROWS * kChunks % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < ROWS * kChunks / kThreads; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * kThreads, r = c / kChunks, col = (c % kChunks) * 8;
    const bool valid = row0 + r < S;
    cp_async16(dst + r * L + col, valid ? src + (row0 + r) * ld + col : src, valid);
  }
}

// acc[n][.] += a (16 x D: rows [0, 16) of the [..][D + 8] tile `a`) . b^T over b's 64
// rows: product_abt with the A fragments read from shared memory as they are needed.
template <int D>
__device__ __forceinline__ void product_abt_smem(float (&acc)[8][4], const bf16* a, const bf16* b) {
  const int lane = threadIdx.x % 32;
  constexpr int L = D + 8;
#pragma unroll 2
  for (int k = 0; k < D / 16; ++k) {
    unsigned af[4];
    flash::load_a<D>(af, a, 16 * k);
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      unsigned f[4];
      flash::ldmatrix_x4(f, b + (16 * n + lane % 8 + (lane / 16) * 8) * L + 16 * k + ((lane / 8) % 2) * 8);
      flash::mma(acc[2 * n], af, f[0], f[1]);
      flash::mma(acc[2 * n + 1], af, f[2], f[3]);
    }
  }
}

__device__ __forceinline__ void store_pair(bf16* dst, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
}

template <int D>
constexpr std::size_t forward_smem() {
  return static_cast<std::size_t>(kBlockRows + 4 * kTile) * (D + 8) * sizeof(bf16);
}
template <int D>
constexpr std::size_t dq_smem() {
  return static_cast<std::size_t>(2 * kBlockRows + 4 * kTile) * (D + 8) * sizeof(bf16);
}
template <int D>
constexpr std::size_t dkdv_smem() {
  return dq_smem<D>() + 4 * kTile * sizeof(float);
}
// Blocks per SM the launch bounds ask for: two at D = 64 (128 registers), one at D = 128.
template <int D>
constexpr int min_blocks() {
  return D == 64 ? 2 : 1;
}

// The 16 rows of warp w start at r0 = block start + 16 w; lane (g, t) holds rows
// r0 + g and r0 + g + 8 and columns 8 n + 2t, 2t + 1 of each 16 x 64 product.
// `last` is the last key a row sees: causal min(row, S - 1), otherwise S - 1.
__device__ __forceinline__ std::int64_t last_key(const Args& a, std::int64_t row) {
  return a.causal ? min(row, a.S - 1) : a.S - 1;
}

// grid (B*H, query blocks), kThreads threads; scores in log2 units (scale * log2 e).
template <int D>
__global__ void __launch_bounds__(kThreads, min_blocks<D>())
    forward_kernel(Args a, const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int L = D + 8;
  bf16* Qs = reinterpret_cast<bf16*>(smem);  // [128][L]
  bf16* Ks = Qs + kBlockRows * L;            // [2][64][L]
  bf16* Vs = Ks + 2 * kTile * L;             // [2][64][L]

  const std::int64_t S = a.S, bh = blockIdx.x, b = bh / a.H, h = bh % a.H, g = h / (a.H / a.Hkv);
  const std::int64_t blk = a.causal ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
  const std::int64_t q0 = blk * kBlockRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gr = lane / 4, t = lane % 4;
  const std::int64_t r0 = q0 + 16 * warp, row[2] = {r0 + gr, r0 + gr + 8};
  const bf16* qh = q + b * S * a.ldq + h * D;
  const bf16* kh = k + b * S * a.ldkv + g * D;
  const bf16* vh = v + b * S * a.ldkv + g * D;
  // Keys [0, kend) matter to the block; the warp's rows see keys up to wlast.
  const std::int64_t kend = a.causal ? min(q0 + kBlockRows, S) : S;
  const int tiles = static_cast<int>((kend + kTile - 1) / kTile);
  const std::int64_t wlast = last_key(a, r0 + 15);
  const bool active = r0 < S;
  const float sl2 = a.scale * kLog2e;

  load_tile_async<D, kBlockRows>(Qs, qh, q0, S, a.ldq);
  load_tile_async<D, kTile>(Ks, kh, 0, S, a.ldkv);
  load_tile_async<D, kTile>(Vs, vh, 0, S, a.ldkv);
  cp_async_commit();

  unsigned qa[D / 16][4];
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const std::int64_t last[2] = {last_key(a, row[0]), last_key(a, row[1])};

  for (int j = 0; j < tiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < tiles) {  // tile j + 1 into the other buffer, freed by the barrier ending iteration j - 1
      load_tile_async<D, kTile>(Ks + (buf ^ 1) * kTile * L, kh, std::int64_t{j + 1} * kTile, S, a.ldkv);
      load_tile_async<D, kTile>(Vs + (buf ^ 1) * kTile * L, vh, std::int64_t{j + 1} * kTile, S, a.ldkv);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile j (and at j = 0 the Q block) is in shared memory for every thread
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) flash::load_a<D>(qa[kk], Qs + warp * 16 * L, 16 * kk);
    }
    const std::int64_t k0 = std::int64_t{j} * kTile;
    if (active && k0 <= wlast) {  // uniform in the warp
      const bf16* Kt = Ks + buf * kTile * L;
      const bf16* Vt = Vs + buf * kTile * L;
      float s[8][4] = {};
      flash::product_abt<D>(s, qa, Kt);
      float mx[2] = {-INFINITY, -INFINITY};
      if (k0 + kTile - 1 > (a.causal ? r0 : S - 1)) {  // the tile crosses a row's last key: mask
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[n][e] = k0 + 8 * n + 2 * t + e % 2 <= last[e / 2] ? s[n][e] * sl2 : -INFINITY;
            mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
          }
      } else {
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[n][e] *= sl2;
            mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
          }
      }
      float m_use[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(m[r], mx[r]);
        m_use[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet
        alpha[r] = exp2f(m[r] - m_use[r]);
        m[r] = m_new;
      }
      float rs[2] = {0.0f, 0.0f};
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = exp2f(s[n][e] - m_use[e / 2]);  // 0 where masked
          rs[e / 2] += s[n][e];
        }
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
      flash::product_pb<D>(o, s, Vt);
    }
    __syncthreads();  // every warp is done with buffer `buf` before iteration j + 1 refills it
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= S) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    bf16* yr = y + (b * S + row[r]) * a.H * D + h * D + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) store_pair(yr + 8 * n, o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
    if (t == 0) lse[bh * S + row[r]] = m[r] * kLn2 + logf(l[r]);
  }
}

// grid (B*H, query blocks), as the forward: dq (q's strides) = scale * sum_j dS_ij k_j.
template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    dq_kernel(Args a, const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* Dv, const bf16* dy,
              bf16* dq) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int L = D + 8;
  bf16* Qs = reinterpret_cast<bf16*>(smem);  // [128][L]
  bf16* dYs = Qs + kBlockRows * L;           // [128][L]
  bf16* Ks = dYs + kBlockRows * L;           // [2][64][L]
  bf16* Vs = Ks + 2 * kTile * L;             // [2][64][L]

  const std::int64_t S = a.S, bh = blockIdx.x, b = bh / a.H, h = bh % a.H, g = h / (a.H / a.Hkv);
  const std::int64_t blk = a.causal ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
  const std::int64_t q0 = blk * kBlockRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gr = lane / 4, t = lane % 4;
  const std::int64_t r0 = q0 + 16 * warp, row[2] = {r0 + gr, r0 + gr + 8};
  const bf16* kh = k + b * S * a.ldkv + g * D;
  const bf16* vh = v + b * S * a.ldkv + g * D;
  const std::int64_t kend = a.causal ? min(q0 + kBlockRows, S) : S;
  const int tiles = static_cast<int>((kend + kTile - 1) / kTile);
  const std::int64_t wlast = last_key(a, r0 + 15);
  const bool active = r0 < S;
  const float sl2 = a.scale * kLog2e;
  const std::int64_t last[2] = {last_key(a, row[0]), last_key(a, row[1])};
  float lse2[2], D_i[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lse2[r] = row[r] < S ? lse[bh * S + row[r]] * kLog2e : 0.0f;
    D_i[r] = row[r] < S ? Dv[bh * S + row[r]] : 0.0f;
  }

  load_tile_async<D, kBlockRows>(Qs, q + b * S * a.ldq + h * D, q0, S, a.ldq);
  load_tile_async<D, kBlockRows>(dYs, dy + b * S * a.H * D + h * D, q0, S, a.H * D);
  load_tile_async<D, kTile>(Ks, kh, 0, S, a.ldkv);
  load_tile_async<D, kTile>(Vs, vh, 0, S, a.ldkv);
  cp_async_commit();
  float acc[D / 8][4] = {};

  for (int j = 0; j < tiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < tiles) {
      load_tile_async<D, kTile>(Ks + (buf ^ 1) * kTile * L, kh, std::int64_t{j + 1} * kTile, S, a.ldkv);
      load_tile_async<D, kTile>(Vs + (buf ^ 1) * kTile * L, vh, std::int64_t{j + 1} * kTile, S, a.ldkv);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const std::int64_t k0 = std::int64_t{j} * kTile;
    if (active && k0 <= wlast) {
      const bf16* Kt = Ks + buf * kTile * L;
      const bf16* Vt = Vs + buf * kTile * L;
      float s[8][4] = {}, dp[8][4] = {};
      product_abt_smem<D>(s, Qs + warp * 16 * L, Kt);    // q . k
      product_abt_smem<D>(dp, dYs + warp * 16 * L, Vt);  // dy . v = dP
      const bool edge = k0 + kTile - 1 > (a.causal ? r0 : S - 1);
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool seen = !edge || k0 + 8 * n + 2 * t + e % 2 <= last[e / 2];
          s[n][e] = seen ? exp2f(s[n][e] * sl2 - lse2[e / 2]) * (dp[n][e] - D_i[e / 2]) : 0.0f;  // dS
        }
      flash::product_pb<D>(acc, s, Kt);  // dQ += dS k (scaled at the end)
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= S) continue;
    bf16* dqr = dq + (b * S + row[r]) * a.ldq + h * D + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) store_pair(dqr + 8 * n, acc[n][2 * r] * a.scale, acc[n][2 * r + 1] * a.scale);
  }
}

// grid (B*Hkv, key blocks). Warp w owns keys j0 = k0 + 16 w ... + 16 (lane (g, t):
// keys + g and + 8), the columns of its products are queries (8 n + 2t, 2t + 1).
template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    dkdv_kernel(Args a, const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* Dv,
                const bf16* dy, bf16* dk, bf16* dv) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int L = D + 8;
  bf16* Ks = reinterpret_cast<bf16*>(smem);  // [128][L]
  bf16* Vs = Ks + kBlockRows * L;            // [128][L]
  bf16* Qs = Vs + kBlockRows * L;            // [2][64][L]
  bf16* dYs = Qs + 2 * kTile * L;            // [2][64][L]
  float* lse_s = reinterpret_cast<float*>(dYs + 2 * kTile * L);  // [2][64]
  float* D_s = lse_s + 2 * kTile;                                // [2][64]

  const std::int64_t S = a.S, bg = blockIdx.x, b = bg / a.Hkv, g = bg % a.Hkv, group = a.H / a.Hkv;
  const std::int64_t k0 = static_cast<std::int64_t>(blockIdx.y) * kBlockRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gr = lane / 4, t = lane % 4;
  const std::int64_t j0 = k0 + 16 * warp, key[2] = {j0 + gr, j0 + gr + 8};
  const bool active = j0 < S;
  const float sl2 = a.scale * kLog2e;
  // Query tiles: from the block's first key (causal) or 0, to S; for each query head of the group.
  const std::int64_t qstart = a.causal ? k0 : 0;
  const int per_head = static_cast<int>((S - qstart + kTile - 1) / kTile);
  const int steps = static_cast<int>(group) * per_head;
  const std::int64_t ldy = a.H * D;

  // Step i: query head g*group + i / per_head, query tile qstart + 64 (i % per_head).
  auto load_step = [&](int i, int buf) {
    const std::int64_t h = g * group + i / per_head, q0 = qstart + std::int64_t{i % per_head} * kTile;
    const std::int64_t bh = b * a.H + h;
    load_tile_async<D, kTile>(Qs + buf * kTile * L, q + b * S * a.ldq + h * D, q0, S, a.ldq);
    load_tile_async<D, kTile>(dYs + buf * kTile * L, dy + b * S * ldy + h * D, q0, S, ldy);
    if (static_cast<int>(threadIdx.x) < 2 * kTile) {
      const int c = static_cast<int>(threadIdx.x) % kTile;
      const bool valid = q0 + c < S;
      const bool is_lse = static_cast<int>(threadIdx.x) < kTile;
      const float* src = is_lse ? lse : Dv;
      float* dst = (is_lse ? lse_s : D_s) + buf * kTile + c;
      cp_async4(dst, valid ? src + bh * S + q0 + c : src, valid);
    }
  };

  load_tile_async<D, kBlockRows>(Ks, k + b * S * a.ldkv + g * D, k0, S, a.ldkv);
  load_tile_async<D, kBlockRows>(Vs, v + b * S * a.ldkv + g * D, k0, S, a.ldkv);
  load_step(0, 0);
  cp_async_commit();
  float ak[D / 8][4] = {}, av[D / 8][4] = {};

  for (int i = 0; i < steps; ++i) {
    const int buf = i & 1;
    if (i + 1 < steps) {
      load_step(i + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const std::int64_t q0 = qstart + std::int64_t{i % per_head} * kTile;
    // Causal: the tile's queries all come before the warp's keys, skip; a tile
    // needs masking where it crosses the warp's diagonal or the sequence end.
    if (active && !(a.causal && q0 + kTile - 1 < j0)) {
      const bf16* Qt = Qs + buf * kTile * L;
      const bf16* dYt = dYs + buf * kTile * L;
      const float* lse_t = lse_s + buf * kTile;
      const float* D_t = D_s + buf * kTile;
      const bool edge = (a.causal && q0 < j0 + 15) || q0 + kTile > S;
      float s[8][4] = {}, pr[8][4];
      product_abt_smem<D>(s, Ks + warp * 16 * L, Qt);  // [key][query] = k . q
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 8 * n + 2 * t + e % 2;
          const std::int64_t i_q = q0 + c;
          const bool seen = !edge || (i_q < S && (!a.causal || i_q >= key[e / 2]));
          pr[n][e] = seen ? exp2f(s[n][e] * sl2 - lse_t[c] * kLog2e) : 0.0f;  // P^T
          s[n][e] = 0.0f;
        }
      flash::product_pb<D>(av, pr, dYt);                // dV += P^T dy
      product_abt_smem<D>(s, Vs + warp * 16 * L, dYt);  // [key][query] = v . dy = dP^T
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) pr[n][e] *= s[n][e] - D_t[8 * n + 2 * t + e % 2];  // dS^T (0 where P is)
      flash::product_pb<D>(ak, pr, Qt);  // dK += dS^T q (scaled at the end)
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= S) continue;
    const std::int64_t at = (b * S + key[r]) * a.ldkv + g * D + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      store_pair(dk + at + 8 * n, ak[n][2 * r] * a.scale, ak[n][2 * r + 1] * a.scale);
      store_pair(dv + at + 8 * n, av[n][2 * r], av[n][2 * r + 1]);
    }
  }
}

// Whether `device` can run the kernels for D, decided once per device: compute
// capability 8.0+, code built for sm_80+ (PTX for an older target would reach the
// __trap()s), a per-block shared memory limit that holds the dk/dv block.
template <int D>
bool ready(int device) {
  static std::array<std::atomic<int>, kMaxDevices> state{};  // 0 not yet known, 1 ready, 2 not supported
  PTRAIN_CHECK(device >= 0 && device < kMaxDevices, CudaError, "[ptrain.cuda.device] device index ", device,
               " is out of range [0, ", kMaxDevices, ")");
  auto& s = state[static_cast<std::size_t>(device)];
  if (const int v = s.load(); v != 0) return v == 1;
  int major = 0, optin = 0;
  PTRAIN_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  PTRAIN_CHECK_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr{};
  bool ok = cudaFuncGetAttributes(&attr, forward_kernel<D>) == cudaSuccess;
  if (!ok) (void)cudaGetLastError();  // no usable image: an answer (not supported), not an error
  ok = ok && major >= 8 && !(attr.ptxVersion > 0 && attr.ptxVersion < 80) &&
       static_cast<std::size_t>(optin) >= dkdv_smem<D>();
  s.store(ok ? 1 : 2);
  return ok;
}

inline bool aligned(const void* p, std::uintptr_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

// The checks both entry points share: false where these kernels do not take the case.
inline bool fits(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, const bf16* q,
                 std::int64_t ldq, const bf16* k, const bf16* v, std::int64_t ldkv) {
  PTRAIN_CHECK(Hkv > 0 && H % Hkv == 0, ShapeError, "[ptrain.cuda.flash_tc] ", Hkv, " key/value heads do not divide ",
               H, " query heads");
  if (D != 64 && D != 128) return false;
  if (!(aligned(q, 16) && aligned(k, 16) && aligned(v, 16) && ldq % 8 == 0 && ldkv % 8 == 0)) return false;
  if (B * H > INT_MAX || (S + kBlockRows - 1) / kBlockRows > 65535) return false;
  const int device = current_device();
  return D == 64 ? ready<64>(device) : ready<128>(device);
}

template <int D>
void forward(std::int64_t B, const Args& a, const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse) {
  static std::array<std::atomic<bool>, kMaxDevices> raised{};
  flash::raise_smem_limit(forward_kernel<D>, forward_smem<D>(), current_device(), raised);
  const dim3 grid(static_cast<unsigned>(B * a.H), static_cast<unsigned>((a.S + kBlockRows - 1) / kBlockRows));
  forward_kernel<D><<<grid, kThreads, forward_smem<D>(), current_stream()>>>(a, q, k, v, y, lse);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <int D>
void backward(std::int64_t B, const Args& a, const bf16* q, const bf16* k, const bf16* v, const bf16* y,
              const float* lse, const bf16* dy, bf16* dq, bf16* dk, bf16* dv) {
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  static std::array<std::atomic<bool>, kMaxDevices> raised_dq{}, raised_dkdv{};
  flash::raise_smem_limit(dq_kernel<D>, dq_smem<D>(), device, raised_dq);
  flash::raise_smem_limit(dkdv_kernel<D>, dkdv_smem<D>(), device, raised_dkdv);
  const std::int64_t rows = B * a.H * a.S;
  auto dvec = Tensor<float>::empty({rows}, Device::cuda(device));
  gqa::rowdot_kernel<bf16><<<grid_for(rows * 32), kBlock, 0, stream>>>(rows, a.S, a.H, D, dy, y, dvec.data());
  PTRAIN_CHECK_CUDA_LAUNCH();
  const unsigned blocks = static_cast<unsigned>((a.S + kBlockRows - 1) / kBlockRows);
  dkdv_kernel<D><<<dim3(static_cast<unsigned>(B * a.Hkv), blocks), kThreads, dkdv_smem<D>(), stream>>>(
      a, q, k, v, lse, dvec.data(), dy, dk, dv);
  PTRAIN_CHECK_CUDA_LAUNCH();
  dq_kernel<D><<<dim3(static_cast<unsigned>(B * a.H), blocks), kThreads, dq_smem<D>(), stream>>>(
      a, q, k, v, lse, dvec.data(), dy, dq);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace flash_tc
}  // namespace detail

/// Forward (Note [Tensor-core flash attention]): y [B, S, H*D] and lse [B, H, S] from q
/// (row stride ldq) and k, v (row stride ldkv), causal or not; runs on the current
/// stream and returns true, or returns false having done nothing when these kernels do
/// not take the case (not bf16, D not 64 or 128, alignment, the GPU): the caller then
/// runs gqa_flash_forward or flash_attention_forward.
template <class T>
bool flash_tc_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                      std::int64_t ldq, const T* k, const T* v, std::int64_t ldkv, bool causal, acc_t<T> scale, T* y,
                      acc_t<T>* lse) {
  if constexpr (!std::is_same_v<T, bf16>) {
    return false;
  } else {
    using namespace detail::flash_tc;
    if (!fits(B, S, H, Hkv, D, q, ldq, k, v, ldkv) || !aligned(y, 4)) return false;
    if (B <= 0 || S <= 0 || H <= 0) return true;
    const Args a{S, H, Hkv, ldq, ldkv, static_cast<float>(scale), causal};
    if (D == 64) forward<64>(B, a, q, k, v, y, lse);
    else forward<128>(B, a, q, k, v, y, lse);
    return true;
  }
}

/// Backward: dq (q's strides), dk and dv (k's strides; every element, a key/value head
/// summing its query heads in order) from the forward's inputs, y, lse and dy
/// [B, S, H*D]; true, or false having done nothing (as flash_tc_forward; dy must
/// also sit on a 16-byte boundary, dq, dk, dv on 4).
template <class T>
bool flash_tc_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                       std::int64_t ldq, const T* k, const T* v, std::int64_t ldkv, bool causal, const T* y,
                       const acc_t<T>* lse, const T* dy, acc_t<T> scale, T* dq, T* dk, T* dv) {
  if constexpr (!std::is_same_v<T, bf16>) {
    return false;
  } else {
    using namespace detail::flash_tc;
    if (!fits(B, S, H, Hkv, D, q, ldq, k, v, ldkv) || !aligned(dy, 16) || !aligned(dq, 4) || !aligned(dk, 4) ||
        !aligned(dv, 4))
      return false;
    if (B <= 0 || S <= 0 || H <= 0) return true;
    const Args a{S, H, Hkv, ldq, ldkv, static_cast<float>(scale), causal};
    if (D == 64) backward<64>(B, a, q, k, v, y, lse, dy, dq, dk, dv);
    else backward<128>(B, a, q, k, v, y, lse, dy, dq, dk, dv);
    return true;
  }
}

}  // namespace ptrain::kernels::cuda
