#pragma once
// GEMM on row-major buffers through Eigen.
//
//   C[M,N] = alpha * op(A) * op(B) + beta * C,  op(X) = X or X^T
//
// Row-major maps keep ptrain's layout (PyTorch's too) without copies; Eigen
// picks its packed, cache-blocked kernel for each transpose combination.

#include <Eigen/Core>
#include <cstdint>

namespace ptrain::kernels::cpu {

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

/// C = alpha * op(A) op(B) + beta * C on row-major data with leading dimensions lda, ldb, ldc.
/// A is [M,K] (or [K,M] when trans_a), B is [K,N] (or [N,K] when trans_b).
template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a,
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

}  // namespace ptrain::kernels::cpu
