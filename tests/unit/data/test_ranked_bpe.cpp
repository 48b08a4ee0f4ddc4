// Llama 3's byte-level BPE against llama3_reference.py (next to this file): Llama 3's
// pattern on Python's `regex` module and tiktoken's and Hugging Face's merge algorithms
// written in Python, on a vocabulary it trains and writes as tiktoken ranks and as
// tokenizer.json (merges as strings and as pairs).
#include <catch2/catch.hpp>
#include <filesystem>
#include <random>
#include <set>
#include <nlohmann/json.hpp>
#include <ptrain/data/ranked_bpe.hpp>
#include "reference_files.hpp"

namespace test_ranked_bpe {

using namespace ptrain;
using namespace ptrain::test;  // reference_files.hpp: read_file, read_json, write_file
namespace fs = std::filesystem;

namespace {

const fs::path& reference_dir() { return test::reference_dir("llama3_reference.py"); }

}  // namespace

TEST_CASE("Llama 3 pre-tokenizer splits as the regex module", "[data][tokenizer][llama3]") {
  const auto cases = read_json(reference_dir() / "cases.json");
  REQUIRE(cases.size() > 3000);
  std::int64_t pieces = 0;
  for (const auto& c : cases) {
    const std::string text = c["text"];
    std::vector<std::size_t> got;
    detail::for_each_llama3_piece(text, [&](std::size_t begin, std::size_t end) { got.push_back(end - begin); });
    const std::vector<std::size_t> want = c["pieces"];
    INFO(nlohmann::json(text).dump());
    CHECK(got == want);
    pieces += static_cast<std::int64_t>(want.size());
  }
  CHECK(pieces > 20000);
}

TEST_CASE("Llama 3 BPE from tiktoken ranks and tokenizer.json encodes as the reference", "[data][tokenizer][llama3]") {
  const fs::path dir = reference_dir();
  const auto cases = read_json(dir / "cases.json");
  const std::string corpus = read_file(dir / "corpus.txt");
  REQUIRE(corpus.size() > 1'500'000);
  struct Layout {
    const char* name;
    RankedBpeTokenizer tok;
    const char* ids;
  };
  const Layout layouts[] = {
      {"tiktoken", RankedBpeTokenizer::from_tiktoken((dir / "tokenizer.model").string()), "tiktoken"},
      {"tokenizer.json", RankedBpeTokenizer::from_tokenizer_json((dir / "hf" / "tokenizer.json").string()), "hf"},
      {"tokenizer.json with pairs",
       RankedBpeTokenizer::from_tokenizer_json((dir / "hf_pairs" / "tokenizer.json").string()), "hf"}};
  for (const auto& [name, tok, key] : layouts) {
    INFO(name);
    CHECK(tok.pattern() == RankedBpeTokenizer::Pattern::Llama3);
    // 256 bytes and the merged tokens, then Llama 3's 256 special tokens.
    const auto bos = tok.token_id("<|begin_of_text|>");
    REQUIRE(bos.has_value());
    CHECK(tok.vocab_size() == *bos + 256);
    CHECK(tok.token_id("<|eot_id|>") == std::optional<std::int32_t>(*bos + 9));
    CHECK(tok.token_id("<|reserved_special_token_250|>") == std::optional<std::int32_t>(*bos + 255));
    CHECK(tok.special_tokens().size() == 256);
    std::int64_t compared = 0;
    for (const auto& c : cases) {
      const std::string text = c["text"];
      const std::vector<std::int32_t> want = c[key];
      INFO(nlohmann::json(text).dump());
      const auto got = tok.encode(text);
      CHECK(got == want);
      CHECK(tok.decode(got) == text);
      compared += static_cast<std::int64_t>(want.size());
    }
    const std::vector<std::int32_t> corpus_ids = read_json(dir / (std::string("corpus.") + key + ".json"));
    CHECK(corpus_ids.size() > 500'000);
    const auto got = tok.encode(corpus);
    CHECK(got == corpus_ids);
    CHECK(tok.decode(got) == corpus);
    compared += static_cast<std::int64_t>(corpus_ids.size());
    CHECK(compared > 700'000);
    // Special tokens: ordinary text to encode(), one id to encode_with_specials().
    CHECK(tok.encode("<|begin_of_text|>").size() > 1);
    CHECK(tok.decode({*bos}) == "<|begin_of_text|>");
    const auto hello = tok.encode("Hello");
    std::vector<std::int32_t> want = {*bos};
    want.insert(want.end(), hello.begin(), hello.end());
    want.push_back(*tok.token_id("<|eot_id|>"));
    want.insert(want.end(), hello.begin(), hello.end());
    CHECK(tok.encode_with_specials("<|begin_of_text|>Hello<|eot_id|>Hello") == want);
    CHECK(tok.encode_with_specials("Hello") == hello);
  }
}

TEST_CASE("Llama 3 BPE: a text cut at piece_boundary_after encodes in parts to the whole's ids",
          "[data][tokenizer][llama3]") {
  const auto tok = RankedBpeTokenizer::from_tiktoken((reference_dir() / "tokenizer.model").string());
  std::mt19937 rng(13);
  const std::uint32_t alphabet[] = {'\n', '\n', '\r', ' ', ' ', '\'', 's', 'a', '1', '.', '\t', 0xA0, 0x3000, 0x1F600};
  int cuts = 0;
  for (int t = 0; t < 2000; ++t) {
    std::string text;
    for (int i = static_cast<int>(rng() % 30); i > 0; --i) detail::append_utf8(text, alphabet[rng() % 14]);
    const auto whole = tok.encode(text);
    for (std::size_t p = 0; p < text.size(); ++p) {
      if (detail::piece_boundary_after(text, p) != p) continue;
      INFO(nlohmann::json(text).dump() << " cut at " << p);
      std::vector<std::int32_t> parts;
      auto add = [&](const std::vector<std::int32_t>& ids) { parts.insert(parts.end(), ids.begin(), ids.end()); };
      tok.encode_to(text, add, 0, p);
      tok.encode_to(text, add, p);
      REQUIRE(parts == whole);
      ++cuts;
    }
  }
  CHECK(cuts > 1000);
}

TEST_CASE("Ranked BPE refuses bad and unsupported files by name", "[data][tokenizer][llama3]") {
  const fs::path dir = reference_dir();
  const fs::path d = fs::temp_directory_path() / ("ptrain_llama3_bad_" + std::to_string(::getpid()));
  fs::create_directories(d);
  const auto good = read_json(dir / "hf" / "tokenizer.json");
  auto json_error = [&](const nlohmann::json& j) {
    write_file(d / "t.json", j.dump());
    try {
      RankedBpeTokenizer::from_tokenizer_json((d / "t.json").string());
    } catch (const DataError& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  using Catch::Contains;
  write_file(d / "bad.json", "{\"model\": {");
  CHECK_THROWS_WITH(RankedBpeTokenizer::from_tokenizer_json((d / "bad.json").string()),
                    Contains("[ptrain.tokenizer.json]") && Contains("is not JSON"));
  CHECK_THAT(json_error(nlohmann::json::array()), Contains("[ptrain.tokenizer.json]") && Contains("no \"model\""));
  for (const char* type : {"WordPiece", "Unigram", "WordLevel"}) {
    auto j = good;
    j["model"]["type"] = type;
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.unsupported]") && Contains(type));
  }
  {
    auto j = good;
    j["normalizer"] = {{"type", "NFC"}};
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.unsupported]") && Contains("normalizer"));
    j = good;
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\w+";
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.unsupported]") && Contains("pre_tokenizer"));
    j = good;
    j["pre_tokenizer"] = {{"type", "Metaspace"}};
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.unsupported]") && Contains("Metaspace"));
    j = good;
    j["model"]["byte_fallback"] = true;
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.unsupported]") && Contains("byte_fallback"));
    j = good;
    j["model"]["dropout"] = 0.1;
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.unsupported]") && Contains("dropout"));
    j = good;
    j["model"]["merges"].push_back("zz qq");
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.json]") && Contains("lacks 'zz'"));
    j = good;
    j["model"]["merges"].push_back(nlohmann::json{1, 2});
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.json]") && Contains("neither"));
    j = good;
    j["model"]["vocab"].erase("Ā");  // byte 0's stand-in
    CHECK_THAT(json_error(j), Contains("no token for byte 0"));
    j = good;
    j["model"]["vocab"]["zz"] = 2'000'000'000;
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.vocab]") && Contains("largest id is 2000000000"));
    j = good;
    j["added_tokens"][0]["id"] = j["model"]["vocab"]["a"];
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.vocab]") && Contains("belongs to another token"));
    j = good;
    j["model"]["ignore_merges"] = "yes";  // a field of another JSON type
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.json]") && Contains("type must be boolean"));
    j = good;
    j["pre_tokenizer"]["pretokenizers"][0] = 7;
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.json]"));
    j = good;
    j["added_tokens"][0].erase("content");
    CHECK_THAT(json_error(j), Contains("[ptrain.tokenizer.json]") && Contains("added token"));
  }
  // A GPT-2 style tokenizer.json (ByteLevel with its own regex) splits with GPT-2's pattern.
  {
    auto j = good;
    j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
    write_file(d / "gpt2.json", j.dump());
    const auto tok = RankedBpeTokenizer::from_tokenizer_json((d / "gpt2.json").string());
    CHECK(tok.pattern() == RankedBpeTokenizer::Pattern::Gpt2);
    std::vector<std::size_t> gpt2_cuts, got;
    const std::string text = "Hello 12345 world's\r\n\r\n  x";
    detail::for_each_gpt2_piece(text, [&](std::size_t, std::size_t e) { gpt2_cuts.push_back(e); });
    std::size_t at = 0;
    tok.encode_to(text, [&](const std::vector<std::int32_t>& ids) {
      at += tok.decode(ids).size();
      got.push_back(at);
    });
    CHECK(got == gpt2_cuts);
  }

  // tiktoken ranks: bad base64, a missing rank, a truncated file, a missing byte.
  const std::string ranks = read_file(dir / "tokenizer.model");
  write_file(d / "b64.model", "QQ== 0\nQ!== 1\n");
  CHECK_THROWS_WITH(RankedBpeTokenizer::from_tiktoken((d / "b64.model").string()),
                    Contains("[ptrain.tokenizer.tiktoken]") && Contains("line 2"));
  write_file(d / "norank.model", "QQ==\n");
  CHECK_THROWS_WITH(RankedBpeTokenizer::from_tiktoken((d / "norank.model").string()),
                    Contains("[ptrain.tokenizer.tiktoken]") && Contains("line 1"));
  // Cut inside a line's base64, and inside a rank (which then repeats an earlier one).
  const std::size_t line = ranks.find('\n', ranks.size() / 2) + 1;
  write_file(d / "cut.model", ranks.substr(0, line + 3));
  CHECK_THROWS_WITH(RankedBpeTokenizer::from_tiktoken((d / "cut.model").string()),
                    Contains("[ptrain.tokenizer.tiktoken]") && Contains("is not \"base64 rank\""));
  write_file(d / "cut2.model", ranks.substr(0, ranks.find('\n', line) - 2));
  CHECK_THROWS_WITH(RankedBpeTokenizer::from_tiktoken((d / "cut2.model").string()),
                    Contains("[ptrain.tokenizer.vocab]") && Contains("belongs to two tokens"));
  write_file(d / "few.model", ranks.substr(0, ranks.find('\n', 100) + 1));
  CHECK_THROWS_WITH(RankedBpeTokenizer::from_tiktoken((d / "few.model").string()), Contains("has no rank for byte"));
  write_file(d / "empty.model", "\n");
  CHECK_THROWS_WITH(RankedBpeTokenizer::from_tiktoken((d / "empty.model").string()), Contains("holds no ranks"));

  const auto tok = RankedBpeTokenizer::from_tiktoken((dir / "tokenizer.model").string());
  CHECK_THROWS_WITH(tok.encode("ab\x80"), Contains("[ptrain.data.bpe.utf8]"));
  CHECK_THROWS_WITH(tok.decode({0, static_cast<std::int32_t>(tok.vocab_size())}),
                    Contains("[ptrain.tokenizer.id]") && Contains("at index 1"));
  fs::remove_all(d);
}

TEST_CASE("base64 decoding", "[data][tokenizer][llama3]") {
  CHECK(detail::base64_decode("SGVsbG8=") == std::optional<std::string>("Hello"));
  CHECK(detail::base64_decode("SGk=").value() == "Hi");
  CHECK(detail::base64_decode("SGVs").value() == "Hel");
  CHECK(detail::base64_decode("+/8=").value() == "\xfb\xff");
  CHECK(detail::base64_decode("AA==").value() == std::string(1, '\0'));
  for (const char* bad : {"", "SGV", "SG=s", "S===", "SGk*", "=AAA"}) CHECK_FALSE(detail::base64_decode(bad));
}

}  // namespace test_ranked_bpe
