#pragma once
// One entry point for the tokenizers of GPT-2, Llama 3 and SentencePiece models: load
// a folder or a file, and the kind is picked from what is there.
//
//   auto tok = Tokenizer::load("Meta-Llama-3-8B");       // tokenizer.json
//   auto ids = tok.encode("Hello world");
//   std::optional<std::int32_t> sep = tok.document_separator();   // <|begin_of_text|>
//
// Note [Tokenizer detection]
// A folder: vocab.json + merges.txt or encoder.json + vocab.bpe (GPT-2, BpeTokenizer,
// unchanged), else tokenizer.json (RankedBpeTokenizer), else tokenizer.model, then
// original/tokenizer.model (Meta's layout), read as a file. A file, by its first bytes:
// '{' is a tokenizer.json (a vocab.json or encoder.json file stands for its folder);
// a first line "base64 digits" is tiktoken ranks; a protobuf whose first field is a
// piece (byte 0x0A) is a SentencePiece model. SentencePiece needs a build with
// PTRAIN_SENTENCEPIECE; the class is the same either way for a given build (the
// definition is an interface definition of ptrain::ptrain, so every translation unit
// of a program sees the same one).

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/data/bpe.hpp"
#include "ptrain/data/ranked_bpe.hpp"
#ifdef PTRAIN_SENTENCEPIECE
#include "ptrain/data/sentencepiece.hpp"
#endif

namespace ptrain {

/// A GPT-2, Llama 3 (tokenizer.json or tiktoken) or SentencePiece tokenizer
/// (Note [Tokenizer detection]).
class Tokenizer {
 public:
  enum class Kind { Gpt2, TokenizerJson, Tiktoken, SentencePiece };

  /// From a folder or a file; the kind is picked by content.
  static Tokenizer load(const std::string& path) {
    namespace fs = std::filesystem;
    const fs::path p(path);
    if (fs::is_directory(p)) {
      for (const auto& [vocab, merges] : {std::pair{"vocab.json", "merges.txt"}, std::pair{"encoder.json", "vocab.bpe"}})
        if (fs::is_regular_file(p / vocab) && fs::is_regular_file(p / merges))
          return Tokenizer(BpeTokenizer::load(path), Kind::Gpt2);
      for (const char* name : {"tokenizer.json", "tokenizer.model", "original/tokenizer.model"})
        if (fs::is_regular_file(p / name)) return load((p / name).string());
      PTRAIN_THROW(DataError, "[ptrain.tokenizer.missing] '", path, "' holds no tokenizer: none of vocab.json + ",
                   "merges.txt, encoder.json + vocab.bpe (GPT-2), tokenizer.json (Hugging Face) or tokenizer.model ",
                   "(Llama 3's tiktoken ranks, or SentencePiece); pass the model's folder or one of these files");
    }
    PTRAIN_CHECK(fs::is_regular_file(p), DataError, "[ptrain.tokenizer.missing] '", path,
                 "' does not exist; pass a tokenizer's folder or file");
    const std::string name = p.filename().string();
    if (name == "vocab.json" || name == "encoder.json") return load(p.parent_path().string());
    std::string head(4096, '\0');
    {
      std::ifstream in(p, std::ios::binary);
      in.read(head.data(), static_cast<std::streamsize>(head.size()));
      head.resize(static_cast<std::size_t>(in.gcount()));
    }
    const std::size_t first = head.find_first_not_of(" \t\r\n");
    if (first != std::string::npos && head[first] == '{')
      return Tokenizer(RankedBpeTokenizer::from_tokenizer_json(path), Kind::TokenizerJson);
    if (looks_like_tiktoken(head)) return Tokenizer(RankedBpeTokenizer::from_tiktoken(path), Kind::Tiktoken);
    PTRAIN_CHECK(!head.empty() && head[0] == '\x0A', DataError, "[ptrain.tokenizer.format] '", path,
                 "' is neither a tokenizer.json, tiktoken ranks nor a SentencePiece model; pass a tokenizer's ",
                 "folder or one of these files");
#ifdef PTRAIN_SENTENCEPIECE
    return Tokenizer(SentencePieceTokenizer::load(path), Kind::SentencePiece);
#else
    PTRAIN_THROW(DataError, "[ptrain.tokenizer.sentencepiece] '", path, "' is a SentencePiece model, and this ",
                 "build has no SentencePiece: install libsentencepiece-dev (tools/install-deps.sh) and configure ",
                 "again with PTRAIN_WITH_SENTENCEPIECE=AUTO or ON");
#endif
  }

  Kind kind() const { return kind_; }
  /// The kind in words, for logs: "GPT-2 BPE", "tokenizer.json BPE", ...
  const char* kind_name() const {
    switch (kind_) {
      case Kind::Gpt2: return "GPT-2 BPE";
      case Kind::TokenizerJson: return "tokenizer.json BPE";
      case Kind::Tiktoken: return "tiktoken BPE";
      case Kind::SentencePiece: return "SentencePiece";
    }
    return "?";
  }
  /// Number of ids (the largest + 1).
  std::int64_t vocab_size() const {
    return std::visit([](const auto& t) { return t.vocab_size(); }, impl_);
  }
  /// Id of a special token or a token as the vocabulary spells it ("<|endoftext|>",
  /// "<|begin_of_text|>", "<s>"), if there is one.
  std::optional<std::int32_t> token_id(std::string_view token) const {
    return std::visit([&](const auto& t) { return t.token_id(token); }, impl_);
  }
  /// The id to put before each document: <|endoftext|> where the vocabulary has it
  /// (GPT-2, as nanoGPT and llm.c), else <|begin_of_text|> (Llama 3), else a
  /// SentencePiece model's BOS (<s> of Llama 2 and Mistral); nullopt if none.
  std::optional<std::int32_t> document_separator() const {
    for (const char* name : {"<|endoftext|>", "<|begin_of_text|>"})
      if (const auto id = token_id(name)) return id;
    return std::visit(
        [](const auto& t) -> std::optional<std::int32_t> {
          if constexpr (requires { t.bos_id(); }) return t.bos_id();
          else return std::nullopt;
        },
        impl_);
  }

  /// Token ids of UTF-8 `text`; special tokens' text is ordinary text, no BOS is added.
  std::vector<std::int32_t> encode(std::string_view text) const {
    return std::visit([&](const auto& t) { return t.encode(text); }, impl_);
  }
  /// Whether text cut at detail::piece_boundary_after encodes in parts (encode_to) to
  /// the ids of the whole: true for the byte-level BPEs, false for SentencePiece (its
  /// dummy prefix would start every part).
  bool splits_at_piece_boundaries() const { return kind_ != Kind::SentencePiece; }
  /// Encodes text[from, to) as if it were the whole text; sink(ids) gets the ids, a
  /// piece at a time for the byte-level BPEs, at once for SentencePiece.
  template <class F>
  void encode_to(std::string_view text, F&& sink, std::size_t from = 0,
                 std::size_t to = std::string_view::npos) const {
    std::visit(
        [&](const auto& t) {
          if constexpr (requires { t.encode_to(text, sink, from, to); }) {
            t.encode_to(text, sink, from, to);
          } else {
            const std::size_t end = std::min(to, text.size());
            const std::vector<std::int32_t> ids = t.encode(text.substr(from, end - std::min(from, end)));
            sink(ids);
          }
        },
        impl_);
  }
  /// The text of the ids.
  std::string decode(const std::vector<std::int32_t>& ids) const {
    return std::visit([&](const auto& t) { return t.decode(ids); }, impl_);
  }

 private:
#ifdef PTRAIN_SENTENCEPIECE
  using Impl = std::variant<BpeTokenizer, RankedBpeTokenizer, SentencePieceTokenizer>;
#else
  using Impl = std::variant<BpeTokenizer, RankedBpeTokenizer>;
#endif
  template <class T>
  Tokenizer(T t, Kind kind) : impl_(std::move(t)), kind_(kind) {}

  // A first line "base64 digits": tiktoken ranks.
  static bool looks_like_tiktoken(std::string_view head) {
    const std::string_view line = head.substr(0, head.find('\n'));
    const std::size_t space = line.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 == line.size()) return false;
    auto in = [](std::string_view s, auto ok) { return std::all_of(s.begin(), s.end(), ok); };
    return in(line.substr(0, space),
              [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '/' || c == '='; }) &&
           in(line.substr(space + 1), [](char c) { return (c >= '0' && c <= '9') || c == '\r'; });
  }

  Impl impl_;
  Kind kind_;
};

}  // namespace ptrain
