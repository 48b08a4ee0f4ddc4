// SentencePiece models against Google's Python package: sentencepiece_reference.py
// (next to this file) trains a BPE (Llama 2's options) and a unigram model and encodes
// texts with them; the C++ wrapper must give the same ids.
#ifdef PTRAIN_SENTENCEPIECE
#include <catch2/catch.hpp>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <ptrain/data/sentencepiece.hpp>
#include "reference_files.hpp"

namespace test_sentencepiece {

using namespace ptrain;
using namespace ptrain::test;  // reference_files.hpp: read_file, read_json, write_file
namespace fs = std::filesystem;

namespace {

const fs::path& reference_dir() { return test::reference_dir("sentencepiece_reference.py"); }

}  // namespace

TEST_CASE("SentencePiece BPE and unigram models encode as Google's Python package", "[data][tokenizer][sentencepiece]") {
  const fs::path dir = reference_dir();
  const auto ref = read_json(dir / "cases.json");
  const std::string corpus = read_file(dir / "corpus.txt");
  for (const char* kind : {"bpe", "unigram"}) {
    INFO(kind);
    const auto tok = SentencePieceTokenizer::load((dir / (std::string(kind) + ".model")).string());
    const auto& r = ref[kind];
    CHECK(tok.vocab_size() == r["size"].get<std::int64_t>());
    CHECK(tok.bos_id() == std::optional<std::int32_t>(r["bos"].get<std::int32_t>()));
    CHECK(tok.eos_id() == std::optional<std::int32_t>(r["eos"].get<std::int32_t>()));
    CHECK(tok.token_id("<s>") == tok.bos_id());
    CHECK(tok.token_id("</s>") == tok.eos_id());
    CHECK_FALSE(tok.token_id("no such piece"));
    std::int64_t compared = 0;
    for (const auto& c : r["cases"]) {
      const std::string text = c["text"];
      const std::vector<std::int32_t> want = c["ids"];
      INFO(nlohmann::json(text).dump());
      const auto got = tok.encode(text);
      CHECK(got == want);
      CHECK(tok.decode(got) == c["decoded"].get<std::string>());
      compared += static_cast<std::int64_t>(want.size());
    }
    const std::vector<std::int32_t> corpus_ids = read_json(dir / ("corpus." + std::string(kind) + ".json"));
    CHECK(tok.encode(corpus) == corpus_ids);
    compared += static_cast<std::int64_t>(corpus_ids.size());
    CHECK(compared > 300'000);
  }
}

TEST_CASE("SentencePiece refuses damaged models and bad input", "[data][tokenizer][sentencepiece]") {
  const fs::path dir = reference_dir();
  const fs::path d = fs::temp_directory_path() / ("ptrain_spm_bad_" + std::to_string(::getpid()));
  fs::create_directories(d);
  using Catch::Contains;
  CHECK_THROWS_WITH(SentencePieceTokenizer::load((d / "none.model").string()), Contains("does not exist"));
  const std::string model = read_file(dir / "unigram.model");
  for (const std::size_t cut : {std::size_t{1}, std::size_t{7}, model.size() / 3, model.size() - 5}) {
    INFO("cut at " << cut);
    write_file(d / "cut.model", model.substr(0, cut));
    CHECK_THROWS_WITH(SentencePieceTokenizer::load((d / "cut.model").string()),
                      Contains("[ptrain.tokenizer.sentencepiece]"));
  }
  write_file(d / "text.model", "QQ== 0\nQg== 1\n");  // tiktoken ranks are not a SentencePiece model
  CHECK_THROWS_WITH(SentencePieceTokenizer::load((d / "text.model").string()),
                    Contains("[ptrain.tokenizer.sentencepiece]") && Contains("tiktoken"));
  const auto tok = SentencePieceTokenizer::load((dir / "bpe.model").string());
  CHECK_THROWS_WITH(tok.encode("ab\xff"), Contains("[ptrain.data.bpe.utf8]"));
  CHECK_THROWS_WITH(tok.decode({1, 600}), Contains("[ptrain.tokenizer.id]") && Contains("at index 1"));
  fs::remove_all(d);
}
#endif

}  // namespace test_sentencepiece
