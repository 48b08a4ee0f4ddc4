#pragma once
// Llama 3's tokenizer: byte-level BPE read from a Hugging Face tokenizer.json or from
// tiktoken ranks (Meta's tokenizer.model for Llama 3), with Llama 3's pre-tokenizer.
//
//   auto tok = RankedBpeTokenizer::from_tokenizer_json("Meta-Llama-3-8B/tokenizer.json");
//   auto tok2 = RankedBpeTokenizer::from_tiktoken("Meta-Llama-3-8B/original/tokenizer.model");
//   std::vector<std::int32_t> ids = tok.encode("Hello world");      // Llama 3: 9906, 1917
//   std::int32_t bos = *tok.token_id("<|begin_of_text|>");          // 128000
//
// Note [Llama 3 byte-level BPE]
// 1. Pieces: the UTF-8 text splits where Llama 3's pattern matches,
//      (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//      ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//    leftmost-first at each position, as the regex module, tiktoken's fancy-regex and
//    Hugging Face's Oniguruma do (detail::for_each_llama3_piece). (?i) folds ASCII case
//    and U+017F (long s) onto 's', the only non-ASCII character that folds onto one of
//    the contraction letters. A tokenizer.json with GPT-2's ByteLevel(use_regex=true)
//    pre-tokenizer splits with GPT-2's pattern instead (data/bpe.hpp).
// 2. A piece that is a token as a whole is that token (tiktoken always; tokenizer.json
//    when its model says "ignore_merges": true, as Llama 3's does).
// 3. Otherwise each byte starts as its token, and while some adjacent pair has a
//    rank, the leftmost pair of lowest rank becomes one symbol. The rank of a pair is
//    its rule's line in tokenizer.json's merges, or, for tiktoken ranks, the rank of
//    the concatenated bytes (tiktoken's byte_pair_merge): a pair merges exactly when
//    its concatenation is a token. Both reduce to one table, (left id, right id) ->
//    (rank, merged id), built at load; encoding is then the same loop for both.
// One pair at a time, leftmost first, is what Hugging Face's Word::merge_all and
// tiktoken do; data/bpe.hpp's merge of every occurrence at once gives the same ids for
// merges trained in order, but not for every file, so this loop follows the two.
// Special tokens (tokenizer.json's added_tokens; for tiktoken ranks, Llama 3's 256
// tokens after the last rank) are ordinary text to encode(); token_id() gives their ids
// and encode_with_specials() recognises them in the text. encode() adds no
// <|begin_of_text|> (Hugging Face's post-processor does): put it before each document.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/data/bpe.hpp"
#include "ptrain/data/text.hpp"

namespace ptrain {

namespace detail {

/// Llama 3's pre-tokenizer pattern as tokenizer.json spells it (a Split's "Regex").
inline constexpr std::string_view kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

/// Calls piece(begin, end) with the byte range of each piece of Llama 3's pattern
/// (Note [Llama 3 byte-level BPE]), in order; only text[from, to) is split, as if it
/// were the whole text. A cut at detail::piece_boundary_after is also a piece boundary
/// here: a piece holding a line feed ends at or before the next non-space character.
template <class F>
void for_each_llama3_piece(std::string_view text, F&& piece, std::size_t from = 0,
                           std::size_t to = std::string_view::npos) {
  const std::size_t n = std::min(to, text.size());
  const ClassScan scan{text, n};
  auto crlf = [&](std::size_t i) { return text[i] == '\r' || text[i] == '\n'; };
  auto lower = [&](std::size_t i) {  // ASCII lower case of byte i, '\0' past the end
    const char c = i < n ? text[i] : '\0';
    return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c;
  };
  for (std::size_t i = from; i < n;) {
    std::size_t end = i;
    if (text[i] == '\'') {  // (?i:'s|'t|'re|'ve|'m|'ll|'d); "\xC5\xBF" is U+017F, which folds to 's'
      const char a = lower(i + 1), b = lower(i + 2);
      if (a == 's' || a == 't' || a == 'm' || a == 'd') end = i + 2;
      else if (i + 3 <= n && text.substr(i + 1, 2) == "\xC5\xBF") end = i + 3;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) end = i + 3;
    }
    if (end == i) {
      const auto [c0, len0] = scan.at(i);
      if (c0 == CharClass::Letter) {  // [^\r\n\p{L}\p{N}]?\p{L}+ with nothing before the letters
        end = scan.run_end(i, CharClass::Letter);
      } else if (c0 != CharClass::Number && !crlf(i) && i + len0 < n &&
                 scan.at(i + len0).first == CharClass::Letter) {  // ... with one character before
        end = scan.run_end(i + len0, CharClass::Letter);
      } else if (c0 == CharClass::Number) {  // \p{N}{1,3}
        end = i;
        for (int k = 0; k < 3 && end < n; ++k) {
          const auto [c, len] = scan.at(end);
          if (c != CharClass::Number) break;
          end += len;
        }
      } else {
        // " ?[^\s\p{L}\p{N}]+[\r\n]*": an optional space, a run of other characters, line ends.
        const std::size_t j = text[i] == ' ' && i + 1 < n && scan.at(i + 1).first == CharClass::Other ? i + 1 : i;
        if (scan.at(j).first == CharClass::Other) {
          end = scan.run_end(j, CharClass::Other);
          while (end < n && crlf(end)) ++end;
        } else {
          // White space: "\s*[\r\n]+" takes the run up to its last line end; else
          // "\s+(?!\S)" the run up to the end of the text, or up to its last character
          // (which may lead the next piece); else "\s+" the one character.
          std::size_t last = i, after_line_end = i;
          for (end = i; end < n;) {
            const auto [k, len] = scan.at(end);
            if (k != CharClass::Space) break;
            last = end;
            end += len;
            if (crlf(last)) after_line_end = end;
          }
          if (after_line_end > i) end = after_line_end;
          else if (end < n && last > i) end = last;
        }
      }
    }
    piece(i, end);
    i = end;
  }
}

/// Meta's special tokens of Llama 3 (llama3/tokenizer.py), numbered from the first id
/// after the tiktoken ranks: 256 of them, <|begin_of_text|> first.
inline std::vector<std::string> llama3_special_tokens() {
  std::vector<std::string> s = {"<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                                "<|reserved_special_token_1|>", "<|reserved_special_token_2|>",
                                "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
                                "<|reserved_special_token_4|>", "<|eot_id|>"};
  for (int i = 5; i < 256 - 5; ++i) s.push_back("<|reserved_special_token_" + std::to_string(i) + "|>");
  return s;
}

/// Standard base64 (RFC 4648, '=' padding) of a whole string, or nullopt.
inline std::optional<std::string> base64_decode(std::string_view s) {
  if (s.empty() || s.size() % 4 != 0) return std::nullopt;
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  for (std::size_t i = 0; i < s.size(); i += 4) {
    const bool last = i + 4 == s.size();
    const int pad = last ? (s[i + 3] == '=') + (s[i + 2] == '=' && s[i + 3] == '=') : 0;
    std::uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const int x = k >= 4 - pad ? 0 : value(s[i + k]);
      if (x < 0) return std::nullopt;
      v = (v << 6) | static_cast<std::uint32_t>(x);
    }
    out += static_cast<char>(v >> 16);
    if (pad < 2) out += static_cast<char>((v >> 8) & 0xFF);
    if (pad < 1) out += static_cast<char>(v & 0xFF);
  }
  return out;
}

}  // namespace detail

/// Byte-level BPE ranked by merge rules or tiktoken ranks (Note [Llama 3 byte-level BPE]).
class RankedBpeTokenizer {
 public:
  enum class Pattern { Llama3, Gpt2 };

  /// From a Hugging Face tokenizer.json of a byte-level BPE (Llama 3's, or GPT-2's
  /// layout); anything else it may declare is refused by name ([ptrain.tokenizer.unsupported]).
  static RankedBpeTokenizer from_tokenizer_json(const std::string& path) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(detail::read_file_bytes(path, "tokenizer.json"));
    } catch (const nlohmann::json::exception& e) {
      PTRAIN_THROW(DataError, "[ptrain.tokenizer.json] '", path, "' is not JSON (", e.what(),
                   "); pass a Hugging Face tokenizer.json");
    }
    try {
      return from_json(j, path);
    } catch (const nlohmann::json::exception& e) {  // a field of an unexpected JSON type
      PTRAIN_THROW(DataError, "[ptrain.tokenizer.json] '", path, "': ", e.what(),
                   "; the file is not a Hugging Face tokenizer.json, or it is damaged");
    }
  }

  /// From tiktoken ranks: lines "base64(token bytes) rank" (Meta's tokenizer.model for
  /// Llama 3; OpenAI's cl100k_base.tiktoken has the same pattern, but its special tokens
  /// are not numbered on from the last rank). The rank is the id; `specials` follow the
  /// last rank (default: Llama 3's 256, see detail::llama3_special_tokens).
  static RankedBpeTokenizer from_tiktoken(const std::string& path,
                                          std::optional<std::vector<std::string>> specials = std::nullopt) {
    const std::string file = detail::read_file_bytes(path, "tiktoken ranks file");
    std::vector<std::pair<std::int64_t, std::string>> entries;
    std::int64_t next = 0;
    std::size_t pos = 0, line_no = 0;
    while (pos < file.size()) {
      std::size_t end = file.find('\n', pos);
      if (end == std::string::npos) end = file.size();
      std::string_view line(file.data() + pos, end - pos);
      pos = end + 1;
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.empty()) continue;
      const std::size_t space = line.find(' ');
      std::optional<std::string> bytes;
      std::int64_t rank = -1;
      if (space != std::string_view::npos) {
        bytes = detail::base64_decode(line.substr(0, space));
        const std::string_view digits = line.substr(space + 1);
        if (!digits.empty() && digits.size() < 10 &&
            std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
          rank = std::stoll(std::string(digits));
      }
      PTRAIN_CHECK(bytes && rank >= 0, DataError, "[ptrain.tokenizer.tiktoken] '", path, "' line ", line_no, " ('",
                   line.substr(0, 80), "') is not \"base64 rank\"; pass tiktoken ranks (Llama 3's "
                   "original/tokenizer.model) or a SentencePiece model");
      entries.emplace_back(rank, std::move(*bytes));
      next = std::max(next, rank + 1);
    }
    PTRAIN_CHECK(!entries.empty(), DataError, "[ptrain.tokenizer.tiktoken] '", path, "' holds no ranks");
    std::vector<std::pair<std::int64_t, std::string>> special_entries;
    for (const auto& s : specials ? *specials : detail::llama3_special_tokens()) special_entries.emplace_back(next++, s);

    RankedBpeTokenizer t;
    t.whole_piece_first_ = true;  // tiktoken: a piece that is a token is that token
    t.build(entries, special_entries, path);
    for (unsigned b = 0; b < 256; ++b) {
      const auto it = t.ids_.find(std::string(1, static_cast<char>(b)));
      PTRAIN_CHECK(it != t.ids_.end(), DataError, "[ptrain.tokenizer.tiktoken] '", path, "' has no rank for byte ", b,
                   "; byte-level BPE ranks have one for each of the 256");
      t.byte_id_[b] = it->second;
    }
    // A pair merges when its concatenation has a rank: list every split of every token
    // into two tokens (each token's bytes once, so this is linear in the file).
    for (const auto& [bytes, id] : t.ids_) {
      for (std::size_t k = 1; k < bytes.size(); ++k) {
        const auto l = t.ids_.find(bytes.substr(0, k));
        if (l == t.ids_.end()) continue;
        const auto r = t.ids_.find(bytes.substr(k));
        if (r != t.ids_.end()) t.merges_.emplace(pair_key(l->second, r->second), Merge{id, id});
      }
    }
    return t;
  }

  /// Number of ids: the largest id + 1 (Llama 3: 128256).
  std::int64_t vocab_size() const { return static_cast<std::int64_t>(bytes_.size()); }
  /// Number of pairs that merge.
  std::int64_t num_merges() const { return static_cast<std::int64_t>(merges_.size()); }
  /// Which pre-tokenizer pattern splits the text.
  Pattern pattern() const { return pattern_; }
  /// Id of a special token ("<|begin_of_text|>") or of a token's bytes, if there is one.
  std::optional<std::int32_t> token_id(std::string_view token) const {
    for (const auto& [content, id] : specials_)
      if (content == token) return id;
    const auto it = ids_.find(std::string(token));
    if (it == ids_.end()) return std::nullopt;
    return it->second;
  }
  /// The special tokens (content, id), in id order.
  const std::vector<std::pair<std::string, std::int32_t>>& special_tokens() const { return specials_; }

  /// Token ids of UTF-8 `text`, special tokens' text included as ordinary text.
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> out;
    out.reserve(text.size() / 3);
    encode_to(text, [&](const std::vector<std::int32_t>& ids) { out.insert(out.end(), ids.begin(), ids.end()); });
    return out;
  }
  /// encode(), but each special token's text becomes its id (the leftmost, longest
  /// first), as Hugging Face's encode and tiktoken's encode(allowed_special="all").
  std::vector<std::int32_t> encode_with_specials(std::string_view text) const {
    std::vector<std::int32_t> out;
    auto add = [&](const std::vector<std::int32_t>& ids) { out.insert(out.end(), ids.begin(), ids.end()); };
    std::size_t at = 0;
    while (at < text.size()) {
      std::size_t best = text.size(), best_len = 0;
      std::int32_t best_id = -1;
      for (const auto& [content, id] : specials_) {
        const std::size_t p = content.empty() ? std::string_view::npos : text.find(content, at);
        if (p != std::string_view::npos && (p < best || (p == best && content.size() > best_len)))
          best = p, best_len = content.size(), best_id = id;
      }
      encode_to(text, add, at, best);
      if (best_id < 0) break;
      out.push_back(best_id);
      at = best + best_len;
    }
    return out;
  }
  /// encode() piece by piece (as BpeTokenizer::encode_to): sink(ids) gets each piece's
  /// ids; only text[from, to) is encoded, as if it were the whole text.
  template <class F>
  void encode_to(std::string_view text, F&& sink, std::size_t from = 0,
                 std::size_t to = std::string_view::npos) const {
    std::vector<std::int32_t> symbols;
    auto piece = [&](std::size_t begin, std::size_t end) {
      symbols.clear();
      const auto whole = whole_piece_first_ ? ids_.find(std::string(text.substr(begin, end - begin))) : ids_.end();
      if (whole != ids_.end()) {
        symbols.push_back(whole->second);
      } else {
        for (std::size_t i = begin; i < end; ++i) symbols.push_back(byte_id_[static_cast<unsigned char>(text[i])]);
        merge(symbols);
      }
      sink(std::as_const(symbols));
    };
    if (pattern_ == Pattern::Llama3) detail::for_each_llama3_piece(text, piece, from, to);
    else detail::for_each_gpt2_piece(text, piece, from, to);
  }

  /// The bytes of the tokens; a special token gives its text.
  std::string decode(const std::vector<std::int32_t>& ids) const {
    std::string out;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::int32_t id = ids[i];
      PTRAIN_CHECK(id >= 0 && id < vocab_size() && known_[id], DataError, "[ptrain.tokenizer.id] id ", id,
                   " at index ", i, " is not in the vocabulary (", vocab_size(), " ids); the ids come from "
                   "another tokenizer or a model with a padded vocabulary");
      out += bytes_[id];
    }
    return out;
  }

 private:
  // from_tokenizer_json's reading of the parsed file.
  static RankedBpeTokenizer from_json(const nlohmann::json& j, const std::string& path) {
    auto bad = [&](const std::string& what) {
      PTRAIN_THROW(DataError, "[ptrain.tokenizer.json] '", path, "': ", what,
                   "; the file is not a Hugging Face tokenizer.json, or it is damaged");
    };
    auto unsupported = [&](const std::string& what) {
      PTRAIN_THROW(DataError, "[ptrain.tokenizer.unsupported] '", path, "': ", what, " is not supported; ptrain ",
                   "reads byte-level BPE tokenizers (Llama 3's Split + ByteLevel pre-tokenizer, or GPT-2's ByteLevel) ",
                   "without a normalizer; for a SentencePiece model (Llama 2, Mistral) pass its tokenizer.model");
    };
    auto brief = [](const nlohmann::json& v) {  // a value as short JSON, for messages
      std::string s = v.dump();
      return s.size() > 200 ? s.substr(0, 200) + "..." : s;
    };
    if (!j.is_object() || !j.contains("model") || !j["model"].is_object()) bad("no \"model\" object");
    const auto& model = j["model"];
    const std::string type = model.value("type", std::string("BPE"));  // old files leave out BPE's type
    if (type != "BPE") unsupported("model type \"" + type + "\"");
    if (j.contains("normalizer") && !j["normalizer"].is_null()) unsupported("normalizer " + brief(j["normalizer"]));
    for (const char* key : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(key) && !model[key].is_null() && model[key] != "")
        unsupported(std::string("model.") + key + " " + brief(model[key]));
    if (model.value("byte_fallback", false)) unsupported("model.byte_fallback");

    RankedBpeTokenizer t;
    t.whole_piece_first_ = model.value("ignore_merges", false);
    const nlohmann::json pre = j.value("pre_tokenizer", nlohmann::json());
    auto byte_level = [](const nlohmann::json& p, bool use_regex) {
      return p.is_object() && p.value("type", "") == "ByteLevel" && !p.value("add_prefix_space", false) &&
             p.value("use_regex", true) == use_regex;
    };
    if (byte_level(pre, true)) {
      t.pattern_ = Pattern::Gpt2;
    } else {
      const bool llama3 = pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers") &&
                          pre["pretokenizers"].is_array() && pre["pretokenizers"].size() == 2 &&
                          pre["pretokenizers"][0].value("type", "") == "Split" &&
                          pre["pretokenizers"][0].value("pattern", nlohmann::json()) ==
                              nlohmann::json{{"Regex", detail::kLlama3Pattern}} &&
                          pre["pretokenizers"][0].value("behavior", "") == "Isolated" &&
                          !pre["pretokenizers"][0].value("invert", false) && byte_level(pre["pretokenizers"][1], false);
      if (!llama3) unsupported("pre_tokenizer " + brief(pre));
    }

    if (!model.contains("vocab") || !model["vocab"].is_object() || model["vocab"].empty())
      bad("model.vocab is not an object of token -> id");
    std::array<int, 324> byte_of;  // stand-in code point -> byte
    byte_of.fill(-1);
    for (unsigned b = 0; b < 256; ++b) byte_of[detail::byte_to_unicode(b)] = static_cast<int>(b);
    std::unordered_map<std::string, std::int32_t> spelled;  // the vocabulary's spelling -> id
    std::vector<std::pair<std::int64_t, std::string>> entries;
    for (const auto& [token, id] : model["vocab"].items()) {
      if (!id.is_number_integer() || id.get<std::int64_t>() < 0 || id.get<std::int64_t>() >= INT32_MAX)
        bad("token '" + token + "' has id " + id.dump() + ", not an integer in [0, 2^31)");
      std::string bytes;  // a character without a byte stands for its own UTF-8
      for (std::size_t k = 0; k < token.size();) {
        const auto [cp, len] = detail::utf8_at(token, k);
        if (cp < byte_of.size() && byte_of[cp] >= 0) bytes += static_cast<char>(byte_of[cp]);
        else bytes.append(token, k, len);
        k += len;
      }
      spelled.emplace(token, static_cast<std::int32_t>(id.get<std::int64_t>()));
      entries.emplace_back(id.get<std::int64_t>(), std::move(bytes));
    }
    std::vector<std::pair<std::int64_t, std::string>> specials;
    if (j.contains("added_tokens")) {
      if (!j["added_tokens"].is_array()) bad("added_tokens is not an array");
      for (const auto& a : j["added_tokens"]) {
        if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
            !a["content"].is_string() || a["id"].get<std::int64_t>() < 0 || a["id"].get<std::int64_t>() >= INT32_MAX)
          bad("added token " + brief(a) + " has no integer \"id\" in [0, 2^31) and string \"content\"");
        specials.emplace_back(a["id"].get<std::int64_t>(), a["content"].get<std::string>());
      }
    }
    t.build(entries, specials, path);
    for (unsigned b = 0; b < 256; ++b) {
      std::string stand_in;
      detail::append_utf8(stand_in, detail::byte_to_unicode(b));
      const auto it = spelled.find(stand_in);
      if (it == spelled.end())
        bad("the vocabulary has no token for byte " + std::to_string(b) + " ('" + stand_in +
            "'), which a byte-level BPE has for each of the 256");
      t.byte_id_[b] = it->second;
    }

    if (!model.contains("merges") || !model["merges"].is_array()) bad("model.merges is not an array");
    std::int32_t rank = 0;
    for (const auto& m : model["merges"]) {
      // "a b" (older files) or ["a", "b"] (tokenizers >= 0.20, which allows spaces in tokens).
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const std::size_t space = s.find(' ');
        if (space == std::string::npos || space == 0 || space + 1 == s.size() ||
            s.find(' ', space + 1) != std::string::npos)
          bad("merge " + std::to_string(rank) + " (" + brief(m) + ") is not two tokens separated by one space");
        a = s.substr(0, space), b = s.substr(space + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>(), b = m[1].get<std::string>();
      } else {
        bad("merge " + std::to_string(rank) + " (" + brief(m) + ") is neither \"a b\" nor [\"a\", \"b\"]");
      }
      const auto ia = spelled.find(a), ib = spelled.find(b), iab = spelled.find(a + b);
      if (ia == spelled.end() || ib == spelled.end() || iab == spelled.end())
        bad("merge " + std::to_string(rank) + " joins '" + a + "' and '" + b + "', but the vocabulary lacks '" +
            (ia == spelled.end() ? a : ib == spelled.end() ? b : a + b) + "'");
      t.merges_.try_emplace(pair_key(ia->second, ib->second), Merge{rank++, iab->second});  // the first rule wins
    }
    return t;
  }

  struct Merge {
    std::int32_t rank, id;
  };
  static std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }

  // Fills the id tables from (id, bytes) of the tokens and (id, text) of the special
  // tokens; a special token may repeat a token's id with the same text (GPT-2's
  // <|endoftext|> is in both lists).
  void build(const std::vector<std::pair<std::int64_t, std::string>>& tokens,
             const std::vector<std::pair<std::int64_t, std::string>>& specials, const std::string& path) {
    std::int64_t size = 0;
    for (const auto* list : {&tokens, &specials})
      for (const auto& e : *list) size = std::max(size, e.first + 1);
    // Ids index tables of `size` entries: a few stray large ids must not allocate gigabytes.
    const auto count = static_cast<std::int64_t>(tokens.size() + specials.size());
    PTRAIN_CHECK(size <= 4 * count + 1024, DataError, "[ptrain.tokenizer.vocab] '", path, "': the largest id is ",
                 size - 1, " for ", count, " tokens; a vocabulary numbers its tokens 0, 1, 2, ...");
    bytes_.assign(static_cast<std::size_t>(size), {});
    known_.assign(static_cast<std::size_t>(size), false);
    for (const auto& [id, bytes] : tokens) {
      PTRAIN_CHECK(!known_[id], DataError, "[ptrain.tokenizer.vocab] '", path, "': id ", id,
                   " belongs to two tokens; the file is corrupt");
      known_[id] = true;
      bytes_[id] = bytes;
      ids_.try_emplace(bytes, static_cast<std::int32_t>(id));
    }
    for (const auto& [id, content] : specials) {
      PTRAIN_CHECK(!known_[id] || bytes_[id] == content, DataError, "[ptrain.tokenizer.vocab] '", path,
                   "': special token '", content, "' has id ", id, ", which belongs to another token; the file is "
                   "corrupt");
      known_[id] = true;
      bytes_[id] = content;
      specials_.emplace_back(content, static_cast<std::int32_t>(id));
    }
    std::sort(specials_.begin(), specials_.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  }

  // Note [Llama 3 byte-level BPE], step 3: the leftmost pair of lowest rank, one at a time.
  void merge(std::vector<std::int32_t>& s) const {
    while (s.size() > 1) {
      Merge best{INT32_MAX, -1};
      std::size_t at = 0;
      for (std::size_t i = 0; i + 1 < s.size(); ++i) {
        const auto it = merges_.find(pair_key(s[i], s[i + 1]));
        if (it != merges_.end() && it->second.rank < best.rank) best = it->second, at = i;
      }
      if (best.id < 0) return;
      s[at] = best.id;
      s.erase(s.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
  }

  std::vector<std::string> bytes_;                     // id -> the token's bytes (a special token's text)
  std::vector<bool> known_;                            // ids in the vocabulary
  std::unordered_map<std::string, std::int32_t> ids_;  // token bytes -> id (not special tokens)
  std::vector<std::pair<std::string, std::int32_t>> specials_;  // text -> id, in id order
  std::array<std::int32_t, 256> byte_id_{};            // byte -> id of its token
  std::unordered_map<std::uint64_t, Merge> merges_;    // (left id, right id) -> rank, merged id
  Pattern pattern_ = Pattern::Llama3;
  bool whole_piece_first_ = false;
};

}  // namespace ptrain
