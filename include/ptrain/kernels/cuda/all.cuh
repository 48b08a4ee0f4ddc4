#pragma once
// Every CUDA kernel of ptrain, in dependency order. The kernels take the
// arguments of kernels::cpu::<name>, on device pointers; ptrain::cuda's CUDA
// source (src/cuda_register.cu) puts them in the table that ops/ calls
// (kernels/cuda_table.hpp). A .cu file may also call them directly.
//
//   check.hpp        PTRAIN_CHECK_CUDA, PTRAIN_CHECK_CUBLAS (host code, g++ too)
//   stream.hpp       device_count, DeviceGuard, Stream, Event, StreamGuard, current_stream (host code)
//   backend.hpp      CudaAllocator, CudaBackend (cuda:N tensors; host code)
//   device.cuh       launch shapes, device math, bf16 loads and stores
//   gemm.cuh         cuBLAS GEMM, per-thread handle cache, set_tf32
//   elementwise.cuh  bias_add/grad, relu, gelu, dropout, axpy, scale
//   reduce.cuh       sum, sum_squares, argmax_rows, block reductions
//   softmax.cuh      softmax_rows(+backward), cross_entropy_forward/backward
//   activation.cuh   activation_forward/backward (tanh, sigmoid, silu, leaky relu), log_softmax_rows(+backward)
//   loss.cuh         pointwise_loss_forward/backward (mse, l1, smooth l1, huber, bce), nll_forward/backward
//   layer_norm.cuh   layer_norm_forward/backward
//   rms_norm.cuh     rms_norm_forward/backward, residual_rms_norm_forward/backward (fused residual add)
//   rotary.cuh       rotary_apply (rotary position embedding, Llama 3 scaling through the frequencies)
//   swiglu.cuh       swiglu_forward/backward
//   embedding.cuh    token_ids, embedding_forward/backward (deterministic scatter-add)
//   vocab_parallel.cuh  the vocabulary-parallel embedding (+backward) and cross-entropy statistics, loss (+backward)
//   attention.cuh    causal_attention_forward/backward (batched cuBLAS + masked softmax)
//   gqa_attention.cuh grouped-query flash attention (causal, documents, sliding window), backward, KV-cache decode
//   conv.cuh         im2col, col2im, max/avg pooling (float, double)
//   batch_norm.cuh   batch-norm statistics, finalisation, apply, backward (float, double)
//   optimizer.cuh    sgd_update, adamw_update
//   fused_classifier.cuh  fused_classifier (cross-entropy loss and dlogits in place, loss kept on the device)
//   adamw_ranges.cuh      adamw_update_ranges (AdamW over a flat buffer in one launch), sum_squares_to
//   moe.cuh          mixture of experts: moe_route(+backward), moe_permute_plan, moe_gather(+backward), moe_combine(+backward)
//   ring_attention.cuh  context parallelism's ring attention blocks (+backward), copy_strided_rows

#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/stream.hpp"
#include "ptrain/kernels/cuda/backend.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/gemm.cuh"
#include "ptrain/kernels/cuda/gemm_lt.cuh"
#include "ptrain/kernels/cuda/elementwise.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"
#include "ptrain/kernels/cuda/softmax.cuh"
#include "ptrain/kernels/cuda/activation.cuh"
#include "ptrain/kernels/cuda/loss.cuh"
#include "ptrain/kernels/cuda/layer_norm.cuh"
#include "ptrain/kernels/cuda/rms_norm.cuh"
#include "ptrain/kernels/cuda/rotary.cuh"
#include "ptrain/kernels/cuda/swiglu.cuh"
#include "ptrain/kernels/cuda/embedding.cuh"
#include "ptrain/kernels/cuda/vocab_parallel.cuh"
#include "ptrain/kernels/cuda/attention.cuh"
#include "ptrain/kernels/cuda/flash_attention.cuh"
#include "ptrain/kernels/cuda/gqa_attention.cuh"
#include "ptrain/kernels/cuda/flash_tc_attention.cuh"
#include "ptrain/kernels/cuda/conv.cuh"
#include "ptrain/kernels/cuda/batch_norm.cuh"
#include "ptrain/kernels/cuda/optimizer.cuh"
#include "ptrain/kernels/cuda/fused_classifier.cuh"
#include "ptrain/kernels/cuda/adamw_ranges.cuh"
#include "ptrain/kernels/cuda/moe.cuh"
#include "ptrain/kernels/cuda/ring_attention.cuh"
