// ptrain's one CUDA translation unit (the ptrain::cuda CMake target adds it to
// every program that links the target). During static initialisation it fills
// the CUDA kernel table that ops/ dispatches to (kernels/cuda_table.hpp, Note
// [One definition of dispatch]) and stores the cuda:N device backend
// (kernels/cuda/backend.hpp). Nothing here touches a device, so the program
// starts on machines without a GPU and fails only when it asks for cuda:N.
//
// Everything has internal linkage or is inline, so two copies in one program
// (ptrain::cuda reached through two targets) link, and the second registration
// stores the same pointers again.

#include "ptrain/kernels/cuda/all.cuh"
#include "ptrain/kernels/cuda/graph.hpp"
#include "ptrain/kernels/cuda/copy_stream.hpp"
#include "ptrain/kernels/cuda_table.hpp"

namespace {

namespace kc = ptrain::kernels::cuda;
using ptrain::bf16;
using ptrain::kernels::CudaKernelTable;
using ptrain::kernels::CudaKernels;

// Kernels of the floating-point element types (float, double, bf16). Each
// assignment takes the address of kernels::cuda::fn<T> as the table's type, so
// a kernel whose signature differs from the CPU's does not compile.
template <class T>
void fill_floating(CudaKernels<T>& k) {
  k.gemm = &kc::gemm<T>;
  k.linear_epilogue = &kc::linear_epilogue<T>;
  k.linear_weight_grad_epilogue = &kc::linear_weight_grad_epilogue<T>;
  k.linear_dgelu_epilogue = &kc::linear_dgelu_epilogue<T>;
  k.bias_add = &kc::bias_add<T>;
  k.bias_grad = &kc::bias_grad<T>;
  k.relu_forward = &kc::relu_forward<T>;
  k.relu_backward = &kc::relu_backward<T>;
  k.gelu_forward = &kc::gelu_forward<T>;
  k.gelu_backward = &kc::gelu_backward<T>;
  k.dropout = &kc::dropout<T>;
  k.axpy = &kc::axpy<T>;
  k.scale = &kc::scale<T>;
  k.sum = &kc::sum<T>;
  k.sum_squares = &kc::sum_squares<T>;
  k.argmax_rows = &kc::argmax_rows<T>;
  k.softmax_rows = &kc::softmax_rows<T>;
  k.softmax_rows_backward = &kc::softmax_rows_backward<T>;
  k.cross_entropy_forward = &kc::cross_entropy_forward<T>;
  k.cross_entropy_backward = &kc::cross_entropy_backward<T>;
  k.activation_forward = &kc::activation_forward<T>;
  k.activation_backward = &kc::activation_backward<T>;
  k.log_softmax_rows = &kc::log_softmax_rows<T>;
  k.log_softmax_rows_backward = &kc::log_softmax_rows_backward<T>;
  k.pointwise_loss_forward = &kc::pointwise_loss_forward<T>;
  k.pointwise_loss_backward = &kc::pointwise_loss_backward<T>;
  k.nll_forward = &kc::nll_forward<T>;
  k.nll_backward = &kc::nll_backward<T>;
  k.layer_norm_forward = &kc::layer_norm_forward<T>;
  k.layer_norm_backward = &kc::layer_norm_backward<T>;
  k.rms_norm_forward = &kc::rms_norm_forward<T>;
  k.rms_norm_backward = &kc::rms_norm_backward<T>;
  k.residual_rms_norm_forward = &kc::residual_rms_norm_forward<T>;
  k.residual_rms_norm_backward = &kc::residual_rms_norm_backward<T>;
  k.rotary_apply = &kc::rotary_apply<T>;
  k.swiglu_forward = &kc::swiglu_forward<T>;
  k.swiglu_backward = &kc::swiglu_backward<T>;
  k.embedding_forward = &kc::embedding_forward<T>;
  k.embedding_backward = &kc::embedding_backward<T>;
  k.vocab_parallel_embedding_forward = &kc::vocab_parallel_embedding_forward<T>;
  k.vocab_parallel_embedding_backward = &kc::vocab_parallel_embedding_backward<T>;
  k.vocab_parallel_row_max = &kc::vocab_parallel_row_max<T>;
  k.vocab_parallel_row_sums = &kc::vocab_parallel_row_sums<T>;
  k.vocab_parallel_loss = &kc::vocab_parallel_loss<T>;
  k.vocab_parallel_loss_backward = &kc::vocab_parallel_loss_backward<T>;
  k.causal_attention_forward = &kc::causal_attention_forward<T>;
  k.causal_attention_backward = &kc::causal_attention_backward<T>;
  k.flash_attention_supported = &kc::flash_attention_supported<T>;
  k.flash_attention_forward = &kc::flash_attention_forward<T>;
  k.flash_attention_backward = &kc::flash_attention_backward<T>;
  if constexpr (!std::is_same_v<T, double>) {  // float and bf16 kernels only
    k.gqa_flash_forward = &kc::gqa_flash_forward<T>;
    k.gqa_flash_backward = &kc::gqa_flash_backward<T>;
    k.gqa_attention_decode = &kc::gqa_attention_decode<T>;
  }
  k.fused_classifier = &kc::fused_classifier<T>;
  k.sum_squares_to = &kc::sum_squares_to<T>;
  k.adamw_update_ranges = &kc::adamw_update_ranges<T>;
  k.layer_norm_forward_one_read = &kc::layer_norm_forward_one_read<T>;
  k.layer_norm_backward_one_read = &kc::layer_norm_backward_one_read<T>;
  k.residual_layer_norm_forward = &kc::residual_layer_norm_forward<T>;
  k.residual_layer_norm_backward = &kc::residual_layer_norm_backward<T>;
  k.softmax_rows_one_read = &kc::softmax_rows_one_read<T>;
  k.softmax_rows_backward_one_read = &kc::softmax_rows_backward_one_read<T>;
  k.moe_route = &kc::moe_route<T>;
  k.moe_route_backward = &kc::moe_route_backward<T>;
  k.moe_permute_plan = &kc::moe_permute_plan;
  k.moe_gather = &kc::moe_gather<T>;
  k.moe_gather_backward = &kc::moe_gather_backward<T>;
  k.moe_combine = &kc::moe_combine<T>;
  k.moe_combine_backward = &kc::moe_combine_backward<T>;
  k.grouped_gemm = &kc::grouped_gemm<T>;
  if constexpr (!std::is_same_v<T, double>) {  // float and bf16 kernels only
    k.ring_attention_block_forward = &kc::ring_attention_block_forward<T>;
    k.ring_attention_block_backward = &kc::ring_attention_block_backward<T>;
  }
  k.copy_strided_rows = &kc::copy_strided_rows<T>;
}

// float and double: the forms bf16 has not (token ids, the plain optimizer
// updates, convolution, pooling and batch norm) and the casts to and from bf16.
template <class T>
void fill_full_precision(CudaKernels<T>& k) {
  fill_floating(k);
  k.token_ids = &kc::token_ids<T>;
  k.cast_to_bf16 = &kc::cast<T, bf16>;
  k.cast_from_bf16 = &kc::cast<bf16, T>;
  k.sgd_update = &kc::sgd_update<T>;
  k.adamw_update = &kc::adamw_update<T>;
  k.im2col = &kc::im2col<T>;
  k.col2im = &kc::col2im<T>;
  k.max_pool2d_forward = &kc::max_pool2d_forward<T>;
  k.max_pool2d_backward = &kc::max_pool2d_backward<T>;
  k.avg_pool2d_forward = &kc::avg_pool2d_forward<T>;
  k.avg_pool2d_backward = &kc::avg_pool2d_backward<T>;
  k.batch_norm_stats = &kc::batch_norm_stats<T>;
  k.batch_norm_finalize = &kc::batch_norm_finalize<T>;
  k.batch_norm_eval_stats = &kc::batch_norm_eval_stats<T>;
  k.batch_norm_apply = &kc::batch_norm_apply<T>;
  k.batch_norm_backward_reduce = &kc::batch_norm_backward_reduce<T>;
  k.batch_norm_backward_apply = &kc::batch_norm_backward_apply<T>;
  k.batch_norm_param_grads = &kc::batch_norm_param_grads<T>;
}

CudaKernelTable make_table() {
  CudaKernelTable t;
  fill_full_precision(t.f32);
  fill_full_precision(t.f64);
  fill_floating(t.bf16_);
  t.f32.adamw_update_mixed = &kc::adamw_update_mixed<float>;
  t.bf16_.adamw_update_mixed = &kc::adamw_update_mixed<bf16>;
  t.i32.token_ids = &kc::token_ids<std::int32_t>;
  t.bf16_.flash_tc_forward = &kc::flash_tc_forward<bf16>;
  t.bf16_.flash_tc_backward = &kc::flash_tc_backward<bf16>;
  kc::fill_graph_calls(t.graph);
  kc::fill_copy_stream_calls(t.copy_stream);
  return t;
}

const bool registered = [] {
  static const CudaKernelTable table = make_table();
  ptrain::kernels::detail::cuda_kernel_table_slot() = &table;
  kc::register_backend();
  return true;
}();

}  // namespace
