#pragma once
// Token ids carried in a floating-point tensor, and embedding lookups.
//
// Models are chains of Module<T> whose activations are Tensor<T>, so the
// first unit of a language model receives its token ids as T values (exact
// in float below 2^24, in double below 2^53). token_ids() turns them into
// int32 and refuses anything that is not an id. CPU only for now: the lookups
// call the CPU kernels directly and a CUDA tensor gets a CudaError.

#include <cmath>

#include "ptrain/kernels/cpu/embedding.hpp"
#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

/// int32 copy of integral ids in [0, vocab); ShapeError naming the first bad position and value.
template <class T>
Tensor<std::int32_t> token_ids(const Tensor<T>& x, std::int64_t vocab) {
  PTRAIN_CHECK(x.device().is_cpu(), CudaError, "[ptrain.embedding.cpu_only] token ids must be a cpu tensor");
  auto ids = Tensor<std::int32_t>::empty(x.shape());
  const std::int64_t cols = x.dim() >= 1 ? x.size(-1) : 1;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double v = static_cast<double>(x.data()[i]);
    PTRAIN_CHECK(std::floor(v) == v && v >= 0 && v < static_cast<double>(vocab), ShapeError,
                 "[ptrain.embedding.id] token id ", v, " at position [", i / cols, ", ", i % cols, "] of input ",
                 x.shape(), " is not an integer in [0, ", vocab, "); pass token ids, not activations");
    ids.data()[i] = static_cast<std::int32_t>(v);
  }
  return ids;
}

/// out [..., dim] = table[ids] (+ pos[position along the last id dimension] when pos is defined).
template <class T>
Tensor<T> embedding(const Tensor<std::int32_t>& ids, const Tensor<T>& table, const Tensor<T>& pos) {
  const std::int64_t dim = table.size(1), seq = ids.dim() >= 1 ? ids.size(-1) : 1;
  std::vector<std::int64_t> shape(ids.shape().begin(), ids.shape().end());
  shape.push_back(dim);
  auto out = Tensor<T>::empty(Shape(shape), table.device());
  if (pos.defined())
    PTRAIN_CHECK(pos.size(1) == dim && seq <= pos.size(0), ShapeError, "[ptrain.embedding.positions] sequence of ",
                 seq, " tokens but only ", pos.size(0), " positions; use sequences of at most block_size tokens");
  PTRAIN_CHECK(table.device().is_cpu(), CudaError, "[ptrain.embedding.cpu_only] embeddings have no CUDA kernel yet");
  kernels::cpu::embedding_forward(ids.numel(), dim, ids.data(), table.data(),
                  pos.defined() ? pos.data() : nullptr, seq, out.data());
  return out;
}

/// dtable[ids] += dout; dpos[position] += dout when dpos is given.
template <class T>
void embedding_backward(const Tensor<std::int32_t>& ids, const Tensor<T>& dout, Tensor<T>& dtable, Tensor<T>* dpos) {
  const std::int64_t dim = dtable.size(1), seq = ids.dim() >= 1 ? ids.size(-1) : 1;
  PTRAIN_CHECK(dout.numel() == ids.numel() * dim, ShapeError, "[ptrain.embedding.backward] output gradient ",
               dout.shape(), " does not match ids ", ids.shape(), " and width ", dim);
  PTRAIN_CHECK(dtable.device().is_cpu(), CudaError, "[ptrain.embedding.cpu_only] embeddings have no CUDA kernel yet");
  kernels::cpu::embedding_backward(ids.numel(), dim, ids.data(), dout.data(), dtable.data(),
                  dpos ? dpos->data() : nullptr, seq);
}

}  // namespace ptrain::ops
