#pragma once
// BatchContext: what a batch carries besides its activations (token ids,
// explicit position ids), for the layers deep inside a model that need it.
//
// Note [Batch context]
// Attention with rotary positions needs each token's position, and attention
// over packed documents (several documents in one row of S tokens, llm.c style:
// a separator token such as <|endoftext|> or <|begin_of_text|> starts each
// document) needs to know where each document starts, so that a query never
// reads keys of an earlier document and positions restart at 0. Rather than
// giving every module a second argument, the context travels with the Cache:
// whoever feeds token ids to a chain of units (UnitChain::forward_tokens, FSDP,
// a pipeline stage for each micro-batch) puts them into the root cache's
// context, and Cache::child() hands the same context to every sub-cache, so a
// layer anywhere below reads cache.context(). The context is the caller's, not
// saved state: Cache::clear() drops it, and Recompute carries it into its replay.
// Layers derive what they need from it and their own configuration (the
// separator is a property of the model, not of the batch):
//
//   starts[b, i]    = the last k <= i with ids[b, k] == separator, or 0
//   positions[b, i] = i - starts[b, i]
//   query i of row b sees keys j with starts[b, i] <= j <= i
//
// With no separator the whole row is one document (starts 0, positions 0..S-1).
// Explicit position_ids, when given, replace the positions (not the masking).

#include <cstdint>

#include "ptrain/core/tensor.hpp"

namespace ptrain::nn {

struct BatchContext {
  Tensor<std::int32_t> ids{};         ///< [B, S] the batch's token ids, as the model was fed them
  Tensor<std::int32_t> position_ids{};  ///< optional [S] or [B, S]; undefined: from the documents or 0..S-1
};

/// starts[b, i]: where token i's document begins in row b (Note [Batch context]); ids [B, S].
inline Tensor<std::int32_t> document_starts(const Tensor<std::int32_t>& ids, std::int32_t separator) {
  PTRAIN_CHECK(ids.dim() == 2, ShapeError, "[ptrain.batch_context] token ids must be [B, S], got ", ids.shape());
  PTRAIN_CHECK(ids.device().is_cpu(), Error, "[ptrain.batch_context] token ids of the batch context must be on the "
               "CPU (they are read on the host to lay out documents), got ", ids.device().str());
  const std::int64_t B = ids.size(0), S = ids.size(1);
  auto starts = Tensor<std::int32_t>::empty({B, S});
  for (std::int64_t b = 0; b < B; ++b) {
    std::int32_t start = 0;
    for (std::int64_t i = 0; i < S; ++i) {
      if (ids.data()[b * S + i] == separator) start = static_cast<std::int32_t>(i);
      starts.data()[b * S + i] = start;
    }
  }
  return starts;
}

/// positions[b, i] = i - starts[b, i]: positions that restart at each document.
inline Tensor<std::int32_t> document_positions(const Tensor<std::int32_t>& starts) {
  const std::int64_t B = starts.size(0), S = starts.size(1);
  auto pos = Tensor<std::int32_t>::empty({B, S});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < S; ++i) pos.data()[b * S + i] = static_cast<std::int32_t>(i) - starts.data()[b * S + i];
  return pos;
}

}  // namespace ptrain::nn
