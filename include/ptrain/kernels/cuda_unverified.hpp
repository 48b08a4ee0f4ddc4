#pragma once
// The verification gate: CUDA work that compiles and has its GPU tests but has
// not yet passed them on a GPU.
//
// Note [The verification gate]
// A GPU is seldom at hand where ptrain is developed, so CUDA kernels are written,
// compiled and tested against the CPU kernels on one machine and run on a GPU on
// another, later. Until then a kernel is on kUnverifiedCuda below, and reaching it
// through the kernel table throws CudaError [ptrain.cuda.unverified] naming it,
// unless the environment sets PTRAIN_UNVERIFIED_CUDA=1 (tools/gpu/run.sh does so
// for its test phase). Where an op has a verified kernel too, the op asks
// cuda_kernel_enabled() and keeps using the verified one while the new one is
// gated. A name leaves the list only after the GPU tests tagged [cuda:<name>]
// in tests/gpu passed on a GPU; tools/gpu/run.sh prints passed or failed per name.
// Names are the kernel table's members (kernels/cuda_table.hpp) or, for CUDA
// paths that are not a single kernel, the feature named where it is checked
// (check_cuda_verified).

#include <cstdlib>
#include <initializer_list>
#include <string_view>

#include "ptrain/core/error.hpp"

namespace ptrain::kernels {

/// Gated CUDA kernels and paths, one per line (tools/gpu/run.sh reads the quoted names).
/// const char*, not string_view: g++ 12 does not take a constant initializer_list
/// of string_views made from literals ("modification of <temporary>").
inline constexpr std::initializer_list<const char*> kUnverifiedCuda = {
    // rms_norm.cuh, rotary.cuh, swiglu.cuh
    "rms_norm_forward",
    "rms_norm_backward",
    "residual_rms_norm_forward",
    "residual_rms_norm_backward",
    "rotary_apply",
    "swiglu_forward",
    "swiglu_backward",
    // vocab_parallel.cuh
    "vocab_parallel_embedding_forward",
    "vocab_parallel_embedding_backward",
    "vocab_parallel_row_max",
    "vocab_parallel_row_sums",
    "vocab_parallel_loss",
    "vocab_parallel_loss_backward",
    // dist/staged_communicator.hpp
    "staged_communicator",
    // gqa_attention.cuh
    "gqa_flash_forward",
    "gqa_flash_backward",
    "gqa_attention_decode",
    // fused_classifier.cuh, adamw_ranges.cuh
    "fused_classifier",
    "sum_squares_to",
    "adamw_update_ranges",
    // flash_tc_attention.cuh
    "flash_tc_forward",
    "flash_tc_backward",
    // layer_norm.cuh, softmax.cuh: row kernels in one read
    "layer_norm_forward_one_read",
    "layer_norm_backward_one_read",
    "residual_layer_norm_forward",
    "residual_layer_norm_backward",
    "softmax_rows_one_read",
    "softmax_rows_backward_one_read",
    // moe.cuh
    "moe_route",
    "moe_route_backward",
    "moe_permute_plan",
    "moe_gather",
    "moe_gather_backward",
    "moe_combine",
    "moe_combine_backward",
    // dist/nccl_communicator.hpp: all_to_all and all_to_all_v as grouped ncclSend/ncclRecv
    "nccl_all_to_all",
    // kernels/cuda/graph.hpp, train/step_graph.hpp: the Trainer's step captured in a CUDA graph
    "cuda_graph_step",
    // kernels/cuda/copy_stream.hpp, data/loader.hpp: the loader's copies to the GPU on a side stream
    "prefetch_copy_stream",
    // moe.cuh: the experts' grouped GEMM (cublasGemmGroupedBatchedEx, cublasDgemmGroupedBatched)
    "grouped_gemm",
    // ring_attention.cuh: context parallelism's ring attention blocks
    "ring_attention_block_forward",
    "ring_attention_block_backward",
    "copy_strided_rows",
};

/// True when `name` is on the gate's list.
inline bool cuda_unverified(std::string_view name) {
  for (const char* n : kUnverifiedCuda)
    if (n == name) return true;
  return false;
}

/// True when the environment allows gated CUDA (PTRAIN_UNVERIFIED_CUDA=1).
inline bool unverified_cuda_allowed() {
  const char* v = std::getenv("PTRAIN_UNVERIFIED_CUDA");
  return v && std::string_view(v) == "1";
}

/// True unless `name` is gated and the environment does not allow gated CUDA.
inline bool cuda_kernel_enabled(std::string_view name) { return !cuda_unverified(name) || unverified_cuda_allowed(); }

/// Throws CudaError [ptrain.cuda.unverified] unless cuda_kernel_enabled(name).
inline void check_cuda_verified(std::string_view name) {
  PTRAIN_CHECK(cuda_kernel_enabled(name), CudaError, "[ptrain.cuda.unverified] the CUDA kernel ", name,
               " has compiled and has GPU tests but has not yet passed them on a GPU (it is on the list in "
               "ptrain/kernels/cuda_unverified.hpp); set PTRAIN_UNVERIFIED_CUDA=1 to run it anyway, or run the "
               "model on the CPU");
}

}  // namespace ptrain::kernels
