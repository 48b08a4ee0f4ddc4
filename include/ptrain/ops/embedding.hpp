#pragma once
// Token ids carried in a floating-point tensor, and embedding lookups.
//
// Models are chains of Module<T> whose activations are Tensor<T>, so the
// first unit of a language model receives its token ids as T values (exact
// in float below 2^24, in double below 2^53). token_ids() turns them into
// int32 on the same device and refuses anything that is not an id. On a cuda
// device that check reads one value back, so token_ids waits for the current
// stream (an id outside the table must not reach the gather). The backward
// scatter-add is deterministic on both devices and gives the same bits on
// both (see kernels/cuda/embedding.cuh).

#include <vector>

#include "ptrain/kernels/cpu/embedding.hpp"
#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

/// int32 copy of integral ids in [0, vocab), on x's device; ShapeError naming the first bad position and value.
/// x is float, double or int32; bf16 is refused (integers above 256 are not exact in it).
template <class T>
Tensor<std::int32_t> token_ids(const Tensor<T>& x, std::int64_t vocab) {
  if constexpr (std::is_same_v<T, bf16>) {
    PTRAIN_THROW(ShapeError, "[ptrain.embedding.bf16_ids] token ids in a bf16 tensor are not exact above 256; "
                             "pass them as an int32 tensor (GPT::forward_tokens) or as float");
  } else {
    auto ids = Tensor<std::int32_t>::empty(x.shape(), x.device());
    const std::int64_t bad = PTRAIN_DISPATCH(x.device(), T, token_ids, x.numel(), x.data(), vocab, ids.data());
    if (bad >= 0) {
      const std::int64_t cols = x.dim() >= 1 ? x.size(-1) : 1;
      const double v = static_cast<double>(x.reshape({x.numel()}).view(bad, {1}).to(Device::cpu()).data()[0]);
      PTRAIN_THROW(ShapeError, "[ptrain.embedding.id] token id ", v, " at position [", bad / cols, ", ", bad % cols,
                   "] of input ", x.shape(), " is not an integer in [0, ", vocab, "); pass token ids, not activations");
    }
    return ids;
  }
}

/// out [..., dim] = table[ids] (+ pos[position along the last id dimension] when pos is defined).
/// ids must lie in [0, table rows): they are not checked here (token_ids checks them,
/// and nn::Embedding and GPT call it).
template <class T>
Tensor<T> embedding(const Tensor<std::int32_t>& ids, const Tensor<T>& table, const Tensor<T>& pos) {
  const std::int64_t dim = table.size(1), seq = ids.dim() >= 1 ? ids.size(-1) : 1;
  std::vector<std::int64_t> shape(ids.shape().begin(), ids.shape().end());
  shape.push_back(dim);
  auto out = Tensor<T>::empty(Shape(shape), table.device());
  detail::check_devices("embedding", table.device(), ids);
  if (pos.defined()) {
    PTRAIN_CHECK(pos.size(1) == dim && seq <= pos.size(0), ShapeError, "[ptrain.embedding.positions] sequence of ",
                 seq, " tokens but only ", pos.size(0), " positions; use sequences of at most block_size tokens");
    detail::check_devices("embedding", table.device(), pos);
  }
  PTRAIN_DISPATCH(table.device(), T, embedding_forward, ids.numel(), dim, ids.data(), table.data(),
                  pos.defined() ? pos.data() : static_cast<const T*>(nullptr), seq, out.data());
  return out;
}

/// dtable[ids] += dout; dpos[position] += dout when dpos is given.
template <class T>
void embedding_backward(const Tensor<std::int32_t>& ids, const Tensor<T>& dout, const Tensor<T>& dtable_in,
                        const Tensor<T>* dpos) {
  if (dpos && !dpos->defined()) dpos = nullptr;
  if (!dtable_in.defined()) {  // a frozen table (Note [Frozen parameters] in nn/flat_parameters.hpp)
    if (!dpos) return;
    // Only the positions train: dpos[s] += dout[b, s] is a lookup backward of the ids 0..seq-1.
    const std::int64_t seq = ids.dim() >= 1 ? ids.size(-1) : 1;
    std::vector<std::int32_t> pos(static_cast<std::size_t>(ids.numel()));
    for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int32_t>(static_cast<std::int64_t>(i) % seq);
    embedding_backward(Tensor<std::int32_t>::from(pos, ids.shape()).to(ids.device()), dout, *dpos,
                       static_cast<const Tensor<T>*>(nullptr));
    return;
  }
  Tensor<T> dtable = dtable_in;
  const std::int64_t dim = dtable.size(1), seq = ids.dim() >= 1 ? ids.size(-1) : 1;
  PTRAIN_CHECK(dout.numel() == ids.numel() * dim, ShapeError, "[ptrain.embedding.backward] output gradient ",
               dout.shape(), " does not match ids ", ids.shape(), " and width ", dim);
  detail::check_devices("embedding_backward", dtable.device(), ids, dout);
  if (dpos) detail::check_devices("embedding_backward", dtable.device(), *dpos);
  PTRAIN_DISPATCH(dtable.device(), T, embedding_backward, ids.numel(), dim, ids.data(), dout.data(), dtable.data(),
                  dpos ? dpos->data() : static_cast<T*>(nullptr), seq);
}

}  // namespace ptrain::ops
