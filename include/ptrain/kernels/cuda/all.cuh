#pragma once
// Every CUDA kernel of ptrain, in dependency order. The ops layer includes this
// under #ifdef PTRAIN_CUDA and calls kernels::cuda::<name> with the arguments
// it passes to kernels::cpu::<name>, on device pointers.
//
//   check.cuh        PTRAIN_CHECK_CUDA, PTRAIN_CHECK_CUBLAS
//   device.cuh       CudaAllocator, CudaBackend (cuda:N tensors), Stream, Event, current_stream
//   gemm.cuh         cuBLAS GEMM, per-thread handle cache, set_tf32
//   elementwise.cuh  bias_add/grad, relu, gelu, dropout, axpy, scale
//   reduce.cuh       sum, sum_squares, argmax_rows, block reductions
//   softmax.cuh      softmax_rows(+backward), cross_entropy_forward/backward
//   layer_norm.cuh   layer_norm_forward/backward
//   embedding.cuh    token_ids, embedding_forward/backward (deterministic scatter-add)
//   attention.cuh    causal_attention_forward/backward (batched cuBLAS + masked softmax)
//   optimizer.cuh    sgd_update, adamw_update

#include "ptrain/kernels/cuda/check.cuh"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/gemm.cuh"
#include "ptrain/kernels/cuda/gemm_lt.cuh"
#include "ptrain/kernels/cuda/elementwise.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"
#include "ptrain/kernels/cuda/softmax.cuh"
#include "ptrain/kernels/cuda/layer_norm.cuh"
#include "ptrain/kernels/cuda/embedding.cuh"
#include "ptrain/kernels/cuda/attention.cuh"
#include "ptrain/kernels/cuda/flash_attention.cuh"
#include "ptrain/kernels/cuda/optimizer.cuh"
