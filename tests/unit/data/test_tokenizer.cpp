// Tokenizer::load picks the kind from what a folder or file holds, and gives the same
// ids as the kind's own class (each tested against its Python reference beside it).
#include <catch2/catch.hpp>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <ptrain/data/tokenizer.hpp>
#include "reference_files.hpp"

namespace test_tokenizer {

using namespace ptrain;
using test::read_file;
using test::read_json;
using test::reference_dir;
using test::write_file;
namespace fs = std::filesystem;

namespace {

// Every case's ids from the tokenizer equal the reference's `key`.
void check_cases(const Tokenizer& tok, const nlohmann::json& cases, const char* key) {
  std::size_t compared = 0;
  for (const auto& c : cases) {
    const std::string text = c["text"];
    INFO(tok.kind_name() << ": " << nlohmann::json(text).dump());
    const std::vector<std::int32_t> want = c[key];
    CHECK(tok.encode(text) == want);
    compared += want.size();
  }
  CHECK(compared > 1000);
}

}  // namespace

TEST_CASE("Tokenizer loads GPT-2 folders and files as BpeTokenizer", "[data][tokenizer]") {
  const fs::path dir = reference_dir("bpe_reference.py");
  const auto cases = read_json(dir / "cases.json");
  for (const fs::path& p : {dir / "hf", dir / "openai", dir / "hf" / "vocab.json"}) {
    INFO(p);
    const auto tok = Tokenizer::load(p.string());
    CHECK(tok.kind() == Tokenizer::Kind::Gpt2);
    check_cases(tok, cases, "ids");
    CHECK(tok.document_separator() == tok.token_id("<|endoftext|>"));
    CHECK(tok.document_separator() == std::optional<std::int32_t>(tok.vocab_size() - 1));
    CHECK(tok.splits_at_piece_boundaries());
  }
}

TEST_CASE("Tokenizer loads Llama 3's tokenizer.json and tiktoken ranks", "[data][tokenizer][llama3]") {
  const fs::path dir = reference_dir("llama3_reference.py");
  const auto cases = read_json(dir / "cases.json");
  const fs::path d = fs::temp_directory_path() / ("ptrain_tokenizer_" + std::to_string(::getpid()));
  fs::create_directories(d / "meta" / "original");
  fs::copy_file(dir / "tokenizer.model", d / "meta" / "original" / "tokenizer.model",
                fs::copy_options::overwrite_existing);
  const struct {
    fs::path path;
    Tokenizer::Kind kind;
    const char* key;
  } layouts[] = {{dir / "hf", Tokenizer::Kind::TokenizerJson, "hf"},
                 {dir / "hf_pairs" / "tokenizer.json", Tokenizer::Kind::TokenizerJson, "hf"},
                 {dir / "tokenizer.model", Tokenizer::Kind::Tiktoken, "tiktoken"},
                 {d / "meta", Tokenizer::Kind::Tiktoken, "tiktoken"}};  // Meta's original/tokenizer.model
  for (const auto& [path, kind, key] : layouts) {
    INFO(path);
    const auto tok = Tokenizer::load(path.string());
    CHECK(tok.kind() == kind);
    check_cases(tok, cases, key);
    REQUIRE(tok.document_separator().has_value());
    CHECK(tok.document_separator() == tok.token_id("<|begin_of_text|>"));
    CHECK(tok.decode({*tok.document_separator()}) == "<|begin_of_text|>");
    // encode_to in two parts cut at a piece boundary gives the whole's ids.
    const std::string text = "First line's end.\r\n\nSecond  line 12345\nthird";
    const std::size_t cut = detail::piece_boundary_after(text, 5);
    REQUIRE(cut < text.size());
    std::vector<std::int32_t> parts;
    auto add = [&](const std::vector<std::int32_t>& ids) { parts.insert(parts.end(), ids.begin(), ids.end()); };
    tok.encode_to(text, add, 0, cut);
    tok.encode_to(text, add, cut);
    CHECK(parts == tok.encode(text));
  }
  fs::remove_all(d);
}

#ifdef PTRAIN_SENTENCEPIECE
TEST_CASE("Tokenizer loads SentencePiece models", "[data][tokenizer][sentencepiece]") {
  const fs::path dir = reference_dir("sentencepiece_reference.py");
  const auto ref = read_json(dir / "cases.json");
  const fs::path d = fs::temp_directory_path() / ("ptrain_tokenizer_spm_" + std::to_string(::getpid()));
  fs::create_directories(d);
  fs::copy_file(dir / "unigram.model", d / "tokenizer.model", fs::copy_options::overwrite_existing);
  for (const auto& [path, kind] : {std::pair{dir / "bpe.model", "bpe"}, std::pair{d, "unigram"}}) {
    INFO(path);
    const auto tok = Tokenizer::load(path.string());
    CHECK(tok.kind() == Tokenizer::Kind::SentencePiece);
    check_cases(tok, ref[kind]["cases"], "ids");
    CHECK(tok.document_separator() == std::optional<std::int32_t>(ref[kind]["bos"].get<std::int32_t>()));
    CHECK_FALSE(tok.splits_at_piece_boundaries());
    std::vector<std::int32_t> got;
    tok.encode_to("xx Hello world yy", [&](const std::vector<std::int32_t>& ids) { got = ids; }, 3, 14);
    CHECK(got == tok.encode("Hello world"));
  }
  fs::remove_all(d);
}
#else
TEST_CASE("Tokenizer without SentencePiece refuses a SentencePiece model, saying how to get it", "[data][tokenizer]") {
  const fs::path p = fs::temp_directory_path() / ("ptrain_tokenizer_spm_" + std::to_string(::getpid()) + ".model");
  write_file(p, std::string("\x0a\x09\x0a\x05<unk>", 10));  // a protobuf's first piece
  CHECK_THROWS_WITH(Tokenizer::load(p.string()),
                    Catch::Contains("[ptrain.tokenizer.sentencepiece]") && Catch::Contains("libsentencepiece-dev"));
  fs::remove(p);
}
#endif

TEST_CASE("Tokenizer refuses what it cannot read, saying what it looked for", "[data][tokenizer]") {
  const fs::path d = fs::temp_directory_path() / ("ptrain_tokenizer_bad_" + std::to_string(::getpid()));
  fs::create_directories(d / "empty");
  using Catch::Contains;
  CHECK_THROWS_WITH(Tokenizer::load((d / "none").string()), Contains("[ptrain.tokenizer.missing]"));
  CHECK_THROWS_WITH(Tokenizer::load((d / "empty").string()),
                    Contains("[ptrain.tokenizer.missing]") && Contains("tokenizer.json"));
  write_file(d / "notes.txt", "just some text\n");
  CHECK_THROWS_WITH(Tokenizer::load((d / "notes.txt").string()), Contains("[ptrain.tokenizer.format]"));
  write_file(d / "empty.model", "");
  CHECK_THROWS_WITH(Tokenizer::load((d / "empty.model").string()), Contains("[ptrain.tokenizer.format]"));
  write_file(d / "tokenizer.json", "{\"model\": {\"type\": \"Unigram\"}}");
  CHECK_THROWS_WITH(Tokenizer::load(d.string()), Contains("[ptrain.tokenizer.unsupported]") && Contains("Unigram"));
  write_file(d / "bad.model", "QUJD 0\nQ 1\n");
  CHECK_THROWS_WITH(Tokenizer::load((d / "bad.model").string()),
                    Contains("[ptrain.tokenizer.tiktoken]") && Contains("line 2"));
  fs::remove_all(d);
}

}  // namespace test_tokenizer
