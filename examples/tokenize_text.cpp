// Tokenizes text into llm.c's token shards, which gpt_char (--train-tokens,
// --val-tokens) and llm.c-style trainers read, with any tokenizer Tokenizer::load
// reads: GPT-2's files, a tokenizer.json (Llama 3), tiktoken ranks, a SentencePiece model.
//
//   tokenize_text --tokenizer gpt2 --out data/books books/*.txt          # each file is one document
//   tokenize_text --tokenizer gpt2 --out data/owt owt_*.jsonl             # one JSON document per line ("text")
//   tokenize_text --tokenizer Meta-Llama-3-8B --out data/l3 owt_*.jsonl   # <|begin_of_text|> before each
//   gpt_char --train-tokens 'data/books_train_*.bin' --val-tokens data/books_val_000000.bin --tokenizer gpt2
//
// Every document starts with the separator token (--separator; by default
// <|endoftext|> where the vocabulary has it, as in nanoGPT's and llm.c's data
// scripts, else Llama 3's <|begin_of_text|>, else a SentencePiece model's BOS).
// The tokens go into shards of --shard-tokens, in input order: the
// first shard is the validation split (PREFIX_val_000000.bin), the others train
// (PREFIX_train_000001.bin, ...), as llm.c names them. Each shard is llm.c's
// layout (1024-byte header, uint16 ids; uint32 for vocabularies above 65536) and
// appears whole or not at all. A text file is read from a memory mapping, so it may
// be larger than memory; text files (in parts; a SentencePiece model takes each file
// whole) and .jsonl documents are tokenized on --threads threads.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ptrain/data/tokenizer.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cli_checks.hpp"

using namespace ptrain;

namespace {

// Tokens in, shards out (see the top of the file).
class ShardWriter {
 public:
  ShardWriter(std::string prefix, std::int64_t shard_tokens, bool uint32_ids)
      : prefix_(std::move(prefix)), shard_tokens_(shard_tokens), uint32_ids_(uint32_ids) {}

  void add(const std::vector<std::int32_t>& ids) {
    for (std::int32_t id : ids) {
      buf_.push_back(id);
      if (static_cast<std::int64_t>(buf_.size()) == shard_tokens_) flush();
    }
  }
  void flush() {
    if (buf_.empty()) return;
    char name[32];
    std::snprintf(name, sizeof name, "_%s_%06d.bin", shards_ == 0 ? "val" : "train", shards_);
    write_token_shard(prefix_ + name, buf_, uint32_ids_);
    total_ += static_cast<std::int64_t>(buf_.size());
    buf_.clear();
    ++shards_;
  }
  int shards() const { return shards_; }
  std::int64_t total() const { return total_; }

 private:
  std::string prefix_;
  std::int64_t shard_tokens_;
  bool uint32_ids_;
  std::vector<std::int32_t> buf_;
  int shards_ = 0;
  std::int64_t total_ = 0;
};

// Calls batch(documents, where) with the `field` of a .jsonl file's lines, about 64 MB
// at a time (where: "path:line" of each).
template <class F>
void read_jsonl(const std::string& path, const std::string& field, F&& batch) {
  std::ifstream in(path, std::ios::binary);
  PTRAIN_CHECK(in.good(), DataError, "[tokenize_text.input] cannot open '", path, "'; check the path");
  std::vector<std::string> docs, where;
  std::size_t size = 0;
  std::string line;
  for (std::int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      PTRAIN_THROW(DataError, "[tokenize_text.jsonl] ", path, ":", n, " is not JSON (", e.what(), ")");
    }
    PTRAIN_CHECK(j.is_object() && j.contains(field) && j[field].is_string(), DataError, "[tokenize_text.jsonl] ",
                 path, ":", n, " has no string field \"", field, "\"; name the text's field with --field");
    docs.push_back(j[field].get<std::string>());
    where.push_back(path + ":" + std::to_string(n));
    size += docs.back().size();
    if (size >= (64u << 20)) {
      batch(docs, where);
      docs.clear();
      where.clear();
      size = 0;
    }
  }
  if (!docs.empty()) batch(docs, where);
}

// The shards of an earlier run with this prefix: PREFIX_val_*.bin and PREFIX_train_*.bin.
std::vector<std::filesystem::path> existing_shards(const std::string& prefix) {
  namespace fs = std::filesystem;
  const fs::path p(prefix);
  const fs::path folder = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  const std::string stem = p.filename().string();
  std::vector<fs::path> out;
  auto numbered = [](const std::string& name, const std::string& head) {  // head + 6 digits + ".bin"
    return name.size() == head.size() + 10 && name.rfind(head, 0) == 0 && name.ends_with(".bin") &&
           std::all_of(name.begin() + static_cast<std::ptrdiff_t>(head.size()), name.end() - 4,
                       [](char c) { return c >= '0' && c <= '9'; });
  };
  for (const auto& e : fs::directory_iterator(folder)) {
    const std::string name = e.path().filename().string();
    if (numbered(name, stem + "_val_") || numbered(name, stem + "_train_")) out.push_back(e.path());
  }
  return out;
}

// encode(i) for i < n on `threads` threads, each a stride of the i, in order; the
// smallest failing i's error is thrown as "where(i): what".
template <class Encode, class Where>
std::vector<std::vector<std::int32_t>> encode_parallel(std::size_t n, int threads, Encode&& encode, Where&& where) {
  const auto nt = static_cast<std::size_t>(threads);
  std::vector<std::vector<std::int32_t>> ids(n);
  std::vector<std::pair<std::size_t, std::string>> failed(nt, {n, ""});  // each thread's first failure
  std::vector<std::thread> pool;
  for (std::size_t t = 0; t < nt; ++t)
    pool.emplace_back([&, t] {
      for (std::size_t i = t; i < n; i += nt) try {
          ids[i] = encode(i);
        } catch (const Error& e) {
          failed[t] = {i, e.what()};
          return;
        }
    });
  for (auto& th : pool) th.join();
  const auto bad = *std::min_element(failed.begin(), failed.end());
  PTRAIN_CHECK(bad.first == n, DataError, "[tokenize_text.input] ", where(bad.first), ": ", bad.second);
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  std::string tokenizer_dir, out;
  std::vector<std::string> inputs;
  std::int64_t shard_tokens = 100'000'000, part_bytes = 16 << 20;
  std::string field = "text", separator;
  bool no_eot = false, overwrite = false;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  CLI::App app{"Tokenize text files into llm.c token shards (first shard: validation)"};
  app.add_option("--tokenizer", tokenizer_dir, "a tokenizer's folder or file: GPT-2 (vocab.json + merges.txt, or "
                 "encoder.json + vocab.bpe), tokenizer.json (Llama 3), tiktoken ranks or a SentencePiece model")
      ->required();
  app.add_option("--out", out, "prefix of the shards: PREFIX_val_000000.bin, PREFIX_train_000001.bin, ...")
      ->required();
  app.add_option("--shard-tokens", shard_tokens, "tokens per shard (llm.c: 100000000)")->check(positive);
  app.add_option("--field", field, "the text's field in .jsonl inputs");
  auto* sep_opt = app.add_option("--separator", separator, "the token put before each document (default: "
                                 "<|endoftext|>, else <|begin_of_text|>, else the SentencePiece BOS)");
  app.add_flag("--no-eot", no_eot, "no separator before each document")->excludes(sep_opt);
  app.add_flag("--overwrite", overwrite, "remove the shards of an earlier run with this --out first");
  app.add_option("--threads", threads, "tokenizer threads")->check(CLI::Range(1, 1024));
  app.add_option("--part-bytes", part_bytes, "a text file is tokenized in parts of about this size, one per thread")
      ->check(positive);
  app.add_option("inputs", inputs, "text files (one document each) or .jsonl files (one document per line)")
      ->required();
  if (const int rc = parse_command_line(app, argc, argv); rc >= 0) return rc;

  try {
    const auto t0 = std::chrono::steady_clock::now();
    const Tokenizer tok = Tokenizer::load(tokenizer_dir);
    const auto folder = std::filesystem::path(out).parent_path();
    PTRAIN_CHECK(folder.empty() || std::filesystem::is_directory(folder), DataError, "[tokenize_text.out] folder ",
                 folder.string(), " of --out does not exist; create it first");
    // Shards of an earlier run would mix with this run's under a glob ('PREFIX_train_*.bin').
    const auto earlier = existing_shards(out);
    PTRAIN_CHECK(earlier.empty() || overwrite, DataError, "[tokenize_text.out] ", earlier.size(), " shard(s) of an ",
                 "earlier run are there (e.g. ", earlier.empty() ? "" : earlier.front().string(), "); pass ",
                 "--overwrite to remove them first, or choose another --out");
    for (const auto& f : earlier) std::filesystem::remove(f);
    const std::optional<std::int32_t> eot =
        no_eot ? std::nullopt : separator.empty() ? tok.document_separator() : tok.token_id(separator);
    PTRAIN_CHECK(no_eot || eot, DataError, "[tokenize_text.eot] the ", tok.kind_name(), " tokenizer has no ",
                 separator.empty() ? std::string("separator token (<|endoftext|>, <|begin_of_text|> or a BOS)")
                                   : "token '" + separator + "'",
                 "; name one with --separator, or pass --no-eot to write the documents without a separator");

    ShardWriter shards(out, shard_tokens, tok.vocab_size() > 65536);
    std::int64_t docs = 0, bytes = 0;
    for (const std::string& path : inputs) {
      if (std::filesystem::path(path).extension() != ".jsonl") {
        // One document from a mapping: a round of --part-bytes parts per thread, cut where
        // pieces end (detail::piece_boundary_after), so the parts' ids are the whole's; a
        // tokenizer that cannot be cut there (SentencePiece) gets the whole text as one part.
        const detail::MappedFile<DataError> file(path, "[tokenize_text.input]", "check the path");
        const std::string_view text(reinterpret_cast<const char*>(file.data()), file.size());
        if (eot) shards.add({*eot});
        for (std::size_t at = 0; at < text.size();) {
          std::vector<std::pair<std::size_t, std::size_t>> parts;
          for (int t = 0; t < threads && at < text.size(); ++t) {
            parts.emplace_back(at, tok.splits_at_piece_boundaries()
                                       ? detail::piece_boundary_after(text, at + static_cast<std::size_t>(part_bytes))
                                       : text.size());
            at = parts.back().second;
          }
          const auto ids = encode_parallel(
              parts.size(), threads,
              [&](std::size_t i) {
                std::vector<std::int32_t> out;
                tok.encode_to(text, [&](const auto& piece) { out.insert(out.end(), piece.begin(), piece.end()); },
                              parts[i].first, parts[i].second);
                return out;
              },
              [&](std::size_t) { return path; });
          for (const auto& part : ids) shards.add(part);
        }
        docs += 1;
        bytes += static_cast<std::int64_t>(text.size());
        continue;
      }
      read_jsonl(path, field, [&](const std::vector<std::string>& texts, const std::vector<std::string>& where) {
        const auto ids = encode_parallel(
            texts.size(), threads, [&](std::size_t d) { return tok.encode(texts[d]); },
            [&](std::size_t d) { return where[d]; });
        for (std::size_t d = 0; d < texts.size(); ++d) {
          if (eot) shards.add({*eot});
          shards.add(ids[d]);
          bytes += static_cast<std::int64_t>(texts[d].size());
        }
        docs += static_cast<std::int64_t>(texts.size());
      });
    }
    shards.flush();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%lld documents, %lld bytes -> %lld tokens in %d shard(s) (%s*.bin); %.1f s, %.1f MB/s\n",
                static_cast<long long>(docs), static_cast<long long>(bytes), static_cast<long long>(shards.total()),
                shards.shards(), out.c_str(), secs, static_cast<double>(bytes) / 1e6 / secs);
    PTRAIN_CHECK(shards.shards() >= 2, DataError, "[tokenize_text.split] all ", shards.total(), " tokens are in the ",
                 "validation shard, so there is nothing to train on; pass --shard-tokens below ", shards.total(),
                 " (e.g. ", std::max<std::int64_t>(1, shards.total() / 10), ")");
  } catch (const Error& e) {
    std::fprintf(stderr, "tokenize_text: %s\n", e.what());
    return 1;
  }
  return 0;
}
