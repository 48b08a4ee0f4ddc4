#pragma once
// GPT-2's tokenizer: byte-level BPE with the vocabulary files that come with the
// model (Hugging Face's vocab.json + merges.txt, or OpenAI's encoder.json + vocab.bpe).
//
//   auto tok = BpeTokenizer::load("gpt2");                 // a folder holding the two files
//   std::vector<std::int32_t> ids = tok.encode("Hello world");   // GPT-2: 15496, 995
//   std::string text = tok.decode(ids);                    // "Hello world"
//   std::int32_t eot = *tok.token_id("<|endoftext|>");     // 50256: put it before each document
//
// Note [GPT-2 byte-level BPE]
// Encoding, as OpenAI's encoder.py and tiktoken's encode_ordinary:
// 1. Pieces: the UTF-8 text splits where GPT-2's pattern matches,
//      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//    leftmost-first at each position, as a backtracking regex engine does
//    (detail::for_each_gpt2_piece); \p{L} and \p{N} are Unicode's general categories
//    (unicode_tables.hpp), \s is the White_Space property.
// 2. Bytes: each byte of a piece starts as one symbol, the vocabulary's token for
//    the byte's printable stand-in (detail::byte_to_unicode: printable Latin-1
//    stands for itself, the 68 other bytes for U+0100 onwards; a space is "Ġ").
// 3. Merges: while some adjacent pair of symbols has a merge rule, every
//    occurrence of the pair whose rule comes first in the merges file becomes one
//    symbol, left to right. The symbols left are the piece's tokens.
// Decoding concatenates the tokens' bytes. Special tokens such as <|endoftext|>
// are ordinary text to encode(); token_id() gives the id to insert. Limits: only
// GPT-2's pattern (GPT-2, GPT-J, GPT-NeoX-style vocabularies of that pattern);
// encoding costs quadratic time in a piece's length (as encoder.py and tiktoken).

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <filesystem>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/data/text.hpp"
#include "ptrain/data/unicode_tables.hpp"

namespace ptrain {

namespace detail {

template <std::size_t N>
bool in_ranges(std::uint32_t cp, const std::uint32_t (&ranges)[N][2]) {
  // The first range that ends at or after cp.
  const auto* r = std::partition_point(std::begin(ranges), std::end(ranges), [&](const auto& x) { return x[1] < cp; });
  return r != std::end(ranges) && (*r)[0] <= cp;
}

enum class CharClass : std::uint8_t { Letter, Number, Space, Other };

inline CharClass char_class(std::uint32_t cp) {
  if (cp < 0x80) {
    if ((cp | 0x20) - 'a' < 26) return CharClass::Letter;
    if (cp - '0' < 10) return CharClass::Number;
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return CharClass::Space;
    return CharClass::Other;
  }
  // White_Space outside ASCII.
  if (cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
      cp == 0x202F || cp == 0x205F || cp == 0x3000)
    return CharClass::Space;
  if (in_ranges(cp, unicode::kLetters)) return CharClass::Letter;
  if (in_ranges(cp, unicode::kNumbers)) return CharClass::Number;
  return CharClass::Other;
}

/// The code point at byte i of UTF-8 `text` and its length in bytes. Strict: overlong
/// forms, surrogates and truncated sequences throw, naming the offset.
inline std::pair<std::uint32_t, std::size_t> utf8_at(std::string_view text, std::size_t i) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const unsigned char c = s[i];
  std::size_t len = 0;
  std::uint32_t cp = 0, min = 0;
  if (c < 0x80) return {c, 1};
  if ((c & 0xE0) == 0xC0) len = 2, cp = c & 0x1Fu, min = 0x80;
  else if ((c & 0xF0) == 0xE0) len = 3, cp = c & 0x0Fu, min = 0x800;
  else if ((c & 0xF8) == 0xF0) len = 4, cp = c & 0x07u, min = 0x10000;
  bool ok = len > 0 && i + len <= text.size();
  for (std::size_t k = 1; ok && k < len; ++k) {
    ok = (s[i + k] & 0xC0) == 0x80;
    cp = (cp << 6) | (s[i + k] & 0x3Fu);
  }
  ok = ok && cp >= min && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
  PTRAIN_CHECK(ok, DataError, "[ptrain.data.bpe.utf8] byte ", i, " (0x", "0123456789abcdef"[c >> 4],
               "0123456789abcdef"[c & 15], ") starts no valid UTF-8 character; the tokenizer encodes UTF-8 text: "
               "convert the text first (e.g. iconv -f LATIN1 -t UTF-8)");
  return {cp, len};
}

/// The classes of the characters of text[0, n), for the pre-tokenizers' scans.
struct ClassScan {
  std::string_view text;
  std::size_t n;
  /// The class and byte length of the character at byte i.
  std::pair<CharClass, std::size_t> at(std::size_t i) const {
    const auto [cp, len] = utf8_at(text, i);
    return {char_class(cp), len};
  }
  /// The end of the run of class c from byte i.
  std::size_t run_end(std::size_t i, CharClass c) const {
    while (i < n) {
      const auto [k, len] = at(i);
      if (k != c) break;
      i += len;
    }
    return i;
  }
};

/// Calls piece(begin, end) with the byte range of each piece of GPT-2's pattern, in
/// order (Note [GPT-2 byte-level BPE]); reads the text once, keeping nothing. Only
/// text[from, to) is split, as if it were the whole text.
template <class F>
void for_each_gpt2_piece(std::string_view text, F&& piece, std::size_t from = 0,
                         std::size_t to = std::string_view::npos) {
  const std::size_t n = std::min(to, text.size());
  const ClassScan scan{text, n};
  for (std::size_t i = from; i < n;) {
    std::size_t end = i;
    if (text[i] == '\'' && i + 1 < n) {  // 's 't 'm 'd, then 're 've 'll (ASCII: bytes are characters)
      const char a = text[i + 1], b = i + 2 < n ? text[i + 2] : '\0';
      if (a == 's' || a == 't' || a == 'm' || a == 'd') end = i + 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) end = i + 3;
    }
    if (end == i) {
      // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+": an optional space, then a run of one class.
      const std::size_t j = text[i] == ' ' && i + 1 < n ? i + 1 : i;
      const CharClass c = scan.at(j).first;
      if (c != CharClass::Space) {
        end = scan.run_end(j, c);
      } else {
        // "\s+(?!\S)": whitespace up to the end, or up to the last one before a non-space
        // (which may then lead the next piece); else "\s+": one whitespace character.
        std::size_t last = i;  // start of the run's last character
        for (end = i; end < n;) {
          const auto [k, len] = scan.at(end);
          if (k != CharClass::Space) break;
          last = end;
          end += len;
        }
        if (end < n && last > i) end = last;
      }
    }
    piece(i, end);
    i = end;
  }
}

/// The first position p >= from (else text.size()) after a '\n' whose byte is printable
/// ASCII. Every such p ends a piece whatever came before (only white-space pieces hold
/// a '\n', and they end at or before the next non-space), so text[0, p) and text[p, ...)
/// encode apart to the ids of the whole: a place to cut a text for parallel encoding.
inline std::size_t piece_boundary_after(std::string_view text, std::size_t from) {
  for (std::size_t p = std::max<std::size_t>(from, 1); p < text.size(); ++p)
    if (text[p - 1] == '\n' && text[p] > ' ' && text[p] < 0x7F) return p;
  return text.size();
}

/// GPT-2's printable stand-in for byte b (encoder.py's bytes_to_unicode).
inline std::uint32_t byte_to_unicode(unsigned b) {
  auto printable = [](unsigned x) { return (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE); };
  if (printable(b)) return b;
  std::uint32_t k = 0;  // b is the k-th non-printable byte
  for (unsigned x = 0; x < b; ++x) k += printable(x) ? 0 : 1;
  return 256 + k;
}

inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace detail

/// GPT-2's byte-level BPE tokenizer (Note [GPT-2 byte-level BPE]).
class BpeTokenizer {
 public:
  /// From a folder holding vocab.json + merges.txt (Hugging Face) or encoder.json + vocab.bpe (OpenAI).
  static BpeTokenizer load(const std::string& folder) {
    namespace fs = std::filesystem;
    const fs::path d(folder);
    for (const auto& [vocab, merges] : {std::pair{"vocab.json", "merges.txt"}, std::pair{"encoder.json", "vocab.bpe"}})
      if (fs::is_regular_file(d / vocab) && fs::is_regular_file(d / merges))
        return from_files((d / vocab).string(), (d / merges).string());
    PTRAIN_THROW(DataError, "[ptrain.data.bpe.missing] '", folder, "' holds neither vocab.json + merges.txt ",
                 "(Hugging Face's GPT-2 files) nor encoder.json + vocab.bpe (OpenAI's); pass the folder of a ",
                 "GPT-2 tokenizer");
  }

  /// From a vocabulary (JSON object: token -> id) and a merges file (one "a b" rule per
  /// line, first rule first; a "#version" first line is skipped).
  static BpeTokenizer from_files(const std::string& vocab_path, const std::string& merges_path) {
    BpeTokenizer t;
    nlohmann::json vocab;
    try {
      vocab = nlohmann::json::parse(detail::read_file_bytes(vocab_path, "BPE vocabulary"));
    } catch (const nlohmann::json::exception& e) {
      PTRAIN_THROW(DataError, "[ptrain.data.bpe.vocab] '", vocab_path, "' is not JSON (", e.what(),
                   "); pass a tokenizer's vocab.json or encoder.json");
    }
    PTRAIN_CHECK(vocab.is_object() && !vocab.empty(), DataError, "[ptrain.data.bpe.vocab] '", vocab_path,
                 "' is not a JSON object of token -> id; pass a tokenizer's vocab.json or encoder.json");
    std::int64_t size = 0;
    for (const auto& [token, id] : vocab.items()) {
      PTRAIN_CHECK(id.is_number_integer() && id.get<std::int64_t>() >= 0 && id.get<std::int64_t>() < INT32_MAX,
                   DataError, "[ptrain.data.bpe.vocab] '", vocab_path, "': token '", token, "' has id ", id.dump(),
                   ", not an integer in [0, 2^31)");
      size = std::max(size, id.get<std::int64_t>() + 1);
    }
    // Ids index tables of `size` entries: a few stray large ids must not allocate gigabytes.
    const auto count = static_cast<std::int64_t>(vocab.size());
    PTRAIN_CHECK(size <= 4 * count + 1024, DataError, "[ptrain.data.bpe.vocab] '", vocab_path, "': the largest id is ",
                 size - 1, " for ", count, " tokens; a vocabulary numbers its tokens 0, 1, 2, ... (GPT-2: 0..50256)");
    std::array<int, 324> byte_of;  // stand-in code point -> byte
    byte_of.fill(-1);
    for (unsigned b = 0; b < 256; ++b) byte_of[detail::byte_to_unicode(b)] = static_cast<int>(b);
    t.bytes_.resize(static_cast<std::size_t>(size));
    t.known_.assign(static_cast<std::size_t>(size), false);
    for (const auto& [token, value] : vocab.items()) {
      const auto id = value.get<std::int32_t>();
      PTRAIN_CHECK(!t.known_[id], DataError, "[ptrain.data.bpe.vocab] '", vocab_path, "': id ", id,
                   " belongs to two tokens; the vocabulary is corrupt");
      t.known_[id] = true;
      t.ids_.emplace(token, id);
      // The token's bytes; a character without a byte (an added token) stands for its own UTF-8.
      std::string& bytes = t.bytes_[id];
      for (std::size_t k = 0; k < token.size();) {
        const auto [cp, len] = detail::utf8_at(token, k);
        if (cp < byte_of.size() && byte_of[cp] >= 0) bytes += static_cast<char>(byte_of[cp]);
        else bytes.append(token, k, len);
        k += len;
      }
    }
    for (unsigned b = 0; b < 256; ++b) {
      std::string stand_in;
      detail::append_utf8(stand_in, detail::byte_to_unicode(b));
      const auto it = t.ids_.find(stand_in);
      PTRAIN_CHECK(it != t.ids_.end(), DataError, "[ptrain.data.bpe.vocab] '", vocab_path, "' has no token for byte ",
                   b, " ('", stand_in, "'); a byte-level BPE vocabulary (GPT-2's) has one for each of the 256");
      t.byte_id_[b] = it->second;
    }

    const std::string merges = detail::read_file_bytes(merges_path, "BPE merges file");
    std::size_t pos = 0, line_no = 0;
    std::int32_t rank = 0;
    while (pos < merges.size()) {
      std::size_t end = merges.find('\n', pos);
      if (end == std::string::npos) end = merges.size();
      std::string_view line(merges.data() + pos, end - pos);
      pos = end + 1;
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.empty() || (line_no == 1 && line.substr(0, 8) == "#version")) continue;
      const std::size_t space = line.find(' ');
      const bool two = space != std::string_view::npos && space > 0 && space + 1 < line.size() &&
                       line.find(' ', space + 1) == std::string_view::npos;
      PTRAIN_CHECK(two, DataError, "[ptrain.data.bpe.merges] '", merges_path, "' line ", line_no, " ('", line,
                   "') is not two tokens separated by one space");
      const std::string a(line.substr(0, space)), b(line.substr(space + 1));
      const auto ia = t.ids_.find(a), ib = t.ids_.find(b), iab = t.ids_.find(a + b);
      PTRAIN_CHECK(ia != t.ids_.end() && ib != t.ids_.end() && iab != t.ids_.end(), DataError,
                   "[ptrain.data.bpe.merges] '", merges_path, "' line ", line_no, " merges '", a, "' and '", b,
                   "', but the vocabulary lacks '", (ia == t.ids_.end() ? a : ib == t.ids_.end() ? b : a + b),
                   "'; the merges file and the vocabulary do not belong together");
      t.merges_.try_emplace(pair_key(ia->second, ib->second), Merge{rank++, iab->second});  // the first rule wins
    }
    return t;
  }

  /// Number of ids: the largest id + 1 (GPT-2: 50257).
  std::int64_t vocab_size() const { return static_cast<std::int64_t>(bytes_.size()); }
  /// Number of merge rules (GPT-2: 50000).
  std::int64_t num_merges() const { return static_cast<std::int64_t>(merges_.size()); }
  /// Id of a token as the vocabulary spells it ("<|endoftext|>", "Ġthe"), if there is one.
  std::optional<std::int32_t> token_id(std::string_view token) const {
    const auto it = ids_.find(std::string(token));
    if (it == ids_.end()) return std::nullopt;
    return it->second;
  }

  /// Token ids of UTF-8 `text`; DataError names the offset of invalid UTF-8.
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> out;
    out.reserve(text.size() / 3);
    encode_to(text, [&](const std::vector<std::int32_t>& ids) { out.insert(out.end(), ids.begin(), ids.end()); });
    return out;
  }
  /// encode() piece by piece: sink(ids) gets the ids of each piece in order, and no
  /// more than a piece is held (a text larger than memory can stream from a mapping).
  /// Only text[from, to) is encoded, as if it were the whole text; error offsets count
  /// from text's start. Cut at detail::piece_boundary_after, the parts' ids joined are
  /// the whole text's.
  template <class F>
  void encode_to(std::string_view text, F&& sink, std::size_t from = 0,
                 std::size_t to = std::string_view::npos) const {
    std::vector<std::int32_t> symbols;
    detail::for_each_gpt2_piece(
        text,
        [&](std::size_t begin, std::size_t end) {
          symbols.clear();
          for (std::size_t i = begin; i < end; ++i) symbols.push_back(byte_id_[static_cast<unsigned char>(text[i])]);
          merge(symbols);
          sink(std::as_const(symbols));
        },
        from, to);
  }
  /// encode() as an int32 tensor [N].
  Tensor<std::int32_t> encode_tensor(std::string_view text) const {
    auto ids = encode(text);
    return Tensor<std::int32_t>::from(ids, {static_cast<std::int64_t>(ids.size())});
  }

  /// The bytes of the tokens (ids cut anywhere may end inside a UTF-8 character).
  std::string decode(const std::vector<std::int32_t>& ids) const {
    std::string out;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::int32_t id = ids[i];
      PTRAIN_CHECK(id >= 0 && id < vocab_size() && known_[id], DataError, "[ptrain.data.bpe.id] id ", id,
                   " at index ", i, " is not in the vocabulary (", vocab_size(), " ids); the ids come from "
                   "another tokenizer or a model with a padded vocabulary");
      out += bytes_[id];
    }
    return out;
  }

 private:
  struct Merge {
    std::int32_t rank, id;
  };
  static std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }

  // Note [GPT-2 byte-level BPE], step 3.
  void merge(std::vector<std::int32_t>& s) const {
    while (s.size() > 1) {
      Merge best{INT32_MAX, -1};
      std::int32_t first = -1, second = -1;
      for (std::size_t i = 0; i + 1 < s.size(); ++i) {
        const auto it = merges_.find(pair_key(s[i], s[i + 1]));
        if (it != merges_.end() && it->second.rank < best.rank) {
          best = it->second;
          first = s[i];
          second = s[i + 1];
        }
      }
      if (best.id < 0) return;
      std::size_t w = 0;
      for (std::size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == first && s[i + 1] == second) {
          s[w++] = best.id;
          i += 2;
        } else {
          s[w++] = s[i++];
        }
      }
      s.resize(w);
    }
  }

  std::vector<std::string> bytes_;                   // id -> the token's bytes
  std::vector<bool> known_;                          // ids in the vocabulary
  std::unordered_map<std::string, std::int32_t> ids_;  // token as the vocabulary spells it -> id
  std::array<std::int32_t, 256> byte_id_{};          // byte -> id of its stand-in
  std::unordered_map<std::uint64_t, Merge> merges_;  // (left id, right id) -> rank, merged id
};

}  // namespace ptrain
