#pragma once
// SentencePiece tokenizers (the tokenizer.model of Llama 1/2, Mistral, Gemma, T5...)
// through Google's library (Debian: libsentencepiece-dev), which ptrain links when the
// build finds it (CMake PTRAIN_WITH_SENTENCEPIECE, definition PTRAIN_SENTENCEPIECE).
//
//   auto tok = SentencePieceTokenizer::load("Llama-2-7b/tokenizer.model");
//   std::vector<std::int32_t> ids = tok.encode("Hello world");   // Llama 2: 15043, 3186
//   std::int32_t bos = *tok.bos_id();                            // 1: put it before each document
//
// The model is a protobuf of pieces, scores, a normalizer and options (unigram or
// BPE, byte fallback, dummy prefix, ...); the library is the one implementation of all
// of them, so ptrain wraps it instead of rewriting it. encode() is the library's
// EncodeAsIds: no BOS or EOS (Hugging Face's LlamaTokenizer adds BOS; put bos_id()
// before each document). Unlike the byte-level tokenizers, a text cannot be cut into
// parts encoded apart: the dummy prefix ("▁" before the text) would appear at each cut.

#ifndef PTRAIN_SENTENCEPIECE
#error "ptrain/data/sentencepiece.hpp needs SentencePiece: install libsentencepiece-dev (tools/install-deps.sh) \
and configure with PTRAIN_WITH_SENTENCEPIECE=AUTO or ON, so that ptrain::ptrain defines PTRAIN_SENTENCEPIECE"
#endif

#include <sentencepiece_processor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/data/bpe.hpp"
#include "ptrain/data/text.hpp"

namespace ptrain {

/// A SentencePiece model (unigram or BPE) run by Google's library.
class SentencePieceTokenizer {
 public:
  /// From a SentencePiece model file (tokenizer.model, *.spm).
  static SentencePieceTokenizer load(const std::string& path) {
    const std::string bytes = detail::read_file_bytes(path, "SentencePiece model");
    SentencePieceTokenizer t;
    t.sp_ = std::make_unique<sentencepiece::SentencePieceProcessor>();
    const auto status = t.sp_->LoadFromSerializedProto(bytes);
    PTRAIN_CHECK(status.ok() && t.sp_->GetPieceSize() > 0, DataError, "[ptrain.tokenizer.sentencepiece] '", path,
                 "' is not a SentencePiece model (", status.ok() ? "no pieces" : status.ToString(),
                 "); the file is damaged or truncated, or it is another format (Llama 3's tokenizer.model is "
                 "tiktoken ranks, read by RankedBpeTokenizer::from_tiktoken)");
    return t;
  }

  /// Number of ids (Llama 2: 32000).
  std::int64_t vocab_size() const { return sp_->GetPieceSize(); }
  /// Id of a piece as the model spells it ("<s>", "▁the"), if there is one.
  std::optional<std::int32_t> token_id(std::string_view piece) const {
    const int id = sp_->PieceToId(std::string(piece));
    if (id < 0 || id >= sp_->GetPieceSize() || sp_->IdToPiece(id) != piece) return std::nullopt;
    return id;
  }
  /// The model's beginning-of-sequence id (Llama 2: 1), if it has one.
  std::optional<std::int32_t> bos_id() const { return valid(sp_->bos_id()); }
  /// The model's end-of-sequence id (Llama 2: 2), if it has one.
  std::optional<std::int32_t> eos_id() const { return valid(sp_->eos_id()); }

  /// Token ids of UTF-8 `text` (the library's EncodeAsIds: no BOS, no EOS).
  std::vector<std::int32_t> encode(std::string_view text) const {
    // The library would replace invalid bytes silently; refuse them as the other tokenizers do.
    for (std::size_t i = 0; i < text.size();) i += detail::utf8_at(text, i).second;
    std::vector<int> ids;
    const auto status = sp_->Encode(std::string(text), &ids);
    PTRAIN_CHECK(status.ok(), DataError, "[ptrain.tokenizer.sentencepiece] encoding failed: ", status.ToString());
    return {ids.begin(), ids.end()};
  }

  /// The text of the ids (the library's decoding: "▁" becomes a space, the dummy prefix goes).
  std::string decode(const std::vector<std::int32_t>& ids) const {
    for (std::size_t i = 0; i < ids.size(); ++i)
      PTRAIN_CHECK(ids[i] >= 0 && ids[i] < vocab_size(), DataError, "[ptrain.tokenizer.id] id ", ids[i],
                   " at index ", i, " is not in the vocabulary (", vocab_size(), " ids); the ids come from "
                   "another tokenizer or a model with a padded vocabulary");
    std::string out;
    const auto status = sp_->Decode(std::vector<int>(ids.begin(), ids.end()), &out);
    PTRAIN_CHECK(status.ok(), DataError, "[ptrain.tokenizer.sentencepiece] decoding failed: ", status.ToString());
    return out;
  }

 private:
  std::optional<std::int32_t> valid(int id) const {
    if (id < 0 || id >= sp_->GetPieceSize()) return std::nullopt;
    return id;
  }

  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;  // the library's encoder; const methods are thread-safe
};

}  // namespace ptrain
