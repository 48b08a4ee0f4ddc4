#pragma once
// Build configuration: feature macros and the host/device qualifier.
//
//   PTRAIN_MPI, PTRAIN_GLOO
//                set by the CMake options PTRAIN_WITH_MPI/GLOO (interface
//                definitions of ptrain::ptrain) when those backends are linked.
//   PTRAIN_NCCL  set by ptrain::cuda (the CUDA target) when NCCL was found.
//
// No header body depends on the compiler (Note [One definition of dispatch],
// kernels/cuda_table.hpp): CUDA kernels are reached through a run-time table
// that ptrain::cuda's one CUDA source fills, so .cpp and .cu files of one
// program share every inline function. The qualifier below is the exception.

#define PTRAIN_VERSION_MAJOR 0
#define PTRAIN_VERSION_MINOR 1
#define PTRAIN_VERSION_PATCH 0
#define PTRAIN_VERSION_STRING "0.1.0"

// Functions that run on host and device. Plain `inline` without nvcc, so core
// code (bf16 conversion, Philox) also builds with g++.
#if defined(__CUDACC__)
#define PTRAIN_HOST_DEVICE __host__ __device__ inline
#else
#define PTRAIN_HOST_DEVICE inline
#endif
