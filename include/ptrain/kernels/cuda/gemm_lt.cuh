#pragma once
// The affine map y = x W^T + b (and gelu of it), and its backward, as cuBLASLt
// GEMMs with fused epilogues, on row-major device buffers.
//
// Note [cuBLASLt epilogues]
// Forward: with CUBLASLT_EPILOGUE_BIAS the GEMM adds the bias as it writes y,
// and with CUBLASLT_EPILOGUE_GELU_AUX_BIAS it also writes gelu(y) and keeps the
// pre-activation in an auxiliary buffer for the backward pass. Backward: with
// CUBLASLT_EPILOGUE_BGRADB the weight-gradient GEMM dW += dy^T x also sums dy's
// columns into the bias gradient, and with CUBLASLT_EPILOGUE_DGELU_BGRAD the GEMM
// dy W of the layer after a GELU multiplies by gelu'(pre) as it writes and sums
// the result's columns into the bias gradient of the layer before the GELU.
// Unfused, each of these is one more pass over an [M, N] array (the MLP's
// [8192, 3072] at GPT-2 small is 50 MB in bf16): about 210 MB of traffic per
// GPT-2 block and training step are saved. cuBLASLt does not document how
// exactly it evaluates the GELU and its derivative, so the GELU epilogues are
// used for bf16 only, whose 2^-9 rounding covers a fast tanh; float keeps the
// unfused GELU kernels and their 1e-5 bound (the bias and bias-gradient
// epilogues are plain sums). The bias gradient is written, not added, so
// callers that accumulate (ops::linear_backward) add it to theirs.
//
// Layout: cuBLAS is column-major, so a row-major [r, c] array is its transpose
// [c, r]: y = x W^T is y^T [n, m] = W x^T, dW = dy^T x is dW^T = x^T dy, and
// dx = dy W is dx^T = W^T dy^T (each function states its operands).
//
// Each function returns false, having done nothing, where the fused form does
// not apply (double, no bias, GELU on float, sizes over 32 bits, an auxiliary
// leading dimension that is not a multiple of 8, a bias or auxiliary buffer off
// a 16-byte boundary, no algorithm from the heuristic or one the matmul refuses
// as not supported, or after set_gemm_epilogues(false)); the caller then runs
// the unfused kernels. Each host thread keeps one cuBLASLt handle per device;
// each call takes the workspace its algorithm needs (at most 32 MiB, often
// none) from the device's caching allocator on the current stream and frees it
// once queued, so the block serves only later work of that stream (Note [Stream
// semantics] in stream.hpp) and two streams never share scratch. The heuristic's algorithm is
// remembered per problem (layout, types, epilogue and the alignment of the
// operands, the bias and the auxiliary buffer, which views into flat parameter
// buffers may lower), so a training step asks once per layer shape, not once
// per call.

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <type_traits>
#include <utility>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
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

inline std::atomic<bool>& lt_epilogues_flag() {
  static std::atomic<bool> on{true};
  return on;
}

/// One cuBLASLt GEMM in cuBLAS's column-major terms: D [m, n] = alpha op(A) op(B)
/// + beta D, with an epilogue and its vectors (bias or bias gradient, and the
/// auxiliary GELU input with its leading dimension).
struct LtGemm {
  bool trans_a = false, trans_b = false;
  std::int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  std::int64_t lda = 0;
  const void* b = nullptr;
  std::int64_t ldb = 0;
  void* d = nullptr;
  std::int64_t ldd = 0;
  float beta = 0;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // the bias, or where the bias gradient goes
  const void* aux = nullptr;   // the GELU input, written (forward) or read (backward)
  std::int64_t aux_ld = 0;
};

/// The heuristic's answer for one problem (layout, types, epilogue, the
/// alignments of the operands and of the epilogue's vectors), asked once per
/// host thread: found == false means no algorithm.
struct LtChoice {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
  std::uint64_t workspace = 0;  // bytes the algorithm needs (at most kLtWorkspaceBytes)
};
using LtKey = std::array<std::int64_t, 18>;

/// Runs g on the current stream and returns true, or returns false having done
/// nothing where cuBLASLt has no algorithm for it (Note [cuBLASLt epilogues]).
template <class T>
bool lt_matmul(const LtGemm& g) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>);
  if (!lt_epilogues_flag().load() || g.m > INT_MAX || g.n > INT_MAX || g.k > INT_MAX) return false;
  // The heuristic reads the epilogue vectors' alignment off their pointers
  // (cublasLt.h, BIAS_POINTER and EPILOGUE_AUX_POINTER), so they go into the
  // key beside the operands'.
  const std::uint32_t align_a = alignment_of(g.a), align_b = alignment_of(g.b), align_d = alignment_of(g.d),
                      align_bias = g.bias ? alignment_of(g.bias) : 0, align_aux = g.aux ? alignment_of(g.aux) : 0;
  if ((g.bias && align_bias < 16) || (g.aux && (align_aux < 16 || g.aux_ld % 8 != 0))) return false;
  const int device = current_device();
  constexpr cudaDataType_t type = std::is_same_v<T, bf16> ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t compute =
      std::is_same_v<T, float> && tf32_enabled() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;

  cublasLtMatmulDesc_t raw = nullptr;
  PTRAIN_CHECK_CUBLAS(cublasLtMatmulDescCreate(&raw, compute, CUDA_R_32F));
  LtDesc op(raw);
  set_desc(op.get(), CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_desc(op.get(), CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_desc(op.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue);
  if (g.bias) set_desc(op.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.aux) {
    set_desc(op.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    set_desc(op.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
  }
  const auto a = lt_layout(type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda),
             b = lt_layout(type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb),
             d = lt_layout(type, g.m, g.n, g.ldd);

  const cublasLtHandle_t handle = lt_handle(device);
  thread_local std::map<LtKey, LtChoice> choices;
  const LtKey key{device,  g.m,     g.n,  g.k,     g.trans_a, g.trans_b,  g.lda,      g.ldb,     g.ldd,
                  type,    compute, g.epilogue, g.aux_ld, align_a, align_b, align_d, align_bias, align_aux};
  auto it = choices.find(key);
  if (it == choices.end()) {
    cublasLtMatmulPreference_t praw = nullptr;
    PTRAIN_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&praw));
    LtPreference pref(praw);
    const std::uint64_t ws_bytes = static_cast<std::uint64_t>(kLtWorkspaceBytes);
    PTRAIN_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                             &ws_bytes, sizeof(ws_bytes)));
    const std::pair<cublasLtMatmulPreferenceAttributes_t, std::uint32_t> aligns[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
    for (const auto& [attr, bytes] : aligns)
      PTRAIN_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref.get(), attr, &bytes, sizeof(bytes)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    LtChoice choice;
    if (cublasLtMatmulAlgoGetHeuristic(handle, op.get(), a.get(), b.get(), d.get(), d.get(), pref.get(), 1, &result,
                                       &found) == CUBLAS_STATUS_SUCCESS &&
        found > 0)
      choice = {true, result.algo, static_cast<std::uint64_t>(result.workspaceSize)};
    it = choices.emplace(key, choice).first;
  }
  if (!it->second.found) return false;
  const float alpha = 1.0f;
  const std::uint64_t need = it->second.workspace;
  Tensor<std::uint8_t> workspace;
  if (need > 0) workspace = Tensor<std::uint8_t>::empty(Shape{static_cast<std::int64_t>(need)}, Device::cuda(device));
  const cublasStatus_t status =
      cublasLtMatmul(handle, op.get(), &alpha, g.a, a.get(), g.b, b.get(), &g.beta, g.d, d.get(), g.d, d.get(),
                     &it->second.algo, need > 0 ? workspace.data() : nullptr, need, current_stream(device));
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {  // refused before it ran: the unfused kernels take this problem
    it->second.found = false;
    return false;
  }
  if (status != CUBLAS_STATUS_SUCCESS)
    ::ptrain::detail::throw_cublas_error(status, "cublasLtMatmul", __FILE__, __LINE__);
  return true;
}

template <class T>
inline constexpr bool kLtType = std::is_same_v<T, float> || std::is_same_v<T, bf16>;

}  // namespace detail

/// Turns the fused epilogues on (the default) or off for every host thread; off,
/// the functions below return false and ops:: run the unfused kernels (to
/// measure what the fusion gains, or to rule it out when chasing a wrong result).
inline void set_gemm_epilogues(bool enabled) { detail::lt_epilogues_flag().store(enabled); }
inline bool gemm_epilogues_enabled() { return detail::lt_epilogues_flag().load(); }

/// y [m, n] = x [m, k] W^T + bias (W [n, k], bias [n], all row-major and contiguous),
/// and with `gelu` pre = that sum and y = gelu(pre), as one cuBLASLt call on the
/// current stream (Note [cuBLASLt epilogues]). Returns false without doing
/// anything when the fused form does not apply.
template <class T>
bool linear_epilogue(std::int64_t m, std::int64_t n, std::int64_t k, const T* x, const T* w, const T* bias, T* y,
                     T* pre, bool gelu) {
  if constexpr (!detail::kLtType<T>) {
    return false;
  } else {
    if (m <= 0 || n <= 0 || k <= 0 || bias == nullptr || (gelu && (pre == nullptr || std::is_same_v<T, float>)))
      return false;
    // Column-major: y^T [n, m] = (W^T [k, n])^T x^T [k, m].
    detail::LtGemm g{true, false, n, m, k, w, k, x, k, y, n};
    g.epilogue = gelu ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_BIAS;
    g.bias = bias;
    if (gelu) g.aux = pre, g.aux_ld = n;
    return detail::lt_matmul<T>(g);
  }
}

/// The weight and bias gradients of y = x W^T + b as one cuBLASLt call:
/// dw [n, k] += dy^T x and dbias [n] = the column sums of dy (written, not added),
/// for dy [m, n] and x [m, k], row-major and contiguous. Returns false without
/// doing anything when the fused form does not apply.
template <class T>
bool linear_weight_grad_epilogue(std::int64_t m, std::int64_t n, std::int64_t k, const T* dy, const T* x, T* dw,
                                 T* dbias) {
  if constexpr (!detail::kLtType<T>) {
    return false;
  } else {
    if (m <= 0 || n <= 0 || k <= 0 || dbias == nullptr) return false;
    // Column-major: dw^T [k, n] += x^T [k, m] (dy^T [n, m])^T; BGRADB sums op(B)
    // over the GEMM's k (here the m rows), one value per column of dw^T.
    detail::LtGemm g{false, true, k, n, m, x, k, dy, n, dw, k, 1.0f, CUBLASLT_EPILOGUE_BGRADB, dbias};
    return detail::lt_matmul<T>(g);
  }
}

/// The gradient through a GELU and the linear layer after it, as one cuBLASLt
/// call: dpre [m, k] = gelu'(pre) * (dy [m, n] W [n, k]) and dbias [k] = the column
/// sums of dpre (written, not added): the bias gradient of the layer whose output
/// was pre. bf16 only (Note [cuBLASLt epilogues]); pre is what linear_epilogue's
/// GELU kept, [m, k] with k a multiple of 8. Returns false without doing anything
/// when the fused form does not apply.
template <class T>
bool linear_dgelu_epilogue(std::int64_t m, std::int64_t n, std::int64_t k, const T* dy, const T* w, const T* pre,
                           T* dpre, T* dbias) {
  if constexpr (!std::is_same_v<T, bf16>) {
    return false;
  } else {
    if (m <= 0 || n <= 0 || k <= 0 || pre == nullptr || dbias == nullptr) return false;
    // Column-major: dpre^T [k, m] = W^T [k, n] dy^T [n, m], the GELU input read
    // with the same layout as dpre^T, the bias gradient one value per row of dpre^T.
    detail::LtGemm g{false, false, k, m, n, w, k, dy, n, dpre, k, 0.0f, CUBLASLT_EPILOGUE_DGELU_BGRAD, dbias, pre, k};
    return detail::lt_matmul<T>(g);
  }
}

}  // namespace ptrain::kernels::cuda
