#pragma once
// Text data for language models: flat token files, a character-level
// tokenizer, and random training windows.
//
//   auto text = read_text_file("corpus.txt");
//   auto tok = CharTokenizer::fit(text);                 // vocabulary: the bytes that occur
//   auto ids = tok.encode_tensor(text);                  // int32 [N]
//   RandomWindows windows(ids, block_size, seed, rank, world);
//   windows.next(batch, x, y);                           // x [batch, S] ids as T, y [batch * S] targets
//
// A token file is nanoGPT's format: the ids as raw little-endian uint16 (or
// int32) values, nothing else.
//
// Note [Random windows]
// Window g of a run starts at a position drawn from (seed, g) by the
// counter-based generator: a pure function, so every rank computes it alone.
// Batch t of rank r (of `world`) holds windows t*world*batch + r*batch + j,
// j < batch; the ranks' windows are disjoint and together they are exactly
// batch t of a single process with batch world*batch. position() counts the
// batches taken; a checkpoint saves it and set_position() resumes there.

#include <nlohmann/json.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"

namespace ptrain {

/// Element type of a flat token file.
enum class TokenFormat {
  U16,  ///< uint16 little-endian (nanoGPT's train.bin; vocabularies up to 65536)
  I32,  ///< int32 little-endian
};

namespace detail {
inline std::size_t token_bytes(TokenFormat f) { return f == TokenFormat::U16 ? 2 : 4; }

inline std::string read_file_bytes(const std::string& path, const char* what) {
  PTRAIN_CHECK(std::filesystem::is_regular_file(path), DataError, "[ptrain.data.text.missing] ", what, " '", path,
               "' does not exist or is not a regular file; check the path");
  std::ifstream in(path, std::ios::binary);
  PTRAIN_CHECK(in.good(), DataError, "[ptrain.data.text.open] cannot open ", what, " '", path,
               "'; check its permissions");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  PTRAIN_CHECK(!in.bad(), DataError, "[ptrain.data.text.read] reading ", what, " '", path, "' failed");
  return bytes;
}
}  // namespace detail

/// The whole file as bytes.
inline std::string read_text_file(const std::string& path) { return detail::read_file_bytes(path, "text file"); }

/// Reads a flat token file into int32 [N]. Checks that the size is a whole number of
/// tokens, that there is at least one, and (when vocab_size > 0) that every id is below it.
inline Tensor<std::int32_t> read_token_file(const std::string& path, TokenFormat format = TokenFormat::U16,
                                            std::int64_t vocab_size = 0) {
  const std::string bytes = detail::read_file_bytes(path, "token file");
  const std::size_t width = detail::token_bytes(format);
  PTRAIN_CHECK(!bytes.empty() && bytes.size() % width == 0, DataError, "[ptrain.data.tokens.size] token file '", path,
               "' has ", bytes.size(), " bytes, not a positive multiple of ", width, " (",
               format == TokenFormat::U16 ? "uint16" : "int32", " tokens); check the format");
  const auto n = static_cast<std::int64_t>(bytes.size() / width);
  auto out = Tensor<std::int32_t>::empty({n});
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  for (std::int64_t i = 0; i < n; ++i) {
    const unsigned char* b = p + static_cast<std::size_t>(i) * width;
    std::int64_t v;
    if (format == TokenFormat::U16) {
      v = b[0] | (b[1] << 8);
    } else {
      const std::uint32_t u = static_cast<std::uint32_t>(b[0]) | (static_cast<std::uint32_t>(b[1]) << 8) |
                              (static_cast<std::uint32_t>(b[2]) << 16) | (static_cast<std::uint32_t>(b[3]) << 24);
      v = static_cast<std::int32_t>(u);
    }
    PTRAIN_CHECK(v >= 0 && (vocab_size <= 0 || v < vocab_size), DataError, "[ptrain.data.tokens.range] token ", i,
                 " of '", path, "' is ", v, ", outside [0, ", vocab_size > 0 ? vocab_size : std::int64_t(INT32_MAX),
                 "); the file does not match the vocabulary (or the format)");
    out.data()[i] = static_cast<std::int32_t>(v);
  }
  return out;
}

/// Writes int32 tokens as a flat token file (throws if an id does not fit the format).
inline void write_token_file(const std::string& path, const Tensor<std::int32_t>& tokens,
                             TokenFormat format = TokenFormat::U16) {
  std::string bytes;
  bytes.reserve(static_cast<std::size_t>(tokens.numel()) * detail::token_bytes(format));
  for (std::int64_t i = 0; i < tokens.numel(); ++i) {
    const std::int32_t v = tokens.data()[i];
    PTRAIN_CHECK(v >= 0 && (format == TokenFormat::I32 || v < 65536), DataError, "[ptrain.data.tokens.range] token ",
                 i, " is ", v, ", which a ", format == TokenFormat::U16 ? "uint16" : "int32",
                 " token file cannot hold; use TokenFormat::I32");
    const auto u = static_cast<std::uint32_t>(v);
    for (std::size_t k = 0; k < detail::token_bytes(format); ++k) bytes.push_back(static_cast<char>((u >> (8 * k)) & 0xFF));
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  PTRAIN_CHECK(out.good(), DataError, "[ptrain.data.tokens.write] cannot write '", path,
               "'; check the directory and free space");
}

/// Character-level tokenizer: one token per byte value that occurs in the training
/// text, ids in increasing byte order (as nanoGPT's shakespeare_char).
class CharTokenizer {
 public:
  CharTokenizer() = default;
  /// Vocabulary of the distinct bytes of `text`.
  static CharTokenizer fit(std::string_view text) {
    bool seen[256] = {};
    for (unsigned char c : text) seen[c] = true;
    std::vector<unsigned char> chars;
    for (int c = 0; c < 256; ++c)
      if (seen[c]) chars.push_back(static_cast<unsigned char>(c));
    return CharTokenizer(std::move(chars));
  }
  /// Vocabulary given explicitly (distinct bytes, any order: ids follow it).
  explicit CharTokenizer(std::vector<unsigned char> chars) : chars_(std::move(chars)) {
    id_.fill(-1);
    for (std::size_t i = 0; i < chars_.size(); ++i) {
      PTRAIN_CHECK(id_[chars_[i]] < 0, DataError, "[ptrain.data.tokenizer.duplicate] byte ", int(chars_[i]),
                   " appears twice in the vocabulary");
      id_[chars_[i]] = static_cast<std::int32_t>(i);
    }
  }

  std::int64_t vocab_size() const { return static_cast<std::int64_t>(chars_.size()); }
  const std::vector<unsigned char>& chars() const { return chars_; }

  /// Ids of the bytes of `text`; DataError names the first byte outside the vocabulary.
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> out(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) {
      const auto c = static_cast<unsigned char>(text[i]);
      PTRAIN_CHECK(id_[c] >= 0, DataError, "[ptrain.data.tokenizer.unknown] byte ", int(c), " at offset ", i,
                   " is not in the vocabulary of ", chars_.size(), " characters; fit the tokenizer on this text");
      out[i] = id_[c];
    }
    return out;
  }
  /// encode() as an int32 tensor [N].
  Tensor<std::int32_t> encode_tensor(std::string_view text) const {
    auto ids = encode(text);
    return Tensor<std::int32_t>::from(ids, {static_cast<std::int64_t>(ids.size())});
  }
  std::string decode(const std::vector<std::int32_t>& ids) const {
    std::string out;
    out.reserve(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      PTRAIN_CHECK(ids[i] >= 0 && ids[i] < vocab_size(), DataError, "[ptrain.data.tokenizer.id] id ", ids[i],
                   " at index ", i, " is outside [0, ", vocab_size(), ")");
      out.push_back(static_cast<char>(chars_[static_cast<std::size_t>(ids[i])]));
    }
    return out;
  }

  /// {"type": "char", "bytes": [byte values in id order]}.
  nlohmann::json to_json() const {
    std::vector<int> bytes(chars_.begin(), chars_.end());
    return {{"type", "char"}, {"bytes", bytes}};
  }
  static CharTokenizer from_json(const nlohmann::json& j) {
    PTRAIN_CHECK(j.is_object() && j.value("type", "") == "char" && j.contains("bytes") && j["bytes"].is_array(),
                 DataError, "[ptrain.data.tokenizer.format] not a character tokenizer: expected "
                 "{\"type\": \"char\", \"bytes\": [...]}");
    std::vector<unsigned char> chars;
    for (const auto& b : j["bytes"]) {
      PTRAIN_CHECK(b.is_number_integer() && b.get<int>() >= 0 && b.get<int>() < 256, DataError,
                   "[ptrain.data.tokenizer.format] vocabulary entry ", b.dump(), " is not a byte value 0..255");
      chars.push_back(static_cast<unsigned char>(b.get<int>()));
    }
    return CharTokenizer(std::move(chars));
  }
  void save(const std::string& path) const {
    std::ofstream out(path, std::ios::trunc);
    out << to_json().dump() << "\n";
    PTRAIN_CHECK(out.good(), DataError, "[ptrain.data.tokenizer.write] cannot write '", path, "'");
  }
  static CharTokenizer load(const std::string& path) {
    const std::string text = detail::read_file_bytes(path, "tokenizer file");
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      PTRAIN_THROW(DataError, "[ptrain.data.tokenizer.format] '", path, "' is not JSON: ", e.what());
    }
    return from_json(j);
  }

 private:
  std::vector<unsigned char> chars_;
  std::array<std::int32_t, 256> id_{};
};

/// Entropy of the token frequencies in nats: the loss of the best model that ignores context.
inline double unigram_entropy(const Tensor<std::int32_t>& tokens, std::int64_t vocab_size) {
  std::vector<std::int64_t> count(static_cast<std::size_t>(vocab_size), 0);
  for (std::int64_t i = 0; i < tokens.numel(); ++i) {
    const std::int32_t t = tokens.data()[i];
    PTRAIN_CHECK(t >= 0 && t < vocab_size, DataError, "[ptrain.data.tokens.range] token ", i, " is ", t,
                 ", outside [0, ", vocab_size, ")");
    ++count[static_cast<std::size_t>(t)];
  }
  const double n = static_cast<double>(tokens.numel());
  double h = 0;
  for (std::int64_t c : count)
    if (c) h -= (static_cast<double>(c) / n) * std::log(static_cast<double>(c) / n);
  return h;
}

/// Random windows of block_size + 1 tokens (Note [Random windows]).
class RandomWindows {
 public:
  RandomWindows(Tensor<std::int32_t> tokens, std::int64_t block_size, std::uint64_t seed, int rank = 0,
                int world_size = 1)
      : tokens_(std::move(tokens)), block_(block_size), seed_(seed), rank_(rank), world_(world_size) {
    PTRAIN_CHECK(block_size > 0, DataError, "[ptrain.data.windows] block_size must be positive, got ", block_size);
    PTRAIN_CHECK(tokens_.dim() == 1 && tokens_.numel() >= block_size + 1, DataError, "[ptrain.data.windows] ",
                 tokens_.numel(), " tokens cannot hold a window of block_size + 1 = ", block_size + 1,
                 " tokens; use more data or a smaller block_size");
    PTRAIN_CHECK(world_size > 0 && rank >= 0 && rank < world_size, DataError, "[ptrain.data.windows] rank ", rank,
                 " is not in [0, ", world_size, ")");
  }

  /// First token of global window g (the same on every rank).
  std::int64_t window_start(std::uint64_t g) const {
    const auto r = detail::philox(seed_, g);
    const std::uint64_t bits = (static_cast<std::uint64_t>(r.x[0]) << 32) | r.x[1];
    const auto starts = static_cast<std::uint64_t>(tokens_.numel() - block_);
    return static_cast<std::int64_t>((static_cast<unsigned __int128>(bits) * starts) >> 64);
  }

  /// This rank's next batch: x [batch, S] receives the ids (as T) of tokens [s, s + S),
  /// y [batch * S] the targets, tokens [s + 1, s + S + 1). Advances position() by one.
  template <class T>
  void next(std::int64_t batch, Tensor<T>& x, Tensor<std::int32_t>& y) {
    if (x.shape() != Shape{batch, block_}) x = Tensor<T>::empty({batch, block_});
    if (y.shape() != Shape{batch * block_}) y = Tensor<std::int32_t>::empty({batch * block_});
    const std::uint64_t first = (static_cast<std::uint64_t>(position_) * static_cast<std::uint64_t>(world_) +
                                 static_cast<std::uint64_t>(rank_)) * static_cast<std::uint64_t>(batch);
    const std::int32_t* tok = tokens_.data();
    for (std::int64_t j = 0; j < batch; ++j) {
      const std::int64_t s = window_start(first + static_cast<std::uint64_t>(j));
      for (std::int64_t i = 0; i < block_; ++i) {
        x.data()[j * block_ + i] = static_cast<T>(tok[s + i]);
        y.data()[j * block_ + i] = tok[s + i + 1];
      }
    }
    ++position_;
  }

  /// Batches taken so far (what a checkpoint saves).
  std::int64_t position() const { return position_; }
  void set_position(std::int64_t p) {
    PTRAIN_CHECK(p >= 0, DataError, "[ptrain.data.windows] position ", p, " must be >= 0");
    position_ = p;
  }
  std::int64_t block_size() const { return block_; }
  std::uint64_t seed() const { return seed_; }
  const Tensor<std::int32_t>& tokens() const { return tokens_; }

 private:
  Tensor<std::int32_t> tokens_;
  std::int64_t block_;
  std::uint64_t seed_;
  int rank_, world_;
  std::int64_t position_ = 0;
};

}  // namespace ptrain
