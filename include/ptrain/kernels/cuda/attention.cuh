#pragma once
// Causal multi-head attention on a packed qkv buffer, on device arrays.
//
// Same names, arguments and layout as kernels/cpu/attention.hpp: qkv is
// [B, S, 3C] with C = H * D, head h of q, k and v at columns h*D, C + h*D and
// 2C + h*D; probs (and probs_drop) are [B, H, S, S] with exact zeros above the
// diagonal; y is [B, S, C] with head h at columns h*D.
//
// Note [CUDA attention]
// Every product runs for all B*H heads in one cuBLAS call
// (cublasGemmBatchedEx / cublasDgemmBatched). A head's matrices start at
// base + b * stride_b + h * stride_h, two strides, which the single-stride
// strided-batched API cannot express; a small kernel writes the per-head
// pointer arrays instead, so q, k, v and dq, dk, dv are read and written in
// place in the packed buffers, with no split or transpose copies. The products
// cover the full S x S square: the CPU's causal tiles (half the FLOPs) wait for
// a fused kernel. Entries above the diagonal are computed and then overwritten
// with exact zeros by the masked softmax, which makes the later products over
// full rows correct without masks, as on the CPU. Head matrices that do not
// all start on 16-byte boundaries (odd head widths) fall back to one GEMM per
// head (see gemm_heads).
//
// The masked softmax and its backward take one block per row (B*H*S rows);
// row i of a head keeps columns 0..i. Dropout keeps (b, h, i, j) when
// random_uniform(seed, offset + ((b*H + h)*S + i)*S + j) >= p, the CPU's
// formula, so masks are the same on both devices and the backward pass
// regenerates them instead of storing them.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/gemm.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

/// One operand of a GEMM batched over heads: the row-major matrix of head
/// (b, h) starts at base + b * stride_b + h * stride_h, leading dimension ld.
template <class T>
struct HeadOperand {
  T* base;
  std::int64_t ld, stride_b, stride_h;
};

// Pointer arrays a, b, c of nb * nh entries each (entry b * nh + h).
template <class T>
__global__ void head_pointers_kernel(std::int64_t nb, std::int64_t nh, HeadOperand<const T> a,
                                     HeadOperand<const T> b, HeadOperand<T> c, const T** pa, const T** pb, T** pc) {
  for (std::int64_t i = global_index(); i < nb * nh; i += grid_stride()) {
    const std::int64_t ib = i / nh, ih = i % nh;
    pa[i] = a.base + ib * a.stride_b + ih * a.stride_h;
    pb[i] = b.base + ib * b.stride_b + ih * b.stride_h;
    pc[i] = c.base + ib * c.stride_b + ih * c.stride_h;
  }
}

// Whether every head's matrix of `o` starts on a 16-byte boundary.
template <class T>
bool heads_aligned(const HeadOperand<T>& o) {
  constexpr std::int64_t kBytes = 16, e = static_cast<std::int64_t>(sizeof(T));
  return reinterpret_cast<std::uintptr_t>(o.base) % kBytes == 0 && (o.stride_b * e) % kBytes == 0 &&
         (o.stride_h * e) % kBytes == 0;
}

/// C_bh = alpha op(A_bh) op(B_bh) + beta C_bh for every head (b, h), row-major,
/// as kernels::cuda::gemm per head but in one cuBLAS call. m, n, k > 0.
template <class T>
void gemm_heads(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, acc_t<T> alpha,
                HeadOperand<const T> a, HeadOperand<const T> b, acc_t<T> beta, HeadOperand<T> c, std::int64_t nb,
                std::int64_t nh) {
  const std::int64_t count = nb * nh;
  PTRAIN_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && a.ld <= INT_MAX && b.ld <= INT_MAX &&
                   c.ld <= INT_MAX && count <= INT_MAX,
               ShapeError, "[ptrain.cuda.attention] sizes m=", m, " n=", n, " k=", k, " heads=", count,
               " exceed cuBLAS's 32-bit limit; use a shorter sequence or a smaller batch");
  if (!heads_aligned(a) || !heads_aligned(b) || !heads_aligned(c)) {
    // cuBLAS cannot see pointers that sit in device arrays, and its fast
    // (tensor-core) batched kernels take them to be 16-byte aligned. Odd head
    // widths break that, so they get one ordinary GEMM per head: slower, but
    // cuBLAS then checks each pointer itself.
    for (std::int64_t ib = 0; ib < nb; ++ib)
      for (std::int64_t ih = 0; ih < nh; ++ih)
        gemm<T>(trans_a, trans_b, m, n, k, alpha, a.base + ib * a.stride_b + ih * a.stride_h, a.ld,
                b.base + ib * b.stride_b + ih * b.stride_h, b.ld, beta, c.base + ib * c.stride_b + ih * c.stride_h,
                c.ld);
    return;
  }
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  // The pointer arrays live in one scratch tensor: freeing it on return is safe
  // because the next user of the block queues behind cuBLAS on this stream.
  auto scratch = Tensor<std::int64_t>::empty({3 * count}, Device::cuda(device));
  auto* pa = reinterpret_cast<const T**>(scratch.data());
  auto* pb = reinterpret_cast<const T**>(scratch.data() + count);
  auto* pc = reinterpret_cast<T**>(scratch.data() + 2 * count);
  head_pointers_kernel<T><<<grid_for(count), kBlock, 0, stream>>>(nb, nh, a, b, c, pa, pb, pc);
  PTRAIN_CHECK_CUDA_LAUNCH();

  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the
  // operands, as gemm.cuh does.
  const CublasCall call = cublas_call(device);
  const cublasHandle_t handle = call.handle;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int cm = static_cast<int>(n), cn = static_cast<int>(m), ck = static_cast<int>(k);
  const int lda = static_cast<int>(a.ld), ldb = static_cast<int>(b.ld), ldc = static_cast<int>(c.ld);
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
    // bf16: bf16 operands and result, fp32 accumulation and scalars.
    constexpr cudaDataType_t type = std::is_same_v<T, bf16> ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute =
        std::is_same_v<T, float> && tf32_enabled() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    PTRAIN_CHECK_CUBLAS(cublasGemmBatchedEx(handle, op_b, op_a, cm, cn, ck, &alpha,
                                            reinterpret_cast<const void* const*>(pb), type, ldb,
                                            reinterpret_cast<const void* const*>(pa), type, lda, &beta,
                                            reinterpret_cast<void* const*>(pc), type, ldc,
                                            static_cast<int>(count), compute, CUBLAS_GEMM_DEFAULT));
  } else {
    PTRAIN_CHECK_CUBLAS(cublasDgemmBatched(handle, op_b, op_a, cm, cn, ck, &alpha, pb, ldb, pa, lda, &beta, pc, ldc,
                                           static_cast<int>(count)));
  }
}

// In place on the scores of each row r = head * S + i: P[r, j] = softmax over
// j <= i, 0 for j > i. With dropout (Pd not null) also Pd[r, j] = P[r, j] *
// keep_scale where kept, else 0. Each thread rescales and masks only the
// columns it read itself, so no barrier is needed between the passes.
template <class T>
__global__ void causal_softmax_kernel(std::int64_t rows, std::int64_t S, T* P, T* Pd, double p, acc_t<T> keep_scale,
                                      std::uint64_t seed, std::uint64_t offset) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const std::int64_t i = r % S;
    T* row = P + r * S;
    A mx = A(-INFINITY);
    for (std::int64_t c = threadIdx.x; c <= i; c += blockDim.x) mx = ld(row[c]) > mx ? ld(row[c]) : mx;
    mx = block_max(mx);
    A s = A(0);
    for (std::int64_t c = threadIdx.x; c <= i; c += blockDim.x) s += dev_exp(ld(row[c]) - mx);
    const A inv = A(1) / block_sum(s);  // multiply by the inverse, as the CPU does
    const std::uint64_t base = offset + static_cast<std::uint64_t>(r * S);
    // exp is computed again rather than stored: a bf16 row is rounded once.
    for (std::int64_t c = threadIdx.x; c < S; c += blockDim.x) {
      const A v = c <= i ? dev_exp(ld(row[c]) - mx) * inv : A(0);
      row[c] = st<T>(v);
      if (Pd) {
        const bool keep = c <= i && random_uniform(seed, base + static_cast<std::uint64_t>(c)) >= p;
        Pd[r * S + c] = keep ? st<T>(v * keep_scale) : T(0);
      }
    }
  }
}

// In place on dS, which holds dPd = dy v^T on entry: undoes the dropout
// scaling (when p > 0), then dS = P * (dP - sum_j P dP) * scale on j <= i and
// 0 above the diagonal, the CPU's expression in the CPU's order.
template <class T>
__global__ void causal_softmax_backward_kernel(std::int64_t rows, std::int64_t S, const T* P, T* dS, double p,
                                               acc_t<T> keep_scale, std::uint64_t seed, std::uint64_t offset,
                                               acc_t<T> scale) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const std::int64_t i = r % S;
    const T* prow = P + r * S;
    T* row = dS + r * S;
    const std::uint64_t base = offset + static_cast<std::uint64_t>(r * S);
    // The undropped gradient is recomputed in the second pass rather than
    // stored, so a bf16 row is rounded once.
    auto grad = [&](std::int64_t c) {
      const A d = ld(row[c]);
      if (p == 0) return d;
      return random_uniform(seed, base + static_cast<std::uint64_t>(c)) >= p ? d * keep_scale : A(0);
    };
    A dot = A(0);
    for (std::int64_t c = threadIdx.x; c <= i; c += blockDim.x) dot += ld(prow[c]) * grad(c);
    dot = block_sum(dot);
    for (std::int64_t c = threadIdx.x; c < S; c += blockDim.x)
      row[c] = c <= i ? st<T>(ld(prow[c]) * (grad(c) - dot) * scale) : T(0);
  }
}

}  // namespace detail

/// Forward. probs [B, H, S, S] receives softmax(scale q k^T) with zeros above the
/// diagonal. When p > 0, probs_drop [B, H, S, S] receives the dropped and
/// rescaled probabilities that multiply v (probs_drop may be null when p == 0).
/// y [B, S, C] is written in full. Runs on the current stream.
template <class T>
void causal_attention_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D, const T* qkv, acc_t<T> scale,
                              T* probs, T* probs_drop, double p, std::uint64_t seed, std::uint64_t offset, T* y) {
  using A = acc_t<T>;
  detail::check_element_type<T>();
  if (B <= 0 || S <= 0 || H <= 0 || D <= 0) return;
  PTRAIN_CHECK(p == 0 || probs_drop, Error, "[ptrain.cuda.attention] dropout p = ", p,
               " needs a probs_drop buffer");
  const std::int64_t C = H * D, ld = 3 * C, SS = S * S;
  const A keep_scale = A(1.0 / (1.0 - p));
  T* Pd = p > 0 ? probs_drop : probs;
  using detail::HeadOperand;
  // probs = scale q k^T over the full square (the softmax masks it).
  detail::gemm_heads<T>(false, true, S, S, D, scale, HeadOperand<const T>{qkv, ld, S * ld, D},
                        HeadOperand<const T>{qkv + C, ld, S * ld, D}, A(0), HeadOperand<T>{probs, S, H * SS, SS}, B,
                        H);
  detail::causal_softmax_kernel<T>
      <<<detail::grid_for_rows(B * H * S), detail::block_for_cols(S), 0, current_stream()>>>(
          B * H * S, S, probs, p > 0 ? probs_drop : nullptr, p, keep_scale, seed, offset);
  PTRAIN_CHECK_CUDA_LAUNCH();
  // y = Pd v, head h into columns h*D of y.
  detail::gemm_heads<T>(false, false, S, D, S, A(1), HeadOperand<const T>{Pd, S, H * SS, SS},
                        HeadOperand<const T>{qkv + 2 * C, ld, S * ld, D}, A(0), HeadOperand<T>{y, C, S * C, D}, B,
                        H);
}

/// Backward: given dy [B, S, C] and the forward's probs (and probs_drop when
/// p > 0), writes dqkv [B, S, 3C] (every element). Needs B*H*S*S elements of
/// scratch from the device's allocator for dS.
template <class T>
void causal_attention_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D, const T* qkv,
                               const T* probs, const T* probs_drop, double p, std::uint64_t seed,
                               std::uint64_t offset, const T* dy, acc_t<T> scale, T* dqkv) {
  using A = acc_t<T>;
  detail::check_element_type<T>();
  if (B <= 0 || S <= 0 || H <= 0 || D <= 0) return;
  PTRAIN_CHECK(p == 0 || probs_drop, Error, "[ptrain.cuda.attention] dropout p = ", p,
               " needs the forward's probs_drop");
  const std::int64_t C = H * D, ld = 3 * C, SS = S * S;
  const A keep_scale = A(1.0 / (1.0 - p));
  const T* Pd = p > 0 ? probs_drop : probs;
  auto scratch = Tensor<T>::empty({B * H * SS}, Device::cuda(current_device()));
  T* dS = scratch.data();
  using detail::HeadOperand;
  const HeadOperand<const T> q{qkv, ld, S * ld, D}, k{qkv + C, ld, S * ld, D}, v{qkv + 2 * C, ld, S * ld, D};
  const HeadOperand<const T> dyh{dy, C, S * C, D}, dS_in{dS, S, H * SS, SS};
  // dPd = dy v^T, then dS in place.
  detail::gemm_heads<T>(false, true, S, S, D, A(1), dyh, v, A(0), HeadOperand<T>{dS, S, H * SS, SS}, B, H);
  detail::causal_softmax_backward_kernel<T>
      <<<detail::grid_for_rows(B * H * S), detail::block_for_cols(S), 0, current_stream()>>>(
          B * H * S, S, probs, dS, p, keep_scale, seed, offset, scale);
  PTRAIN_CHECK_CUDA_LAUNCH();
  // dq = dS k, dk = dS^T q, dv = Pd^T dy; each writes its third of dqkv in full.
  detail::gemm_heads<T>(false, false, S, D, S, A(1), dS_in, k, A(0), HeadOperand<T>{dqkv, ld, S * ld, D}, B, H);
  detail::gemm_heads<T>(true, false, S, D, S, A(1), dS_in, q, A(0), HeadOperand<T>{dqkv + C, ld, S * ld, D}, B, H);
  detail::gemm_heads<T>(true, false, S, D, S, A(1), HeadOperand<const T>{Pd, S, H * SS, SS}, dyh, A(0),
                        HeadOperand<T>{dqkv + 2 * C, ld, S * ld, D}, B, H);
}

}  // namespace ptrain::kernels::cuda
