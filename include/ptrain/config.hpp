#pragma once
// Build configuration: feature macros and the host/device qualifier.
//
//   PTRAIN_CUDA  defined when the translation unit is compiled by nvcc; CUDA
//                kernels (kernels/cuda/*.cuh) and the cuda:N device path are
//                available only then.
//   PTRAIN_MPI, PTRAIN_GLOO, PTRAIN_NCCL
//                set by the CMake options PTRAIN_WITH_MPI/GLOO/NCCL (interface
//                definitions of ptrain::ptrain) when those backends are linked.

#define PTRAIN_VERSION_MAJOR 0
#define PTRAIN_VERSION_MINOR 1
#define PTRAIN_VERSION_PATCH 0
#define PTRAIN_VERSION_STRING "0.1.0"

#if defined(__CUDACC__) && !defined(PTRAIN_CUDA)
#define PTRAIN_CUDA 1
#endif

// Functions that run on host and device. Plain `inline` without nvcc, so core
// code (bf16 conversion, Philox) also builds with g++.
#if defined(__CUDACC__)
#define PTRAIN_HOST_DEVICE __host__ __device__ inline
#else
#define PTRAIN_HOST_DEVICE inline
#endif
