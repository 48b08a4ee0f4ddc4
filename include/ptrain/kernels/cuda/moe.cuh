#pragma once
// Mixture-of-experts kernels on device arrays: the router's top-k (+backward), the
// permutation of token slots into expert-grouped order, the gather of token rows
// and the weighted combine (+backwards). Same names and arguments as
// kernels/cpu/moe.hpp; float, double and bf16 (Note [bf16 kernels]); launched on
// current_stream().
//
// The router runs one thread per token on the formulas of kernels/moe_math.hpp,
// the CPU's. The permutation is a stable radix sort of (expert, slot) pairs (CUB),
// so an expert's slots stay in token order as on the CPU; per-expert counts are
// integer atomic adds, exact in any order. Every floating-point sum has a fixed
// order and no atomics: a token's k slots in order j (gather backward, combine),
// a warp's shuffle tree over the columns (the weights' gradient).
//
// Note [The grouped GEMM]
// grouped_gemm runs the experts' GEMMs of one projection (expert e on its rows, or
// the backward's dX and dW forms) as one cuBLAS call instead of one per expert:
// cublasGemmGroupedBatchedEx for float (FP32, or TF32 after set_tf32(true), as
// gemm()) and bf16 (fp32 accumulation, as gemm_bf16), cublasDgemmGroupedBatched for
// double. Each non-empty problem is its own group of one, since the row counts
// differ; groups without rows are left out, and those with k = 0 (C = beta C) go
// through gemm(), as do, for bf16 and TF32, groups with an operand off a 16-byte
// boundary (cuBLAS's documentation asks 16 bytes of such pointers, or rules on the
// row lengths, and reports a misaligned access otherwise; rows of an odd width and
// views into flat parameter buffers can be off). The sizes, scalars and leading dimensions are host arrays; the
// operand pointers must be a device array, so each call copies its 3G pointers to
// a stream-ordered block of the caching allocator with one cudaMemcpyAsync from
// host memory (a few hundred bytes; the runtime stages them, so the host array may
// go once the call returns). Host-to-device copies from pageable memory cannot be
// captured into a CUDA graph; neither can the MoE layer, which reads its routing
// counts back every forward (ops::moe_permute_plan).

#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/embedding.cuh"  // iota_kernel
#include "ptrain/kernels/cuda/gemm.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"
#include "ptrain/kernels/moe_math.hpp"

namespace ptrain::kernels::cuda {

namespace detail {

template <class T>
__global__ void moe_route_kernel(std::int64_t n, std::int64_t E, std::int64_t k, MoeScore kind, bool renormalize,
                                 acc_t<T> scale, const T* logits, std::int32_t* idx, T* w, acc_t<T>* probs,
                                 acc_t<T>* lse) {
  for (std::int64_t t = global_index(); t < n; t += grid_stride())
    math::moe_route_row<T, acc_t<T>>(E, k, kind, renormalize, scale, logits + t * E, idx + t * k, w + t * k,
                                     probs + t * E, lse + t);
}

template <class T>
__global__ void moe_route_backward_kernel(std::int64_t n, std::int64_t E, std::int64_t k, MoeScore kind,
                                          bool renormalize, acc_t<T> scale, const T* logits, const std::int32_t* idx,
                                          const T* dw, const acc_t<T>* lse, const acc_t<T>* aux_grad, acc_t<T> z_grad,
                                          T* dlogits) {
  for (std::int64_t t = global_index(); t < n; t += grid_stride())
    math::moe_route_backward_row<T, acc_t<T>>(E, k, kind, renormalize, scale, logits + t * E, idx + t * k, dw + t * k,
                                              lse[t], aux_grad, z_grad, dlogits + t * E);
}

// (The plan's kernels are templates over their index type only so that a header may define them.)
template <class I>
__global__ void moe_count_kernel(std::int64_t slots, std::int64_t E, const I* idx, I* routed) {
  for (std::int64_t s = global_index(); s < slots; s += grid_stride())
    if (idx[s] >= 0 && idx[s] < E) atomicAdd(routed + idx[s], 1);  // integers: exact in any order
}

// One thread: starts [E + 1] of each expert's slots in sorted order, offsets [E + 1] of its kept rows.
template <class I>
__global__ void moe_offsets_kernel(std::int64_t E, std::int64_t cap, const I* routed, I* starts, I* offsets) {
  if (global_index() != 0) return;
  starts[0] = offsets[0] = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    starts[e + 1] = starts[e] + routed[e];
    offsets[e + 1] = offsets[e] + static_cast<I>(routed[e] < cap ? routed[e] : cap);
  }
}

template <class I>
__global__ void moe_place_kernel(std::int64_t slots, std::int64_t k, std::int64_t E, std::int64_t cap,
                                 const std::uint32_t* sorted_experts, const I* sorted_slots, const I* starts,
                                 const I* offsets, I* pos, I* token_of) {
  for (std::int64_t i = global_index(); i < slots; i += grid_stride()) {
    const std::uint32_t e = sorted_experts[i];
    if (e >= E) continue;  // an expert out of range: the op refuses the plan (its counts fall short)
    const I s = sorted_slots[i];
    const std::int64_t r = i - starts[e];
    if (r >= starts[e + 1] - starts[e]) continue;  // only where an expert out of range sorted among e's slots
    if (r < cap) {
      const I p = offsets[e] + static_cast<I>(r);
      pos[s] = p;
      token_of[p] = static_cast<I>(s / k);
    } else {
      pos[s] = -1;
    }
  }
}

template <class T>
__global__ void moe_gather_kernel(std::int64_t m, std::int64_t c, const std::int32_t* token_of, const T* x, T* xp) {
  for (std::int64_t i = global_index(); i < m * c; i += grid_stride())
    xp[i] = x[static_cast<std::int64_t>(token_of[i / c]) * c + i % c];
}

template <class T>
__global__ void moe_gather_backward_kernel(std::int64_t n, std::int64_t k, std::int64_t c, const std::int32_t* pos,
                                           const T* dxp, T* dx) {
  for (std::int64_t i = global_index(); i < n * c; i += grid_stride()) {
    const std::int64_t t = i / c, col = i % c;
    acc_t<T> acc = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t p = pos[t * k + j];
      if (p >= 0) acc += ld(dxp[p * c + col]);
    }
    dx[i] = st<T>(acc);
  }
}

template <class T>
__global__ void moe_combine_kernel(std::int64_t n, std::int64_t k, std::int64_t c, const std::int32_t* pos,
                                   const T* w, const T* yp, T* y) {
  for (std::int64_t i = global_index(); i < n * c; i += grid_stride()) {
    const std::int64_t t = i / c, col = i % c;
    acc_t<T> acc = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t s = t * k + j, p = pos ? pos[s] : s;
      if (p >= 0) acc += ld(w[s]) * ld(yp[p * c + col]);
    }
    y[i] = st<T>(acc);
  }
}

// dyp[pos[s], col] = w[s] dy[s / k, col] over the n * k slots' columns.
template <class T>
__global__ void moe_combine_dyp_kernel(std::int64_t n, std::int64_t k, std::int64_t c, const std::int32_t* pos,
                                       const T* w, const T* dy, T* dyp) {
  for (std::int64_t i = global_index(); i < n * k * c; i += grid_stride()) {
    const std::int64_t s = i / c, col = i % c, p = pos ? pos[s] : s;
    if (p >= 0) dyp[p * c + col] = st<T>(ld(w[s]) * ld(dy[(s / k) * c + col]));
  }
}

// dw[s] = dy[s / k, :] . yp[pos[s], :], one warp per slot (lanes stride the columns, then a shuffle tree).
template <class T>
__global__ void moe_combine_dw_kernel(std::int64_t n, std::int64_t k, std::int64_t c, const std::int32_t* pos,
                                      const T* yp, const T* dy, T* dw) {
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  const unsigned lane = threadIdx.x & 31u;
  for (std::int64_t s = global_index() / 32; s < n * k; s += warps) {
    const std::int64_t p = pos ? pos[s] : s;
    acc_t<T> acc = 0;
    if (p >= 0)
      for (std::int64_t col = lane; col < c; col += 32) acc += ld(dy[(s / k) * c + col]) * ld(yp[p * c + col]);
    acc = warp_reduce(acc, SumOp{});
    if (lane == 0) dw[s] = st<T>(acc);
  }
}

}  // namespace detail

/// Per token: experts idx [n, k], weights w [n, k], probs [n, E], lse [n] (kernels/moe_math.hpp).
template <class T>
void moe_route(std::int64_t n, std::int64_t E, std::int64_t k, MoeScore kind, bool renormalize, acc_t<T> scale,
               const T* logits, std::int32_t* idx, T* w, acc_t<T>* probs, acc_t<T>* lse) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  detail::moe_route_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(
      n, E, k, kind, renormalize, scale, logits, idx, w, probs, lse);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// dlogits [n, E] of moe_route (kernels/moe_math.hpp); aux_grad may be null.
template <class T>
void moe_route_backward(std::int64_t n, std::int64_t E, std::int64_t k, MoeScore kind, bool renormalize,
                        acc_t<T> scale, const T* logits, const std::int32_t* idx, const T* dw, const acc_t<T>* lse,
                        const acc_t<T>* aux_grad, acc_t<T> z_grad, T* dlogits) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  detail::moe_route_backward_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(
      n, E, k, kind, renormalize, scale, logits, idx, dw, lse, aux_grad, z_grad, dlogits);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// The stable permutation of the n * k slots into expert-grouped order (kernels/cpu/moe.hpp):
/// routed [E], offsets [E + 1], pos [n * k], token_of [offsets[E]]. Experts outside [0, E) are
/// not counted (the op checks that the counts add up to n * k).
inline void moe_permute_plan(std::int64_t n, std::int64_t k, std::int64_t E, std::int64_t capacity,
                             const std::int32_t* idx, std::int32_t* routed, std::int32_t* offsets, std::int32_t* pos,
                             std::int32_t* token_of) {
  const std::int64_t slots = n * k, cap = capacity > 0 ? capacity : INT_MAX;
  PTRAIN_CHECK(slots < INT_MAX && E < INT_MAX, ShapeError, "[ptrain.cuda.moe] ", slots,
               " token slots exceed the 32-bit limit of the sort; split the batch");
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  PTRAIN_CHECK_CUDA(cudaMemsetAsync(routed, 0, static_cast<std::size_t>(E) * sizeof(std::int32_t), stream));
  if (slots == 0) {
    PTRAIN_CHECK_CUDA(cudaMemsetAsync(offsets, 0, static_cast<std::size_t>(E + 1) * sizeof(std::int32_t), stream));
    return;
  }
  // Scratch: sorted experts, slot numbers before and after the sort, each expert's first sorted slot.
  auto scratch = Tensor<std::int32_t>::empty({3 * slots + E + 1}, Device::cuda(device));
  auto* sorted_experts = reinterpret_cast<std::uint32_t*>(scratch.data());
  std::int32_t* slot_in = scratch.data() + slots;
  std::int32_t* slot_out = slot_in + slots;
  std::int32_t* starts = slot_out + slots;
  detail::iota_kernel<std::int32_t><<<detail::grid_for(slots), detail::kBlock, 0, stream>>>(slots, slot_in);
  PTRAIN_CHECK_CUDA_LAUNCH();
  detail::moe_count_kernel<std::int32_t><<<detail::grid_for(slots), detail::kBlock, 0, stream>>>(slots, E, idx, routed);
  PTRAIN_CHECK_CUDA_LAUNCH();
  detail::moe_offsets_kernel<std::int32_t><<<1, 32, 0, stream>>>(E, cap, routed, starts, offsets);
  PTRAIN_CHECK_CUDA_LAUNCH();
  int end_bit = 1;
  while (end_bit < 32 && (std::int64_t(1) << end_bit) < E) ++end_bit;
  const auto* keys_in = reinterpret_cast<const std::uint32_t*>(idx);
  std::size_t temp_bytes = 0;
  const int count = static_cast<int>(slots);
  PTRAIN_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, sorted_experts, slot_in, slot_out,
                                                    count, 0, end_bit, stream));
  auto temp = Tensor<std::uint8_t>::empty({static_cast<std::int64_t>(temp_bytes) + 1}, Device::cuda(device));
  PTRAIN_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, keys_in, sorted_experts, slot_in,
                                                    slot_out, count, 0, end_bit, stream));
  detail::moe_place_kernel<std::int32_t><<<detail::grid_for(slots), detail::kBlock, 0, stream>>>(
      slots, k, E, cap, sorted_experts, slot_out, starts, offsets, pos, token_of);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// xp[r, :] = x[token_of[r], :].
template <class T>
void moe_gather(std::int64_t m, std::int64_t c, const std::int32_t* token_of, const T* x, T* xp) {
  detail::check_element_type<T>();
  if (m <= 0 || c <= 0) return;
  detail::moe_gather_kernel<T><<<detail::grid_for(m * c), detail::kBlock, 0, current_stream()>>>(m, c, token_of, x, xp);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// dx[t, :] = sum over j of dxp[pos[t * k + j], :], in order j.
template <class T>
void moe_gather_backward(std::int64_t n, std::int64_t k, std::int64_t c, const std::int32_t* pos, const T* dxp, T* dx) {
  detail::check_element_type<T>();
  if (n <= 0 || c <= 0) return;
  detail::moe_gather_backward_kernel<T><<<detail::grid_for(n * c), detail::kBlock, 0, current_stream()>>>(n, k, c, pos,
                                                                                                          dxp, dx);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// y[t, :] = sum over j of w[t, j] yp[pos[t * k + j], :], in order j; pos null: the identity.
template <class T>
void moe_combine(std::int64_t n, std::int64_t k, std::int64_t c, const std::int32_t* pos, const T* w, const T* yp,
                 T* y) {
  detail::check_element_type<T>();
  if (n <= 0 || c <= 0) return;
  detail::moe_combine_kernel<T><<<detail::grid_for(n * c), detail::kBlock, 0, current_stream()>>>(n, k, c, pos, w, yp,
                                                                                                  y);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// dyp[pos[s], :] = w[s] dy[t, :]; dw[s] = dy[t, :] . yp[pos[s], :] (0 for a dropped slot).
template <class T>
void moe_combine_backward(std::int64_t n, std::int64_t k, std::int64_t c, const std::int32_t* pos, const T* w,
                          const T* yp, const T* dy, T* dyp, T* dw) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  const cudaStream_t stream = current_stream();
  if (c > 0) {
    detail::moe_combine_dyp_kernel<T><<<detail::grid_for(n * k * c), detail::kBlock, 0, stream>>>(n, k, c, pos, w, dy,
                                                                                                   dyp);
    PTRAIN_CHECK_CUDA_LAUNCH();
  }
  detail::moe_combine_dw_kernel<T><<<detail::grid_for(n * k * 32), detail::kBlock, 0, stream>>>(n, k, c, pos, yp, dy,
                                                                                                 dw);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// kernels::cpu::grouped_gemm on device data (host arrays of sizes and of device pointers):
/// the groups with m, n, k > 0 as one grouped cuBLAS GEMM (Note [The grouped GEMM]).
template <class T>
void grouped_gemm(bool trans_a, bool trans_b, std::int64_t groups, const std::int64_t* m, const std::int64_t* n,
                  const std::int64_t* k, acc_t<T> alpha, const T* const* a, std::int64_t lda, const T* const* b,
                  std::int64_t ldb, acc_t<T> beta, T* const* c, std::int64_t ldc) {
  detail::check_element_type<T>();
  PTRAIN_CHECK(lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX, ShapeError, "[ptrain.cuda.gemm] leading dimensions ",
               lda, ", ", ldb, ", ", ldc, " exceed cuBLAS's 32-bit limit; split the GEMM");
  // Column-major (gemm.cuh's header comment): C_g^T = op(B_g)^T op(A_g)^T, sizes (n, m, k).
  std::vector<int> cm, cn, ck;
  std::vector<std::int64_t> live;
  const bool vector_loads = std::is_same_v<T, bf16> || (std::is_same_v<T, float> && tf32_enabled());
  auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  for (std::int64_t g = 0; g < groups; ++g) {
    if (m[g] == 0 || n[g] == 0) continue;
    if (k[g] == 0 || (vector_loads && !(aligned(a[g]) && aligned(b[g]) && aligned(c[g])))) {
      gemm<T>(trans_a, trans_b, m[g], n[g], k[g], alpha, a[g], lda, b[g], ldb, beta, c[g], ldc);
      continue;
    }
    PTRAIN_CHECK(m[g] <= INT_MAX && n[g] <= INT_MAX && k[g] <= INT_MAX, ShapeError, "[ptrain.cuda.gemm] group ", g,
                 " sizes m=", m[g], " n=", n[g], " k=", k[g], " exceed cuBLAS's 32-bit limit; split the GEMM");
    cm.push_back(static_cast<int>(n[g]));
    cn.push_back(static_cast<int>(m[g]));
    ck.push_back(static_cast<int>(k[g]));
    live.push_back(g);
  }
  if (live.empty()) return;
  const auto G = live.size();
  std::vector<const void*> ptrs(3 * G);  // B_g of every group, then A_g, then C_g
  for (std::size_t i = 0; i < G; ++i) {
    const auto g = static_cast<std::size_t>(live[i]);
    ptrs[i] = b[g];
    ptrs[G + i] = a[g];
    ptrs[2 * G + i] = c[g];
  }
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  auto table = Tensor<std::uint8_t>::empty(Shape{static_cast<std::int64_t>(ptrs.size() * sizeof(void*))},
                                           Device::cuda(device));
  PTRAIN_CHECK_CUDA(cudaMemcpyAsync(table.data(), ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice,
                                    stream));
  void** dev = reinterpret_cast<void**>(table.data());  // device memory: cuBLAS reads the pointers there
  const detail::CublasCall call = detail::cublas_call(device);
  const std::vector<cublasOperation_t> op_b(G, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N),
      op_a(G, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  const std::vector<int> ld_b(G, static_cast<int>(ldb)), ld_a(G, static_cast<int>(lda)),
      ld_c(G, static_cast<int>(ldc)), size(G, 1);
  const std::vector<acc_t<T>> alphas(G, alpha), betas(G, beta);
  const int count = static_cast<int>(G);
  if constexpr (std::is_same_v<T, double>) {
    double** d = reinterpret_cast<double**>(dev);
    PTRAIN_CHECK_CUBLAS(cublasDgemmGroupedBatched(call.handle, op_b.data(), op_a.data(), cm.data(), cn.data(),
                                                  ck.data(), alphas.data(), d, ld_b.data(), d + G, ld_a.data(),
                                                  betas.data(), d + 2 * G, ld_c.data(), count, size.data()));
  } else {
    const cudaDataType_t type = std::is_same_v<T, bf16> ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute =
        std::is_same_v<T, float> && tf32_enabled() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    PTRAIN_CHECK_CUBLAS(cublasGemmGroupedBatchedEx(call.handle, op_b.data(), op_a.data(), cm.data(), cn.data(),
                                                   ck.data(), alphas.data(), dev, type, ld_b.data(), dev + G, type,
                                                   ld_a.data(), betas.data(), dev + 2 * G,
                                                   type, ld_c.data(), count, size.data(), compute));
  }
}

}  // namespace ptrain::kernels::cuda
