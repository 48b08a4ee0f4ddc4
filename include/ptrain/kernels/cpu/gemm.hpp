#pragma once
// GEMM on row-major buffers.
//
//   C[M,N] = alpha * op(A) * op(B) + beta * C,  op(X) = X or X^T
//
// float and double go to OpenBLAS when the build has it (PTRAIN_BLAS): its
// hand-written kernels reach ~83 GFLOP/s on one core of the machines ptrain is
// tested on, Eigen's ~63 (docs/benchmarks.md), and it is the BLAS PyTorch uses
// on Debian. Otherwise, and for other element types, Eigen: row-major maps keep
// ptrain's layout without copies and Eigen picks its packed, cache-blocked
// kernel for each transpose combination.

#include "ptrain/config.hpp"  // before Eigen: Note [GCC 12 AVX-512 warnings]
#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <new>
#include <type_traits>
#include <vector>

#ifdef PTRAIN_BLAS
#include <cblas.h>
#endif

namespace ptrain::kernels::cpu {

namespace detail {
/// Allocates arrays on 64-byte boundaries, the alignment of Tensor storage.
template <class T>
struct AlignedAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  AlignedAllocator() = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, kAlign); }
  template <class U>
  bool operator==(const AlignedAllocator<U>&) const noexcept { return true; }
};
}  // namespace detail

/// Host scratch for operands of gemm. With some of OpenBLAS's x86 kernels
/// (those it picks on Haswell and Zen CPUs) how a product rounds depends on
/// where its operands sit; a malloc'd std::vector sits wherever the heap's
/// history put it, which differs between an uninterrupted run and a resumed one.
/// Scratch aligned like Tensor storage keeps results a function of the data
/// alone, as bit-exact resume needs.
template <class T>
using Scratch = std::vector<T, detail::AlignedAllocator<T>>;

namespace detail {
template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using CMap = Eigen::Map<const RowMat<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using MMap = Eigen::Map<RowMat<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

template <class T, class X, class Y>
void gemm_assign(MMap<T>& c, const X& a, const Y& b, T alpha, T beta) {
  if (beta == T(0)) {
    c.noalias() = alpha * (a * b);
  } else {
    if (beta != T(1)) c *= beta;
    c.noalias() += alpha * (a * b);
  }
}
}  // namespace detail

/// gemm through Eigen, whatever the build (the fallback; tested on its own).
template <class T>
void gemm_eigen(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a,
                std::int64_t lda, const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc) {
  using namespace detail;
  if (m == 0 || n == 0) return;
  MMap<T> cm(c, m, n, Eigen::OuterStride<>(ldc));
  if (k == 0) {
    if (beta == T(0)) cm.setZero();
    else cm *= beta;
    return;
  }
  CMap<T> am(a, trans_a ? k : m, trans_a ? m : k, Eigen::OuterStride<>(lda));
  CMap<T> bm(b, trans_b ? n : k, trans_b ? k : n, Eigen::OuterStride<>(ldb));
  if (!trans_a && !trans_b) gemm_assign<T>(cm, am, bm, alpha, beta);
  else if (!trans_a && trans_b) gemm_assign<T>(cm, am, bm.transpose(), alpha, beta);
  else if (trans_a && !trans_b) gemm_assign<T>(cm, am.transpose(), bm, alpha, beta);
  else gemm_assign<T>(cm, am.transpose(), bm.transpose(), alpha, beta);
}

/// C = alpha * op(A) op(B) + beta * C on row-major data with leading dimensions lda, ldb, ldc.
/// A is [M,K] (or [K,M] when trans_a), B is [K,N] (or [N,K] when trans_b).
template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a,
          std::int64_t lda, const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc) {
#ifdef PTRAIN_BLAS
  // BLAS rejects leading dimensions below 1, and K = 0 is Eigen's job (C = beta C).
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    if (m > 0 && n > 0 && k > 0) {
      const auto ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
      const auto M = static_cast<blasint>(m), N = static_cast<blasint>(n), K = static_cast<blasint>(k);
      const auto LDA = static_cast<blasint>(lda), LDB = static_cast<blasint>(ldb), LDC = static_cast<blasint>(ldc);
      if constexpr (std::is_same_v<T, float>) cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, a, LDA, b, LDB, beta, c, LDC);
      else cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, alpha, a, LDA, b, LDB, beta, c, LDC);
      return;
    }
  }
#endif
  gemm_eigen(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/// Threads the CPU GEMM may use (OpenBLAS's pool; Eigen's kernels here are single-threaded).
/// Launchers that start several ranks per node set OMP_NUM_THREADS=1, which OpenBLAS honours.
inline void set_num_threads(int n) {
#ifdef PTRAIN_BLAS
  openblas_set_num_threads(n);
#else
  (void)n;
#endif
}

/// The CPU has no fused GEMM epilogues (kernels/cuda/gemm_lt.cuh): these are
/// always false, and ops:: runs the GEMM, the bias, the bias gradient and the
/// activation apart.
template <class T>
bool linear_epilogue(std::int64_t, std::int64_t, std::int64_t, const T*, const T*, const T*, T*, T*, bool) {
  return false;
}
template <class T>
bool linear_weight_grad_epilogue(std::int64_t, std::int64_t, std::int64_t, const T*, const T*, T*, T*) {
  return false;
}
template <class T>
bool linear_dgelu_epilogue(std::int64_t, std::int64_t, std::int64_t, const T*, const T*, const T*, T*, T*) {
  return false;
}

}  // namespace ptrain::kernels::cpu
