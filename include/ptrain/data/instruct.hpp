#pragma once
// Instruction data for fine-tuning: JSON-lines records rendered with the Llama 3
// Instruct chat template (or a plain one), tokenized, with next-token targets that
// count only the answers, laid out in rows of S tokens, packed or padded.
//
//   auto tok = Tokenizer::load("Meta-Llama-3-8B-Instruct");
//   InstructDataset<float> data("train.jsonl", tok, {.seq_len = 2048});
//   Batch<float> b = data.get({0, 1});   // b.ids [2, 2048], b.targets [2, 2048]: -100 outside the answers
//
// Note [Instruction records]
// A line is {"prompt": p, "completion": c} (a user message p and an assistant
// message c) or {"messages": [{"role": "system" | "user" | "assistant", "content":
// ...}, ...]}; blank lines are skipped; a record needs an assistant message (there
// is nothing else to learn). A bad line throws DataError [ptrain.instruct.record]
// naming the file, the line and the problem.
// - ChatTemplate::Llama3 renders as Meta's tokenizer_config.json chat_template
//   (add_generation_prompt false): <|begin_of_text|>, then for each message
//   <|start_header_id|>ROLE<|end_header_id|>\n\n + content stripped (Jinja's trim,
//   Python's str.strip) + <|eot_id|> (render_llama3 gives the text).
// - ChatTemplate::Plain: the document separator (Tokenizer::document_separator),
//   each message's content as it is, no headers, then the end-of-text token
//   (<|end_of_text|>, <|endoftext|> or </s>).
// Special tokens go in by id; the text between them is encoded as ordinary text, so
// special-token text inside a message stays text (Hugging Face's tokenizer would
// read it as the token). The header's "\n\n" and the content are encoded apart
// (as TRL encodes prompt and completion apart); Llama 3's pattern always ends a
// piece at the first character after the line feeds, so the ids are those of the
// rendered text.
//
// Note [Answer masks]
// The answer tokens are every assistant message's content and the token that
// closes it (<|eot_id|>, or the plain template's end-of-text), which the model
// learns to emit, as TRL's DataCollatorForCompletionOnlyLM does; headers, system
// and user messages are context. targets[i] = ids[i + 1] where token i + 1 is an
// answer token, else -100 (the ignore index of nn::CrossEntropyLoss); a record's
// last position gets -100, so no record predicts the next one's first token.
//
// Note [Packing and padding]
// - Packed: records in file order fill rows of S tokens; a record that does not fit
//   in what is left of a row starts the next one, and the rest of the row is padding
//   (the template's closing token, targets -100). Every record starts with the
//   document separator (<|begin_of_text|>), so the packed-document masks of
//   nn/batch_context.hpp (separator = that id) keep records apart: a token attends
//   only to its own record and positions restart at each record.
// - Padded: one record per row, padded the same way.
// - A record longer than S (Overlong::Truncate, the default, as TRL's
//   max_seq_length): its first S tokens, with their targets (the last one predicts
//   token S when that is an answer token); Overlong::Drop leaves it out. truncated()
//   and dropped() count them.
// Rows are built once, at construction, in file order: get() only copies rows,
// so it is deterministic and safe to call from several threads at once.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/data/dataset.hpp"
#include "ptrain/data/tokenizer.hpp"

namespace ptrain {

struct ChatMessage {
  std::string role;  ///< "system", "user" or "assistant"
  std::string content;
};
/// One record: its messages in order.
using ChatRecord = std::vector<ChatMessage>;

enum class ChatTemplate { Llama3, Plain };
enum class InstructLayout { Packed, Padded };
enum class Overlong { Truncate, Drop };

struct InstructOptions {
  std::int64_t seq_len = 2048;  ///< S: tokens per row
  ChatTemplate chat_template = ChatTemplate::Llama3;
  InstructLayout layout = InstructLayout::Packed;  ///< Note [Packing and padding]
  Overlong overlong = Overlong::Truncate;          ///< a record longer than S
};

namespace detail {

/// Python's str.isspace() for one code point (what Jinja's trim strips).
inline bool python_space(std::uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/// s without leading and trailing white space, as Python's str.strip() (UTF-8 in and out).
inline std::string_view python_strip(std::string_view s) {
  std::size_t begin = s.size(), end = 0;
  for (std::size_t i = 0; i < s.size();) {
    const auto [cp, len] = utf8_at(s, i);
    if (!python_space(cp)) {
      if (begin == s.size()) begin = i;
      end = i + len;
    }
    i += len;
  }
  return begin < end ? s.substr(begin, end - begin) : std::string_view();
}

}  // namespace detail

/// A record from its JSON (Note [Instruction records]); `where` ("file:line") starts each error.
inline ChatRecord parse_chat_record(const nlohmann::json& j, const std::string& where) {
  auto bad = [&](const std::string& what) {
    PTRAIN_THROW(DataError, "[ptrain.instruct.record] ", where, ": ", what, "; each line must be {\"prompt\": ..., ",
                 "\"completion\": ...} or {\"messages\": [{\"role\": \"user\", \"content\": ...}, ...]}");
  };
  if (!j.is_object()) bad("the line is " + std::string(j.type_name()) + ", not a JSON object");
  const bool pc = j.contains("prompt") || j.contains("completion"), chat = j.contains("messages");
  if (pc && chat) bad("the record has both \"messages\" and \"prompt\"/\"completion\"");
  ChatRecord r;
  if (pc) {
    for (const char* key : {"prompt", "completion"})
      if (!j.contains(key) || !j[key].is_string()) bad(std::string("\"") + key + "\" is missing or not a string");
    r.push_back({"user", j["prompt"].get<std::string>()});
    r.push_back({"assistant", j["completion"].get<std::string>()});
    return r;
  }
  if (!chat) bad("the record has neither \"messages\" nor \"prompt\" and \"completion\"");
  const nlohmann::json& m = j["messages"];
  if (!m.is_array() || m.empty()) bad("\"messages\" is not a non-empty array");
  bool answer = false;
  for (std::size_t i = 0; i < m.size(); ++i) {
    const std::string at = "message " + std::to_string(i);
    if (!m[i].is_object() || !m[i].contains("role") || !m[i]["role"].is_string() || !m[i].contains("content") ||
        !m[i]["content"].is_string())
      bad(at + " is not an object with string \"role\" and \"content\"");
    const std::string role = m[i]["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant")
      bad(at + " has role \"" + role + "\"; the roles are system, user and assistant");
    answer = answer || role == "assistant";
    r.push_back({role, m[i]["content"].get<std::string>()});
  }
  if (!answer) bad("no message has role \"assistant\", so the record has nothing to learn");
  return r;
}

/// Every record of a JSON-lines file, in order (blank lines skipped).
inline std::vector<ChatRecord> read_chat_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  PTRAIN_CHECK(in.good(), DataError, "[ptrain.instruct.file] cannot open '", path,
               "'; pass a JSON-lines file of instruction records");
  std::vector<ChatRecord> out;
  std::string line;
  for (std::int64_t n = 1; std::getline(in, line); ++n) {
    if (detail::python_strip(line).empty()) continue;
    const std::string where = path + ":" + std::to_string(n);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      PTRAIN_THROW(DataError, "[ptrain.instruct.record] ", where, ": not JSON (", e.what(),
                   "); each line of a JSON-lines file is one JSON object");
    }
    out.push_back(parse_chat_record(j, where));
  }
  PTRAIN_CHECK(!out.empty(), DataError, "[ptrain.instruct.file] '", path, "' holds no records");
  return out;
}

/// The text Meta's Llama 3 Instruct chat_template renders for `r` (add_generation_prompt false).
inline std::string render_llama3(const ChatRecord& r) {
  std::string s = "<|begin_of_text|>";
  for (const auto& m : r)
    s += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + std::string(detail::python_strip(m.content)) +
         "<|eot_id|>";
  return s;
}

/// A record's token ids and which of them are answer tokens (Note [Answer masks]).
struct TokenizedRecord {
  std::vector<std::int32_t> ids;
  std::vector<bool> answer;
};

/// Renders and tokenizes `r` with `tmpl` (Note [Instruction records]).
inline TokenizedRecord tokenize_chat(const Tokenizer& tok, const ChatRecord& r, ChatTemplate tmpl) {
  auto special = [&](std::initializer_list<const char*> names, const char* role) {
    for (const char* n : names)
      if (const auto id = tok.token_id(n)) return *id;
    PTRAIN_THROW(DataError, "[ptrain.instruct.template] the ", tok.kind_name(), " tokenizer has no ", *names.begin(),
                 " (", role, "), which the ", tmpl == ChatTemplate::Llama3 ? "Llama 3" : "plain", " template needs; ",
                 "the Llama 3 template needs Llama 3's tokenizer (tokenizer.json or original/tokenizer.model), the ",
                 "plain one a tokenizer with an end-of-text token");
  };
  TokenizedRecord t;
  auto add = [&](const std::vector<std::int32_t>& ids, bool answer) {
    t.ids.insert(t.ids.end(), ids.begin(), ids.end());
    t.answer.insert(t.answer.end(), ids.size(), answer);
  };
  if (tmpl == ChatTemplate::Llama3) {
    const std::int32_t bos = special({"<|begin_of_text|>"}, "the first token"),
                       start = special({"<|start_header_id|>"}, "a header's start"),
                       end = special({"<|end_header_id|>"}, "a header's end"),
                       eot = special({"<|eot_id|>"}, "the end of a message");
    add({bos}, false);
    for (const auto& m : r) {
      const bool answer = m.role == "assistant";
      add({start}, false);
      add(tok.encode(m.role), false);
      add({end}, false);
      add(tok.encode("\n\n"), false);
      add(tok.encode(detail::python_strip(m.content)), answer);
      add({eot}, answer);
    }
  } else {
    const std::optional<std::int32_t> sep = tok.document_separator();
    PTRAIN_CHECK(sep.has_value(), DataError, "[ptrain.instruct.template] the ", tok.kind_name(),
                 " tokenizer has no document separator (<|endoftext|>, <|begin_of_text|> or a BOS) to start each "
                 "record with; use a tokenizer that has one");
    add({*sep}, false);
    for (const auto& m : r) add(tok.encode(m.content), m.role == "assistant");
    add({special({"<|end_of_text|>", "<|endoftext|>", "</s>"}, "the end of the text")},
        r.back().role == "assistant");
  }
  return t;
}

/// Next-token targets of a record: ids[i + 1] where token i + 1 is an answer token, else -100.
inline std::vector<std::int32_t> answer_targets(const TokenizedRecord& r) {
  std::vector<std::int32_t> t(r.ids.size(), -100);
  for (std::size_t i = 0; i + 1 < r.ids.size(); ++i)
    if (r.answer[i + 1]) t[i] = r.ids[i + 1];
  return t;
}

/// Instruction records as rows of S token ids and their masked next-token targets
/// (Notes [Instruction records], [Answer masks], [Packing and padding]).
template <class T>
class InstructDataset : public Dataset<T> {
 public:
  InstructDataset(const std::vector<ChatRecord>& records, const Tokenizer& tok, InstructOptions o) : o_(o) {
    PTRAIN_CHECK(o.seq_len >= 2, Error, "[ptrain.instruct.options] seq_len must be >= 2, got ", o.seq_len);
    const auto S = static_cast<std::size_t>(o.seq_len);
    std::size_t used = S;  // tokens in the current row; S: no row open
    for (const auto& r : records) {
      const TokenizedRecord rec = tokenize_chat(tok, r, o.chat_template);
      const std::vector<std::int32_t> targets = answer_targets(rec);
      std::size_t len = rec.ids.size();
      if (len > S) {
        if (o.overlong == Overlong::Drop) {
          ++dropped_;
          continue;
        }
        ++truncated_;
        len = S;
      }
      if (pad_ < 0) pad_ = rec.ids.back();  // the template's closing token
      if (o.layout == InstructLayout::Padded || used + len > S) {
        ids_.resize(ids_.size() + S, pad_);
        targets_.resize(targets_.size() + S, -100);
        used = 0;
      }
      const std::size_t at = ids_.size() - S + used;
      for (std::size_t i = 0; i < len; ++i) {
        ids_[at + i] = rec.ids[i];
        targets_[at + i] = targets[i];
        answer_tokens_ += targets[i] != -100;
      }
      used += len;
    }
    PTRAIN_CHECK(!ids_.empty(), DataError, "[ptrain.instruct.empty] none of the ", records.size(),
                 " records fits in seq_len ", o.seq_len, " tokens (", dropped_,
                 " dropped); raise seq_len or use Overlong::Truncate");
  }
  /// The records of a JSON-lines file (read_chat_records).
  InstructDataset(const std::string& path, const Tokenizer& tok, InstructOptions o)
      : InstructDataset(read_chat_records(path), tok, o) {}

  /// Rows of seq_len tokens.
  std::int64_t size() const override { return static_cast<std::int64_t>(ids_.size()) / o_.seq_len; }
  /// ids [B, S] and targets [B, S] of rows `idx` (a copy; safe from several threads).
  Batch<T> get(const std::vector<std::int64_t>& idx) override {
    const std::int64_t B = static_cast<std::int64_t>(idx.size()), S = o_.seq_len;
    auto ids = Tensor<std::int32_t>::empty({B, S});
    auto targets = Tensor<std::int32_t>::empty({B, S});
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t row = idx[static_cast<std::size_t>(b)];
      PTRAIN_CHECK(row >= 0 && row < size(), Error, "[ptrain.instruct.index] row ", row, " is outside [0, ", size(),
                   ")");
      std::copy_n(ids_.begin() + row * S, S, ids.data() + b * S);
      std::copy_n(targets_.begin() + row * S, S, targets.data() + b * S);
    }
    return {Tensor<T>(), ids, nn::Targets<T>(targets)};
  }
  bool masks_targets() const override { return true; }

  std::int64_t seq_len() const { return o_.seq_len; }
  /// Targets that count (answer tokens) over all rows.
  std::int64_t answer_tokens() const { return answer_tokens_; }
  /// Records cut to seq_len, and records left out (Overlong::Drop).
  std::int64_t truncated() const { return truncated_; }
  std::int64_t dropped() const { return dropped_; }
  /// The id that fills the ends of rows.
  std::int32_t pad_id() const { return pad_; }

 private:
  InstructOptions o_;
  std::vector<std::int32_t> ids_, targets_;  // rows of seq_len, one after another
  std::int32_t pad_ = -1;
  std::int64_t answer_tokens_ = 0, truncated_ = 0, dropped_ = 0;
};

}  // namespace ptrain
