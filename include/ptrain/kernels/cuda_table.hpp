#pragma once
// The CUDA kernel table: function pointers to kernels::cuda::<name>, per element
// type, that ops/ calls for tensors on cuda:N. No CUDA header and no device code,
// so every translation unit (g++ or nvcc) sees the same definitions.
//
// Note [One definition of dispatch]
// An op is an inline function (a template) that a .cpp file built by g++ and a
// .cu file built by nvcc may both instantiate; the linker keeps one of the two
// copies. Its body therefore must not depend on the compiler: ops/ always
// dispatches through this table (`dev.is_cuda() ? table.fn(...) :
// kernels::cpu::fn(...)`), never through `#ifdef __CUDACC__`. The table is empty
// until the one CUDA translation unit of the ptrain::cuda CMake target
// (src/cuda_register.cu) fills it, together with the cuda:N device backend,
// during static initialisation. A program that does not link ptrain::cuda needs
// neither nvcc nor libcudart, and a cuda:N tensor there throws
// [ptrain.cuda.unavailable]. Filling the table twice (ptrain::cuda linked
// through two targets) stores the same pointers again, which is harmless.
// Members are null where the CUDA kernels have no form for the type (sgd_update
// for bf16, token_ids for bf16, everything but token_ids for int32); calling one
// throws [ptrain.cuda.unsupported].

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/kernels/adamw_step.hpp"
#include "ptrain/kernels/cuda_unverified.hpp"
#include "ptrain/kernels/moe_math.hpp"
#include "ptrain/kernels/pointwise_math.hpp"
#include "ptrain/kernels/rotary_freqs.hpp"
#include "ptrain/kernels/window.hpp"

namespace ptrain::kernels {

/// kernels::cuda's functions for element type T, with kernels::cpu's signatures
/// (src/cuda_register.cu assigns `&kernels::cuda::fn<T>` to each, so a mismatch
/// does not compile).
template <class T>
struct CudaKernels {
  using A = acc_t<T>;
  using I64 = std::int64_t;
  using U64 = std::uint64_t;
  using I32 = std::int32_t;

  // gemm.cuh, gemm_lt.cuh
  void (*gemm)(bool, bool, I64, I64, I64, A, const T*, I64, const T*, I64, A, T*, I64) = nullptr;
  bool (*linear_epilogue)(I64, I64, I64, const T*, const T*, const T*, T*, T*, bool) = nullptr;
  bool (*linear_weight_grad_epilogue)(I64, I64, I64, const T*, const T*, T*, T*) = nullptr;
  bool (*linear_dgelu_epilogue)(I64, I64, I64, const T*, const T*, const T*, T*, T*) = nullptr;
  // elementwise.cuh
  void (*bias_add)(I64, I64, T*, const T*) = nullptr;
  void (*bias_grad)(I64, I64, const T*, T*) = nullptr;
  void (*relu_forward)(I64, const T*, T*) = nullptr;
  void (*relu_backward)(I64, const T*, const T*, T*) = nullptr;
  void (*gelu_forward)(I64, const T*, T*) = nullptr;
  void (*gelu_backward)(I64, const T*, const T*, T*) = nullptr;
  void (*dropout)(I64, const T*, T*, double, U64, U64) = nullptr;
  void (*axpy)(I64, A, const T*, T*) = nullptr;
  void (*scale)(I64, A, T*) = nullptr;
  void (*cast_to_bf16)(I64, const T*, bf16*) = nullptr;    ///< cast<T, bf16> (T float or double)
  void (*cast_from_bf16)(I64, const bf16*, T*) = nullptr;  ///< cast<bf16, T> (T float or double)
  // reduce.cuh
  double (*sum)(I64, const T*) = nullptr;
  double (*sum_squares)(I64, const T*) = nullptr;
  void (*argmax_rows)(I64, I64, const T*, I32*) = nullptr;
  // softmax.cuh
  void (*softmax_rows)(I64, I64, const T*, T*) = nullptr;
  void (*softmax_rows_backward)(I64, I64, const T*, const T*, T*) = nullptr;
  double (*cross_entropy_forward)(I64, I64, const T*, const I32*, A*, I64&, I32, A) = nullptr;
  void (*cross_entropy_backward)(I64, I64, const T*, const A*, const I32*, I64, A, T*, I32, A) = nullptr;
  // activation.cuh
  void (*activation_forward)(I64, ActivationKind, A, const T*, T*) = nullptr;
  void (*activation_backward)(I64, ActivationKind, A, const T*, const T*, T*) = nullptr;
  void (*log_softmax_rows)(I64, I64, const T*, T*) = nullptr;
  void (*log_softmax_rows_backward)(I64, I64, const T*, const T*, T*) = nullptr;
  // loss.cuh
  void (*pointwise_loss_forward)(I64, LossKind, A, const T*, const T*, const T*, I64, const T*, I64, A*) = nullptr;
  void (*pointwise_loss_backward)(I64, LossKind, A, const T*, const T*, const T*, I64, const T*, I64, const T*, A,
                                  T*) = nullptr;
  void (*nll_forward)(I64, I64, const T*, const I32*, I32, A*, A*) = nullptr;
  void (*nll_backward)(I64, I64, const I32*, I32, const T*, A, T*) = nullptr;
  // layer_norm.cuh
  void (*layer_norm_forward)(I64, I64, const T*, const T*, const T*, A, T*, A*, A*) = nullptr;
  void (*layer_norm_backward)(I64, I64, const T*, const A*, const A*, const T*, const T*, T*, T*, T*) = nullptr;
  // rms_norm.cuh, rotary.cuh, swiglu.cuh
  void (*rms_norm_forward)(I64, I64, const T*, const T*, A, T*, A*) = nullptr;
  void (*rms_norm_backward)(I64, I64, const T*, const A*, const T*, const T*, T*, T*) = nullptr;
  void (*residual_rms_norm_forward)(I64, I64, const T*, const T*, const T*, A, T*, T*, A*) = nullptr;
  void (*residual_rms_norm_backward)(I64, I64, const T*, const A*, const T*, const T*, const T*, T*, T*) = nullptr;
  void (*rotary_apply)(I64, I64, I64, I64, const I32*, I64, const RotaryFreqs&, bool, T*) = nullptr;
  void (*swiglu_forward)(I64, const T*, const T*, T*) = nullptr;
  void (*swiglu_backward)(I64, const T*, const T*, const T*, T*, T*) = nullptr;
  // embedding.cuh
  I64 (*token_ids)(I64, const T*, I64, I32*) = nullptr;
  void (*embedding_forward)(I64, I64, const I32*, const T*, const T*, I64, T*) = nullptr;
  void (*embedding_backward)(I64, I64, const I32*, const T*, T*, T*, I64) = nullptr;
  // vocab_parallel.cuh
  void (*vocab_parallel_embedding_forward)(I64, I64, const I32*, I64, I64, const T*, const T*, I64, T*) = nullptr;
  void (*vocab_parallel_embedding_backward)(I64, I64, const I32*, I64, I64, const T*, T*, T*, I64) = nullptr;
  void (*vocab_parallel_row_max)(I64, I64, I64, const T*, A*) = nullptr;
  void (*vocab_parallel_row_sums)(I64, I64, I64, I64, const T*, const I32*, I32, A*) = nullptr;
  double (*vocab_parallel_loss)(I64, I64, const A*, const I32*, I32, I64&, I64&) = nullptr;
  void (*vocab_parallel_loss_backward)(I64, I64, I64, I64, const T*, const A*, const I32*, I32, A, T*) = nullptr;
  // attention.cuh, flash_attention.cuh
  void (*causal_attention_forward)(I64, I64, I64, I64, const T*, A, T*, T*, double, U64, U64, T*) = nullptr;
  void (*causal_attention_backward)(I64, I64, I64, I64, const T*, const T*, const T*, double, U64, U64, const T*,
                                    A, T*) = nullptr;
  bool (*flash_attention_supported)(I64, const T*) = nullptr;
  void (*flash_attention_forward)(I64, I64, I64, I64, const T*, A, double, U64, U64, T*, A*) = nullptr;
  void (*flash_attention_backward)(I64, I64, I64, I64, const T*, const T*, const A*, double, U64, U64, const T*, A,
                                   T*) = nullptr;
  // gqa_attention.cuh (float and bf16)
  void (*gqa_flash_forward)(I64, I64, I64, I64, I64, const T*, I64, const T*, const T*, I64, const I32*, I64, A, T*,
                            A*) = nullptr;
  void (*gqa_flash_backward)(I64, I64, I64, I64, I64, const T*, I64, const T*, const T*, I64, const I32*, I64,
                             const T*, const A*, const T*, A, T*, T*, T*) = nullptr;
  void (*gqa_attention_decode)(I64, I64, I64, I64, I64, const T*, const T*, const T*, I64, double, T*) = nullptr;
  // flash_tc_attention.cuh (bf16 only): q, k, v by row stride, causal or not; false
  // (nothing done) where the kernels do not take the case, and the op takes another
  bool (*flash_tc_forward)(I64, I64, I64, I64, I64, const T*, I64, const T*, const T*, I64, bool, A, T*,
                           A*) = nullptr;
  bool (*flash_tc_backward)(I64, I64, I64, I64, I64, const T*, I64, const T*, const T*, I64, bool, const T*,
                            const A*, const T*, A, T*, T*, T*) = nullptr;
  // conv.cuh (float and double)
  void (*im2col)(I64, const Window2d&, const T*, T*) = nullptr;
  void (*col2im)(I64, const Window2d&, const T*, T*) = nullptr;
  void (*max_pool2d_forward)(I64, const Window2d&, const T*, T*, I32*) = nullptr;
  void (*max_pool2d_backward)(I64, const Window2d&, const T*, const I32*, T*) = nullptr;
  void (*avg_pool2d_forward)(I64, const Window2d&, const T*, T*) = nullptr;
  void (*avg_pool2d_backward)(I64, const Window2d&, const T*, T*) = nullptr;
  // batch_norm.cuh (float and double)
  void (*batch_norm_stats)(I64, I64, I64, const T*, double*) = nullptr;
  void (*batch_norm_finalize)(I64, double, const double*, double, double, A*, A*, T*, T*) = nullptr;
  void (*batch_norm_eval_stats)(I64, const T*, const T*, double, A*, A*) = nullptr;
  void (*batch_norm_apply)(I64, I64, I64, const T*, const A*, const A*, const T*, const T*, T*) = nullptr;
  void (*batch_norm_backward_reduce)(I64, I64, I64, const T*, const T*, const A*, const A*, double*) = nullptr;
  void (*batch_norm_backward_apply)(I64, I64, I64, const T*, const T*, const A*, const A*, const T*, const double*,
                                    double, T*) = nullptr;
  void (*batch_norm_param_grads)(I64, const double*, T*, T*) = nullptr;
  // optimizer.cuh
  void (*sgd_update)(I64, T*, const T*, T*, T, T, T, bool, T, bool) = nullptr;
  void (*adamw_update)(I64, T*, const T*, T*, T*, T, T, T, T, T, I64) = nullptr;
  /// adamw_update_mixed<T>: fp32 master weights and moments, gradient in T, bf16 copy.
  void (*adamw_update_mixed)(I64, float*, const T*, float*, float*, float, float, float, float, float, I64,
                             bf16*) = nullptr;
  // fused_classifier.cuh, adamw_ranges.cuh
  void (*fused_classifier)(I64, I64, T*, const I32*, I32, A, A, double, double*) = nullptr;
  void (*sum_squares_to)(I64, const T*, double*) = nullptr;
  void (*adamw_update_ranges)(I64, I64, const I64*, const std::uint8_t*, A*, const T*, A*, A*, bf16*,
                              const AdamWStep&) = nullptr;
  // layer_norm.cuh, softmax.cuh: row kernels that read a row once (gated; the ops keep
  // layer_norm_forward/backward and softmax_rows/backward while they are)
  void (*layer_norm_forward_one_read)(I64, I64, const T*, const T*, const T*, A, T*, A*, A*) = nullptr;
  void (*layer_norm_backward_one_read)(I64, I64, const T*, const A*, const A*, const T*, const T*, T*, T*, T*) = nullptr;
  void (*residual_layer_norm_forward)(I64, I64, const T*, const T*, const T*, const T*, A, T*, T*, A*, A*) = nullptr;
  void (*residual_layer_norm_backward)(I64, I64, const T*, const A*, const A*, const T*, const T*, const T*, T*, T*,
                                       T*) = nullptr;
  void (*softmax_rows_one_read)(I64, I64, const T*, T*) = nullptr;
  void (*softmax_rows_backward_one_read)(I64, I64, const T*, const T*, T*) = nullptr;
  // moe.cuh (moe_permute_plan works on int32 only; every floating type's table has it)
  void (*moe_route)(I64, I64, I64, MoeScore, bool, A, const T*, I32*, T*, A*, A*) = nullptr;
  void (*moe_route_backward)(I64, I64, I64, MoeScore, bool, A, const T*, const I32*, const T*, const A*, const A*, A,
                             T*) = nullptr;
  void (*moe_permute_plan)(I64, I64, I64, I64, const I32*, I32*, I32*, I32*, I32*) = nullptr;
  void (*moe_gather)(I64, I64, const I32*, const T*, T*) = nullptr;
  void (*moe_gather_backward)(I64, I64, I64, const I32*, const T*, T*) = nullptr;
  void (*moe_combine)(I64, I64, I64, const I32*, const T*, const T*, T*) = nullptr;
  void (*moe_combine_backward)(I64, I64, I64, const I32*, const T*, const T*, const T*, T*, T*) = nullptr;
  // moe.cuh: the experts' grouped GEMM, one cuBLAS call for all groups (gated; the ops run
  // one gemm per group while it is)
  void (*grouped_gemm)(bool, bool, I64, const I64*, const I64*, const I64*, A, const T* const*, I64, const T* const*,
                       I64, A, T* const*, I64) = nullptr;
  // ring_attention.cuh: context parallelism's blocks (float and bf16) and strided row copies
  void (*ring_attention_block_forward)(I64, I64, I64, I64, const T*, I64, I64, const I32*, const T*, const T*, I64,
                                       I64, I64, A, T*, I64, A*, I64) = nullptr;
  void (*ring_attention_block_backward)(I64, I64, I64, I64, const T*, I64, I64, const I32*, const T*, const T*, I64,
                                        I64, I64, A, const T*, I64, const A*, I64, const T*, T*, T*, T*) = nullptr;
  void (*copy_strided_rows)(I64, I64, const T*, I64, T*, I64) = nullptr;
};

/// Host calls of CUDA graphs (kernels/cuda/graph.hpp), for code that g++ builds without
/// the toolkit's headers: the Trainer's step graph (train/step_graph.hpp, Note [CUDA
/// graphs of the step]). A graph is an opaque handle owning its capture stream.
struct CudaGraphCalls {
  void* (*create)(int device) = nullptr;          ///< a graph of `device`, empty, with a capture stream of its own
  void (*begin)(void* graph) = nullptr;           ///< makes the capture stream current and starts capturing on it
  void (*end)(void* graph) = nullptr;             ///< ends the capture, restores the stream, instantiates
  void (*abort)(void* graph) noexcept = nullptr;  ///< ends a failed capture (discarded) and restores the stream
  void (*launch)(void* graph) = nullptr;          ///< replays on the device's current stream
  void (*destroy)(void* graph) noexcept = nullptr;
  bool (*capturing)(int device) = nullptr;        ///< whether `device`'s current stream is capturing
  /// Host -> device copy queued on the current stream without waiting for the device; the
  /// source may change once it returns (the runtime stages pageable memory).
  void (*upload)(void* dst, const void* src, std::size_t bytes, int device) = nullptr;
};

/// Host calls of the data loader's copy stream (kernels/cuda/copy_stream.hpp, Note
/// [Prefetching loader] in data/loader.hpp): a side stream and an event per handle.
/// Gated as prefetch_copy_stream.
struct CudaCopyStreamCalls {
  void* (*create)(int device) = nullptr;
  void (*destroy)(void* s) noexcept = nullptr;  ///< waits for the queued copies first
  void (*begin)(void* s) = nullptr;   ///< waits for its last copies, makes the side stream current
  void (*end)(void* s) = nullptr;     ///< restores the previous stream, records the event after the copies
  std::uintptr_t (*wait)(void* s) = nullptr;  ///< the current stream waits for the event; returns its key
};

/// Every element type's table. int32 has token_ids only.
struct CudaKernelTable {
  CudaKernels<float> f32;
  CudaKernels<double> f64;
  CudaKernels<bf16> bf16_;
  CudaKernels<std::int32_t> i32;
  CudaGraphCalls graph;
  CudaCopyStreamCalls copy_stream;
};

namespace detail {
/// The process's kernel table; null until a CUDA translation unit of ptrain::cuda installs it.
inline const CudaKernelTable*& cuda_kernel_table_slot() {
  static const CudaKernelTable* table = nullptr;
  return table;
}

/// What the calling thread is capturing into a CUDA graph (null: nothing), named in the
/// error of an operation that cannot be captured (CudaBackend::copy's host reads).
inline const char*& graph_capture_what() {
  thread_local const char* what = nullptr;
  return what;
}

[[noreturn]] inline void throw_cuda_unavailable(const char* what) {
  PTRAIN_THROW(CudaError, "[ptrain.cuda.unavailable] ", what,
               " needs ptrain's CUDA kernels, which this program does not contain: link the ptrain::cuda CMake "
               "target (it compiles ptrain's one CUDA source file into the program; call enable_language(CUDA)), "
               "or compile src/cuda_register.cu from ptrain's installed sources into it");
}
}  // namespace detail

/// True when ptrain's CUDA kernels and the cuda:N backend are linked into this program
/// (the ptrain::cuda target); it says nothing about GPUs being present.
inline bool cuda_kernels_linked() { return detail::cuda_kernel_table_slot() != nullptr; }

/// The CUDA graph calls (CudaGraphCalls); throws [ptrain.cuda.unavailable] without ptrain::cuda.
inline const CudaGraphCalls& cuda_graph_calls() {
  const CudaKernelTable* t = detail::cuda_kernel_table_slot();
  if (!t) detail::throw_cuda_unavailable("a CUDA graph");
  return t->graph;
}

/// The data loader's copy-stream calls; throws [ptrain.cuda.unavailable] without ptrain::cuda.
inline const CudaCopyStreamCalls& cuda_copy_stream_calls() {
  const CudaKernelTable* t = detail::cuda_kernel_table_slot();
  if (!t) detail::throw_cuda_unavailable("the data loader's copies to a GPU");
  return t->copy_stream;
}

/// The CUDA kernels for element type T; throws [ptrain.cuda.unavailable] when the
/// program was not linked with ptrain::cuda.
template <class T>
const CudaKernels<T>& cuda_kernels() {
  const CudaKernelTable* t = detail::cuda_kernel_table_slot();
  if (!t) detail::throw_cuda_unavailable("a tensor on a CUDA device");
  if constexpr (std::is_same_v<T, float>) return t->f32;
  else if constexpr (std::is_same_v<T, double>) return t->f64;
  else if constexpr (std::is_same_v<T, bf16>) return t->bf16_;
  else if constexpr (std::is_same_v<T, std::int32_t>) return t->i32;
  else {
    static const CudaKernels<T> none{};  // every member null: calls throw [ptrain.cuda.unsupported]
    return none;
  }
}

/// The kernel `fn` of the table for T, checked: [ptrain.cuda.unsupported] when the
/// CUDA kernels have no form of it for T, [ptrain.cuda.unverified] when it is gated
/// (Note [The verification gate]).
template <class T, class Fn>
Fn cuda_kernel(Fn CudaKernels<T>::*fn, const char* name) {
  const Fn f = cuda_kernels<T>().*fn;
  PTRAIN_CHECK(f != nullptr, CudaError, "[ptrain.cuda.unsupported] ", name, " has no CUDA kernel for ",
               dtype_name(dtype_of<T>()), " tensors; use float, or move the tensors to the CPU");
  check_cuda_verified(name);
  return f;
}

/// True when the table has `fn` for T and the gate lets it run: an op with a verified
/// kernel for the same work takes that one otherwise.
template <class T, class Fn>
bool cuda_kernel_usable(Fn CudaKernels<T>::*fn, const char* name) {
  return cuda_kernels<T>().*fn != nullptr && cuda_kernel_enabled(name);
}

}  // namespace ptrain::kernels
