#pragma once
// Text data for language models: token files, a character-level tokenizer,
// and random training windows.
//
//   auto text = read_text_file("corpus.txt");
//   auto tok = CharTokenizer::fit(text);                 // vocabulary: the bytes that occur
//   auto ids = tok.encode_tensor(text);                  // int32 [N]
//   RandomWindows windows(ids, block_size, seed, rank, world);
//   windows.next(batch, x, y);                           // x [batch, S] ids as T, y [batch * S] targets
//
//   auto corpus = TokenCorpus::open(glob_paths({"data/fineweb_train_*.bin"}));   // mapped, not read
//   RandomWindows windows(corpus, block_size, seed, rank, world, /*vocab_size=*/50304);
//
// Note [Token files]
// nanoGPT's train.bin / val.bin hold the ids as raw little-endian values,
// uint16 (TokenFormat::U16) or int32, nothing else. llm.c's shards (its
// dev/data scripts) start with a header of 256 little-endian int32: [0] =
// 20240520 (magic), [1] = version (1: uint16 ids, GPT-2; 2: uint32 ids, Llama 3),
// [2] = number of tokens; the ids follow at byte 1024. A file that starts with
// the magic is read as a shard whatever format is asked for, and its size must
// be 1024 + count * width. TokenCorpus maps its files instead of reading them:
// a run touches only the pages of its windows, so corpora larger than memory
// work, and RandomWindows checks each id against the vocabulary as it copies
// it (a corrupt id fails the batch that meets it, naming the file and offset).
//
// Note [Random windows]
// Window g of a run starts at a position drawn from (seed, g) by the
// counter-based generator: a pure function, so every rank computes it alone.
// Batch t of rank r (of `world`) holds windows t*world*batch + r*batch + j,
// j < batch; the ranks' windows are disjoint and together they are exactly
// batch t of a single process with batch world*batch. position() counts the
// batches taken; a checkpoint saves it and set_position() resumes there.

#include <glob.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/core/mapped_file.hpp"
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

// Id v, token i of `where`, must lie in [0, vocab_size) (vocab_size <= 0: [0, 2^31)).
inline std::int64_t checked_id(std::int64_t v, std::int64_t vocab_size, std::int64_t i, const std::string& where) {
  PTRAIN_CHECK(v >= 0 && (vocab_size <= 0 || v < vocab_size), DataError, "[ptrain.data.tokens.range] token ", i,
               " of ", where, " is ", v, ", outside [0, ", vocab_size > 0 ? vocab_size : std::int64_t(INT32_MAX),
               "); the file does not match the vocabulary size (or its format)");
  return v;
}

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

namespace detail {
// Writes `head` and then ids[0, n) as little-endian values of `width` bytes to `path`:
// whole or not at all (written beside it, then renamed). An id that does not fit
// names `what` is written and, for 2-byte ids, `wider` (how to write wider ones).
inline void write_ids(const std::string& path, std::string head, const std::int32_t* ids, std::size_t n,
                      std::size_t width, const char* what, const char* wider) {
  std::string bytes = std::move(head);
  bytes.reserve(bytes.size() + n * width);
  for (std::size_t i = 0; i < n; ++i) {
    PTRAIN_CHECK(ids[i] >= 0 && (width == 4 || ids[i] < 65536), DataError, "[ptrain.data.tokens.range] token ", i,
                 " is ", ids[i], ", which a ", what, " cannot hold", width == 2 ? "; " : "", width == 2 ? wider : "");
    const auto u = static_cast<std::uint32_t>(ids[i]);
    for (std::size_t k = 0; k < width; ++k) bytes.push_back(static_cast<char>((u >> (8 * k)) & 0xFF));
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    PTRAIN_CHECK(out.good(), DataError, "[ptrain.data.tokens.write] cannot write '", tmp,
                 "'; check the directory and free space");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  PTRAIN_CHECK(!ec, DataError, "[ptrain.data.tokens.write] cannot rename '", tmp, "' to '", path, "': ", ec.message());
}
}  // namespace detail

/// Writes int32 tokens as a flat token file (throws if an id does not fit the format);
/// the file appears whole or not at all.
inline void write_token_file(const std::string& path, const Tensor<std::int32_t>& tokens,
                             TokenFormat format = TokenFormat::U16) {
  detail::write_ids(path, {}, tokens.data(), static_cast<std::size_t>(tokens.numel()), detail::token_bytes(format),
                    format == TokenFormat::U16 ? "uint16 token file" : "int32 token file", "use TokenFormat::I32");
}

/// Writes ids as an llm.c token shard (Note [Token files]): the 1024-byte header, then
/// uint16 ids (version 1, GPT-2) or, with `uint32_ids`, uint32 ids (version 2). The file
/// appears whole or not at all.
inline void write_token_shard(const std::string& path, const std::vector<std::int32_t>& ids, bool uint32_ids = false) {
  PTRAIN_CHECK(!ids.empty() && ids.size() <= static_cast<std::size_t>(INT32_MAX), DataError,
               "[ptrain.data.tokens.write] an llm.c shard holds 1 to 2^31-1 tokens, not ", ids.size());
  const std::int32_t header[256] = {20240520, uint32_ids ? 2 : 1, static_cast<std::int32_t>(ids.size())};
  detail::write_ids(path, std::string(reinterpret_cast<const char*>(header), sizeof header), ids.data(), ids.size(),
                    uint32_ids ? 4 : 2, uint32_ids ? "uint32 shard" : "uint16 shard", "write uint32 ids (version 2)");
}

/// The files that glob patterns match, each pattern's matches in name order
/// (llm.c's "fineweb_train_*.bin"); an entry without *, ? or [ stays as it is.
inline std::vector<std::string> glob_paths(const std::vector<std::string>& patterns) {
  std::vector<std::string> out;
  for (const std::string& pat : patterns) {
    if (pat.find_first_of("*?[") == std::string::npos) {
      out.push_back(pat);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(pat.c_str(), 0, nullptr, &g);
    for (std::size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    PTRAIN_CHECK(rc == 0, DataError, "[ptrain.data.tokens.missing] no file matches '", pat,
                 "'; check the path (quote the pattern so that the shell passes it on)");
  }
  return out;
}

/// Token ids where they lie: an int32 tensor in memory, or token files mapped
/// from disk (Note [Token files]), one part per file in the given order (e.g.
/// llm.c's shards). Copies share the tensor and the mappings.
class TokenCorpus {
 public:
  /// The ids of an in-memory int32 tensor [N] (e.g. CharTokenizer::encode_tensor).
  TokenCorpus(Tensor<std::int32_t> ids) {  // NOLINT: implicit, so a tensor serves wherever a corpus does
    PTRAIN_CHECK(ids.dim() == 1 && ids.device().is_cpu(), DataError,
                 "[ptrain.data.tokens.tensor] token ids must be a 1-D CPU int32 tensor, got shape ", ids.shape().str(),
                 " on ", ids.device().str());
    auto state = std::make_shared<State>();
    state->parts.push_back({reinterpret_cast<const std::uint8_t*>(ids.data()), ids.numel(), 4, "memory"});
    state->ids = std::move(ids);
    state_ = std::move(state);
  }

  /// Maps the files, at least one, as parts in this order. `format` is the width of
  /// raw files: llm.c shards say theirs (Note [Token files]).
  static TokenCorpus open(const std::vector<std::string>& paths, TokenFormat format = TokenFormat::U16) {
    PTRAIN_CHECK(!paths.empty(), DataError, "[ptrain.data.tokens.missing] no token file given");
    auto state = std::make_shared<State>();
    for (const std::string& path : paths) {
      PTRAIN_CHECK(std::filesystem::is_regular_file(path), DataError, "[ptrain.data.tokens.missing] token file '",
                   path, "' does not exist or is not a regular file; check the path");
      auto file = std::make_shared<detail::MappedFile<DataError>>(path, "[ptrain.data.tokens.open]",
                                                                 "check the path and its permissions");
      state->parts.push_back(parse(*file, format));
      state->files.push_back(std::move(file));
    }
    TokenCorpus c;
    c.state_ = std::move(state);
    return c;
  }

  std::size_t num_parts() const { return state_->parts.size(); }
  std::int64_t part_size(std::size_t p) const { return state_->parts.at(p).size; }
  /// The file of part p ("memory" for a tensor).
  const std::string& part_name(std::size_t p) const { return state_->parts.at(p).name; }
  /// Tokens in all parts.
  std::int64_t size() const {
    std::int64_t n = 0;
    for (const auto& part : state_->parts) n += part.size;
    return n;
  }
  /// Token i of part p, unchecked: uint16 or int32 as stored.
  std::int64_t at(std::size_t p, std::int64_t i) const {
    const Part& part = state_->parts[p];
    const std::uint8_t* b = part.data + static_cast<std::size_t>(i) * static_cast<std::size_t>(part.width);
    if (part.width == 2) return b[0] | (b[1] << 8);
    std::int32_t v;
    std::memcpy(&v, b, sizeof v);  // little-endian hosts only (as the checkpoints)
    return v;
  }
  /// "N tokens in K file(s)" or "N tokens in memory".
  std::string describe() const {
    const auto n = std::to_string(size());
    return state_->files.empty() ? n + " tokens in memory"
                                 : n + " tokens in " + std::to_string(state_->files.size()) + " file(s)";
  }

 private:
  struct Part {
    const std::uint8_t* data;
    std::int64_t size;  // tokens
    int width;          // bytes per token
    std::string name;
  };
  struct State {
    std::vector<Part> parts;
    std::vector<std::shared_ptr<detail::MappedFile<DataError>>> files;  // keep the mappings alive
    Tensor<std::int32_t> ids;                                             // or the tensor
  };
  TokenCorpus() = default;

  static Part parse(const detail::MappedFile<DataError>& f, TokenFormat format) {
    constexpr std::int32_t kMagic = 20240520;
    constexpr std::size_t kHeader = 256 * sizeof(std::int32_t);
    std::int32_t head[3] = {};
    if (f.size() >= sizeof head) std::memcpy(head, f.data(), sizeof head);
    if (head[0] == kMagic) {  // an llm.c shard
      PTRAIN_CHECK(head[1] == 1 || head[1] == 2, DataError, "[ptrain.data.tokens.header] '", f.path(),
                   "' is an llm.c token shard of version ", head[1], "; only 1 (uint16 ids) and 2 (uint32 ids) exist");
      const int width = head[1] == 1 ? 2 : 4;
      const std::size_t want = kHeader + static_cast<std::size_t>(std::max(head[2], 0)) * width;
      PTRAIN_CHECK(head[2] > 0 && f.size() == want, DataError, "[ptrain.data.tokens.size] '", f.path(),
                   "' is an llm.c token shard whose header says ", head[2], " tokens (", want, " bytes) but it has ",
                   f.size(), " bytes; the file is truncated or corrupt: write it again");
      return {f.data() + kHeader, head[2], width, f.path()};
    }
    const int width = static_cast<int>(detail::token_bytes(format));
    PTRAIN_CHECK(f.size() > 0 && f.size() % static_cast<std::size_t>(width) == 0, DataError,
                 "[ptrain.data.tokens.size] token file '", f.path(), "' has ", f.size(),
                 " bytes, not a positive multiple of ", width, " (", format == TokenFormat::U16 ? "uint16" : "int32",
                 " tokens); check the format");
    return {f.data(), static_cast<std::int64_t>(f.size()) / width, width, f.path()};
  }

  std::shared_ptr<const State> state_;
};

/// Reads a token file (Note [Token files]) into int32 [N]. Checks that the size fits
/// the format, that there is at least one token, and (when vocab_size > 0) that every
/// id is below it.
inline Tensor<std::int32_t> read_token_file(const std::string& path, TokenFormat format = TokenFormat::U16,
                                            std::int64_t vocab_size = 0) {
  const TokenCorpus file = TokenCorpus::open({path}, format);
  const std::int64_t n = file.part_size(0);
  auto out = Tensor<std::int32_t>::empty({n});
  for (std::int64_t i = 0; i < n; ++i)
    out.data()[i] = static_cast<std::int32_t>(detail::checked_id(file.at(0, i), vocab_size, i, path));
  return out;
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
    PTRAIN_CHECK(j.is_object() && j.contains("type") && j["type"] == "char" && j.contains("bytes") &&
                     j["bytes"].is_array(),
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
inline double unigram_entropy(const TokenCorpus& tokens, std::int64_t vocab_size) {
  PTRAIN_CHECK(vocab_size > 0, DataError, "[ptrain.data.tokens.range] vocabulary size ", vocab_size, " must be > 0");
  std::vector<std::int64_t> count(static_cast<std::size_t>(vocab_size), 0);
  for (std::size_t p = 0; p < tokens.num_parts(); ++p)
    for (std::int64_t i = 0; i < tokens.part_size(p); ++i)
      ++count[static_cast<std::size_t>(detail::checked_id(tokens.at(p, i), vocab_size, i, tokens.part_name(p)))];
  const double n = static_cast<double>(tokens.size());
  double h = 0;
  for (std::int64_t c : count)
    if (c) h -= (static_cast<double>(c) / n) * std::log(static_cast<double>(c) / n);
  return h;
}

/// Random windows of block_size + 1 tokens (Note [Random windows]); a window
/// lies inside one part of the corpus (one file), every start equally likely.
class RandomWindows {
 public:
  /// vocab_size > 0: every id copied must be below it (DataError otherwise).
  RandomWindows(TokenCorpus tokens, std::int64_t block_size, std::uint64_t seed, int rank = 0, int world_size = 1,
                std::int64_t vocab_size = 0)
      : tokens_(std::move(tokens)), block_(block_size), seed_(seed), rank_(rank), world_(world_size),
        vocab_(vocab_size) {
    PTRAIN_CHECK(block_size > 0, DataError, "[ptrain.data.windows] block_size must be positive, got ", block_size);
    for (std::size_t p = 0; p < tokens_.num_parts(); ++p)
      cum_starts_.push_back((p == 0 ? 0 : cum_starts_.back()) + std::max<std::int64_t>(tokens_.part_size(p) - block_, 0));
    PTRAIN_CHECK(cum_starts_.back() > 0, DataError, "[ptrain.data.windows] ", tokens_.describe(),
                 ": no part holds a window of block_size + 1 = ", block_size + 1,
                 " tokens; use more data or a smaller block_size");
    PTRAIN_CHECK(world_size > 0 && rank >= 0 && rank < world_size, DataError, "[ptrain.data.windows] rank ", rank,
                 " is not in [0, ", world_size, ")");
  }

  /// Part and first token of global window g (the same on every rank).
  std::pair<std::size_t, std::int64_t> window_start(std::uint64_t g) const {
    const auto r = detail::philox(seed_, g);
    const std::uint64_t bits = (static_cast<std::uint64_t>(r.x[0]) << 32) | r.x[1];
    const auto s = static_cast<std::int64_t>(
        (static_cast<unsigned __int128>(bits) * static_cast<std::uint64_t>(cum_starts_.back())) >> 64);
    // cum_starts_[p] is the number of starts in parts 0..p.
    const auto p = static_cast<std::size_t>(std::upper_bound(cum_starts_.begin(), cum_starts_.end(), s) -
                                            cum_starts_.begin());
    return {p, s - (p == 0 ? 0 : cum_starts_[p - 1])};
  }

  /// This rank's next batch: x [batch, S] receives the ids (as T) of tokens [s, s + S),
  /// y [batch * S] the targets, tokens [s + 1, s + S + 1). Advances position() by one.
  template <class T>
  void next(std::int64_t batch, Tensor<T>& x, Tensor<std::int32_t>& y) {
    if (x.shape() != Shape{batch, block_}) x = Tensor<T>::empty({batch, block_});
    if (y.shape() != Shape{batch * block_}) y = Tensor<std::int32_t>::empty({batch * block_});
    const std::uint64_t first = (static_cast<std::uint64_t>(position_) * static_cast<std::uint64_t>(world_) +
                                 static_cast<std::uint64_t>(rank_)) * static_cast<std::uint64_t>(batch);
    for (std::int64_t j = 0; j < batch; ++j) {
      const auto [p, s] = window_start(first + static_cast<std::uint64_t>(j));
      std::int64_t prev = id(p, s);
      for (std::int64_t i = 0; i < block_; ++i) {
        const std::int64_t next = id(p, s + i + 1);
        x.data()[j * block_ + i] = static_cast<T>(prev);
        y.data()[j * block_ + i] = static_cast<std::int32_t>(next);
        prev = next;
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
  const TokenCorpus& tokens() const { return tokens_; }

 private:
  std::int64_t id(std::size_t p, std::int64_t i) const {
    return detail::checked_id(tokens_.at(p, i), vocab_, i, tokens_.part_name(p));
  }

  TokenCorpus tokens_;
  std::int64_t block_;
  std::uint64_t seed_;
  int rank_, world_;
  std::int64_t vocab_;
  std::vector<std::int64_t> cum_starts_;  // window starts in parts 0..p (back(): in all)
  std::int64_t position_ = 0;
};

}  // namespace ptrain
