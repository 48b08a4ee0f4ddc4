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

// Note [GCC 12 AVX-512 warnings]
// GCC 12's own AVX-512 intrinsics (avx512fintrin.h, a system header) build
// their "undefined" operands from a self-initialised variable (`__m512 __Y =
// __Y;`), and GCC 12's -Wmaybe-uninitialized reports it once Eigen's GEMM
// kernels are inlined, in spite of the header being a system header (GCC bug
// 105593, fixed in GCC 13). Under -march=native on an AVX-512 machine that is
// some 285 warnings from third-party code in a full build. The warning is
// silenced for that header only: it is included here, first, inside a
// diagnostic push/pop, so the later #include <immintrin.h> from Eigen is a no-op
// and every warning of the user's own code still shows.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && __GNUC__ == 12 && defined(__AVX512F__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

// Functions that run on host and device. Plain `inline` without nvcc, so core
// code (bf16 conversion, Philox) also builds with g++.
#if defined(__CUDACC__)
#define PTRAIN_HOST_DEVICE __host__ __device__ inline
#else
#define PTRAIN_HOST_DEVICE inline
#endif
