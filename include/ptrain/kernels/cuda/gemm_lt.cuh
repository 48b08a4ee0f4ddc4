#pragma once
// The affine map y = x W^T + b (and gelu of it) as one cuBLASLt GEMM with a
// fused epilogue, on row-major device buffers.
//
// Note [cuBLASLt epilogues]
// With CUBLASLT_EPILOGUE_BIAS the GEMM adds the bias as it writes y, and with
// CUBLASLT_EPILOGUE_GELU_AUX_BIAS it also writes gelu(y) and keeps the
// pre-activation in an auxiliary buffer for the backward pass. Unfused, the
// bias and the GELU each read and write the [M, N] output once more (for the
// MLP's [8192, 3072] at GPT-2 small: 100 MB in float each way). cuBLASLt does
// not document how exactly it evaluates the GELU, so the GELU epilogue is used
// for bf16 only, whose 2^-9 rounding covers a fast tanh; float keeps the
// unfused GELU kernel and its 1e-5 bound (the bias epilogue is exact). Layout: as in gemm.cuh, row-major y [M, N] is column-major
// y^T [N, M] = W x^T, so W is operand A (transposed) and x operand B; the bias
// runs along y^T's rows, i.e. along y's columns, as it should.
//
// linear_epilogue returns false, having done nothing, where it does not apply
// (double, no bias, GELU on float, sizes over 32 bits, an auxiliary leading
// dimension that is not a multiple of 8, a bias or auxiliary buffer off a 16-byte
// boundary, no algorithm from the heuristic); the
// caller then runs the unfused kernels. Each host thread keeps one cuBLASLt
// handle per device; each call takes the workspace its algorithm needs (at most
// 32 MiB, often none) from the device's caching allocator on the current stream
// and frees it once queued, so the
// block serves only later work of that stream (Note [Stream semantics] in
// device.cuh) and two streams never share scratch. It remembers the heuristic's
// algorithm per problem (shape, types, epilogue and the alignment of the
// operands, the bias and the auxiliary buffer, which views into flat parameter
// buffers may lower), so a training step asks it once per layer shape, not once
// per call.

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <type_traits>
#include <utility>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.cuh"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/gemm.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

inline constexpr std::int64_t kLtWorkspaceBytes = std::int64_t{32} << 20;

// Owners of cuBLASLt objects: unique_ptr with the matching destroy function.
struct LtDeleter {
  void operator()(cublasLtMatmulDesc_t d) const { (void)cublasLtMatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayout_t l) const { (void)cublasLtMatrixLayoutDestroy(l); }
  void operator()(cublasLtMatmulPreference_t p) const { (void)cublasLtMatmulPreferenceDestroy(p); }
};
using LtDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>, LtDeleter>;
using LtLayout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>, LtDeleter>;
using LtPreference = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, LtDeleter>;

inline LtLayout lt_layout(cudaDataType_t type, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  PTRAIN_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&l, type, static_cast<std::uint64_t>(rows),
                                                 static_cast<std::uint64_t>(cols), ld));
  return LtLayout(l);
}

template <class V>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const V& value) {
  PTRAIN_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}

/// The calling thread's cuBLASLt handle for `device` (created on first use, destroyed at thread exit).
inline cublasLtHandle_t lt_handle(int device) {
  struct Handle {
    cublasLtHandle_t h = nullptr;
    ~Handle() {
      if (h) (void)cublasLtDestroy(h);
    }
  };
  thread_local std::array<Handle, kMaxDevices> handles;
  PTRAIN_CHECK(device >= 0 && device < kMaxDevices, CudaError, "[ptrain.cuda.device] device index ", device,
               " is out of range [0, ", kMaxDevices, ")");
  Handle& e = handles[static_cast<std::size_t>(device)];
  if (!e.h) {
    DeviceGuard guard(device);
    PTRAIN_CHECK_CUBLAS(cublasLtCreate(&e.h));
  }
  return e.h;
}

/// The largest power of two (up to 256) that divides the address: what an
/// algorithm may assume about the operand's alignment.
inline std::uint32_t alignment_of(const void* p) {
  std::uint32_t a = 256;
  while (a > 1 && reinterpret_cast<std::uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

/// The heuristic's answer for one problem (shape, types, epilogue, the
/// alignments of the operands and of the epilogue's vectors), asked once per
/// host thread: found == false means no algorithm.
struct LtChoice {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
  std::uint64_t workspace = 0;  // bytes the algorithm needs (at most kLtWorkspaceBytes)
};
using LtKey = std::array<std::int64_t, 12>;

}  // namespace detail

/// y [m, n] = x [m, k] W^T + bias (W [n, k], bias [n], all row-major and contiguous),
/// and with `gelu` pre = that sum and y = gelu(pre), as one cuBLASLt call on the
/// current stream (Note [cuBLASLt epilogues]). Returns false without doing
/// anything when the fused form does not apply.
template <class T>
bool linear_epilogue(std::int64_t m, std::int64_t n, std::int64_t k, const T* x, const T* w, const T* bias, T* y,
                     T* pre, bool gelu) {
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, bf16>) {
    return false;
  } else {
    if (m <= 0 || n <= 0 || k <= 0 || bias == nullptr || (gelu && (pre == nullptr || std::is_same_v<T, float>)))
      return false;
    if (m > INT_MAX || n > INT_MAX || k > INT_MAX || (gelu && n % 8 != 0)) return false;
    // The heuristic reads the bias's and the auxiliary buffer's alignment off
    // their pointers (cublasLt.h, BIAS_POINTER and EPILOGUE_AUX_POINTER), so both
    // go into the cache key beside the operands'.
    const std::uint32_t align_bias = detail::alignment_of(bias), align_pre = gelu ? detail::alignment_of(pre) : 0;
    if (align_bias < 16 || (gelu && align_pre < 16)) return false;
    const int device = current_device();
    const cudaStream_t stream = current_stream(device);
    constexpr cudaDataType_t type = std::is_same_v<T, bf16> ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute =
        std::is_same_v<T, float> && tf32_enabled() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;

    cublasLtMatmulDesc_t raw = nullptr;
    PTRAIN_CHECK_CUBLAS(cublasLtMatmulDescCreate(&raw, compute, CUDA_R_32F));
    detail::LtDesc op(raw);
    detail::set_desc(op.get(), CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
    detail::set_desc(op.get(), CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
    detail::set_desc(op.get(), CUBLASLT_MATMUL_DESC_EPILOGUE,
                     gelu ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_BIAS);
    detail::set_desc(op.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias));
    if (gelu) {
      detail::set_desc(op.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<void*>(pre));
      detail::set_desc(op.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, n);
    }
    // Column-major views: W^T is [k, n] (ld k), x^T is [k, m] (ld k), y^T is [n, m] (ld n).
    const auto a = detail::lt_layout(type, k, n, k), b = detail::lt_layout(type, k, m, k),
               d = detail::lt_layout(type, n, m, n);

    const std::uint64_t ws_bytes = static_cast<std::uint64_t>(detail::kLtWorkspaceBytes);
    const cublasLtHandle_t handle = detail::lt_handle(device);
    const std::uint32_t align_w = detail::alignment_of(w), align_x = detail::alignment_of(x),
                        align_y = detail::alignment_of(y);
    thread_local std::map<detail::LtKey, detail::LtChoice> choices;
    const detail::LtKey key{device, m, n, k, type, compute, gelu, align_w, align_x, align_y, align_bias, align_pre};
    auto it = choices.find(key);
    if (it == choices.end()) {
      cublasLtMatmulPreference_t praw = nullptr;
      PTRAIN_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&praw));
      detail::LtPreference pref(praw);
      const std::pair<cublasLtMatmulPreferenceAttributes_t, std::uint32_t> aligns[] = {
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_w},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_x},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_y},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_y}};
      PTRAIN_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                               &ws_bytes, sizeof(ws_bytes)));
      for (const auto& [attr, bytes] : aligns)
        PTRAIN_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref.get(), attr, &bytes, sizeof(bytes)));
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      detail::LtChoice choice;
      if (cublasLtMatmulAlgoGetHeuristic(handle, op.get(), a.get(), b.get(), d.get(), d.get(), pref.get(), 1, &result,
                                         &found) == CUBLAS_STATUS_SUCCESS &&
          found > 0)
        choice = {true, result.algo, static_cast<std::uint64_t>(result.workspaceSize)};
      it = choices.emplace(key, choice).first;
    }
    if (!it->second.found) return false;
    const float alpha = 1.0f, beta = 0.0f;
    const std::uint64_t need = it->second.workspace;
    Tensor<std::uint8_t> workspace;
    if (need > 0) workspace = Tensor<std::uint8_t>::empty(Shape{static_cast<std::int64_t>(need)}, Device::cuda(device));
    PTRAIN_CHECK_CUBLAS(cublasLtMatmul(handle, op.get(), &alpha, w, a.get(), x, b.get(), &beta, y, d.get(), y, d.get(),
                                       &it->second.algo, need > 0 ? workspace.data() : nullptr, need, stream));
    return true;
  }
}

}  // namespace ptrain::kernels::cuda
