// GPT-2's byte-level BPE against bpe_reference.py (next to this file): its own
// trainer and encoder on Python's `regex` module, in Hugging Face's and OpenAI's
// file layouts.
#include <catch2/catch.hpp>
#include <filesystem>
#include <random>
#include <set>
#include <nlohmann/json.hpp>
#include <ptrain/data/bpe.hpp>
#include "reference_files.hpp"

namespace test_bpe {

using namespace ptrain;
using namespace ptrain::test;  // reference_files.hpp: read_file, read_json, write_file
namespace fs = std::filesystem;

namespace {

const fs::path& reference_dir() { return test::reference_dir("bpe_reference.py"); }

}  // namespace

TEST_CASE("BPE encodes as the reference, in both file layouts, and decodes back", "[data][bpe]") {
  const fs::path dir = reference_dir();
  const auto cases = read_json(dir / "cases.json");
  REQUIRE(cases.size() > 50);
  for (const char* layout : {"hf", "openai"}) {
    const auto tok = BpeTokenizer::load((dir / layout).string());
    const auto vocab = read_json(dir / layout / (std::string(layout) == "hf" ? "vocab.json" : "encoder.json"));
    CHECK(tok.vocab_size() == static_cast<std::int64_t>(vocab.size()));
    CHECK(tok.num_merges() == 300);
    REQUIRE(tok.token_id("<|endoftext|>") == std::optional<std::int32_t>(tok.vocab_size() - 1));
    CHECK_FALSE(tok.token_id("no such token").has_value());
    for (const auto& c : cases) {
      const std::string text = c["text"];
      const std::vector<std::int32_t> want = c["ids"];
      INFO(layout << ": " << nlohmann::json(text).dump());
      const auto got = tok.encode(text);
      CHECK(got == want);
      CHECK(tok.decode(got) == text);
    }
    // The larger text, and the end-of-text token as ordinary text (tiktoken's encode_ordinary).
    const std::vector<std::int32_t> corpus_ids = read_json(dir / "corpus.ids.json");
    CHECK(tok.encode(read_file(dir / "corpus.txt")) == corpus_ids);
    CHECK(tok.encode("<|endoftext|>").size() > 1);
    CHECK(tok.decode({*tok.token_id("<|endoftext|>")}) == "<|endoftext|>");
  }
}

TEST_CASE("BPE pre-tokenizer classes match the regex module on every assigned code point", "[data][bpe]") {
  const auto classes = read_json(reference_dir() / "classes.json");
  // Unassigned code points are Other in both (the tables come from the same unicodedata).
  INFO("reference Unicode " << std::string(classes["version"]) << ", tables " << detail::unicode::kVersion);
  const std::pair<const char*, detail::CharClass> kinds[] = {
      {"letters", detail::CharClass::Letter}, {"numbers", detail::CharClass::Number},
      {"spaces", detail::CharClass::Space}};
  std::vector<int> want(0x110000, -1);
  for (const auto& [name, cls] : kinds)
    for (const auto& r : classes[name])
      for (std::uint32_t cp = r[0]; cp <= r[1]; ++cp) want[cp] = static_cast<int>(cls);
  std::int64_t wrong = 0, first = -1;
  for (std::uint32_t cp = 0; cp < 0x110000; ++cp) {
    const int expect = want[cp] < 0 ? static_cast<int>(detail::CharClass::Other) : want[cp];
    if (static_cast<int>(detail::char_class(cp)) != expect) {
      if (first < 0) first = cp;
      ++wrong;
    }
  }
  INFO("first differing code point U+" << std::hex << first);
  CHECK(wrong == 0);
}

TEST_CASE("BPE refuses bad files and bad input with what to do", "[data][bpe]") {
  const fs::path ref = reference_dir() / "hf";
  const fs::path d = fs::temp_directory_path() / ("ptrain_bpe_bad_" + std::to_string(::getpid()));
  fs::create_directories(d);
  const std::string vocab = (ref / "vocab.json").string(), merges = (ref / "merges.txt").string();

  CHECK_THROWS_WITH(BpeTokenizer::load(d.string()), Catch::Contains("[ptrain.data.bpe.missing]"));
  CHECK_THROWS_WITH(BpeTokenizer::from_files((d / "none.json").string(), merges),
                    Catch::Contains("does not exist"));
  write_file(d / "bad.json", "{\"a\": 1,");
  CHECK_THROWS_WITH(BpeTokenizer::from_files((d / "bad.json").string(), merges),
                    Catch::Contains("[ptrain.data.bpe.vocab]") && Catch::Contains("is not JSON"));
  write_file(d / "neg.json", "{\"a\": -1}");
  CHECK_THROWS_WITH(BpeTokenizer::from_files((d / "neg.json").string(), merges), Catch::Contains("has id -1"));
  write_file(d / "dup.json", "{\"a\": 1, \"b\": 1}");
  CHECK_THROWS_WITH(BpeTokenizer::from_files((d / "dup.json").string(), merges),
                    Catch::Contains("id 1 belongs to two tokens"));
  write_file(d / "huge.json", "{\"a\": 0, \"b\": 2000000000}");  // would size tables of 2e9 entries
  CHECK_THROWS_WITH(BpeTokenizer::from_files((d / "huge.json").string(), merges),
                    Catch::Contains("largest id is 2000000000 for 2 tokens"));
  write_file(d / "bytes.json", "{\"a\": 0, \"b\": 1}");  // no token for most bytes
  CHECK_THROWS_WITH(BpeTokenizer::from_files((d / "bytes.json").string(), merges),
                    Catch::Contains("has no token for byte 0"));

  // A merges file of another vocabulary, and a malformed line: the line is named.
  write_file(d / "other.txt", "#version: 0.2\nĠ t\nzz qq\n");
  CHECK_THROWS_WITH(BpeTokenizer::from_files(vocab, (d / "other.txt").string()),
                    Catch::Contains("line 3") && Catch::Contains("do not belong together"));
  write_file(d / "three.txt", "Ġ t h\n");
  CHECK_THROWS_WITH(BpeTokenizer::from_files(vocab, (d / "three.txt").string()),
                    Catch::Contains("line 1") && Catch::Contains("not two tokens"));

  const auto tok = BpeTokenizer::from_files(vocab, merges);
  // Invalid UTF-8: a stray continuation byte, a truncated sequence, an overlong form, a surrogate.
  for (const std::string bad : {"ab\x80", "x\xe6\x97", "\xc0\xaf", "\xed\xa0\x80"})
    CHECK_THROWS_WITH(tok.encode(bad), Catch::Contains("[ptrain.data.bpe.utf8]") && Catch::Contains("iconv"));
  CHECK_THROWS_WITH(tok.encode("ok\xff"), Catch::Contains("byte 2 (0xff)"));
  CHECK_THROWS_WITH(tok.decode({0, static_cast<std::int32_t>(tok.vocab_size())}),
                    Catch::Contains("[ptrain.data.bpe.id]") && Catch::Contains("at index 1"));
  CHECK_THROWS_WITH(tok.decode({-1}), Catch::Contains("[ptrain.data.bpe.id]"));
  fs::remove_all(d);
}

TEST_CASE("BPE: random UTF-8 over every plane round-trips, and the pieces tile the text", "[data][bpe]") {
  const auto tok = BpeTokenizer::load((reference_dir() / "hf").string());
  std::mt19937 rng(7);
  for (int t = 0; t < 2000; ++t) {
    std::string text;
    const int n = static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      // Mostly ASCII (spaces, apostrophes, letters), else any code point but a surrogate.
      std::uint32_t cp = rng() % 3 ? " '\nsa1.\t"[rng() % 8] : rng() % 0x110000;
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD;
      detail::append_utf8(text, cp);
    }
    INFO(nlohmann::json(text).dump());
    std::size_t at = 0;
    detail::for_each_gpt2_piece(text, [&](std::size_t begin, std::size_t end) {
      REQUIRE(begin == at);
      REQUIRE(end > begin);
      at = end;
    });
    REQUIRE(at == text.size());
    REQUIRE(tok.decode(tok.encode(text)) == text);
  }
}

TEST_CASE("BPE: a text cut at piece_boundary_after encodes in parts to the whole's ids", "[data][bpe]") {
  const auto tok = BpeTokenizer::load((reference_dir() / "hf").string());
  std::mt19937 rng(11);
  const std::uint32_t alphabet[] = {'\n', '\n', ' ', ' ', '\'', 's', 'a', '1', '.', '\t', 0xA0, 0x3000, 0x65E5, 0x1F600};
  int cuts = 0;
  for (int t = 0; t < 2000; ++t) {
    std::string text;
    for (int i = static_cast<int>(rng() % 30); i > 0; --i) detail::append_utf8(text, alphabet[rng() % 14]);
    std::set<std::size_t> ends;
    detail::for_each_gpt2_piece(text, [&](std::size_t, std::size_t end) { ends.insert(end); });
    const auto whole = tok.encode(text);
    for (std::size_t p = 0; p < text.size(); ++p) {
      if (detail::piece_boundary_after(text, p) != p) continue;
      INFO(nlohmann::json(text).dump() << " cut at " << p);
      REQUIRE(ends.count(p) == 1);
      std::vector<std::int32_t> parts;
      auto add = [&](const std::vector<std::int32_t>& ids) { parts.insert(parts.end(), ids.begin(), ids.end()); };
      tok.encode_to(text, add, 0, p);
      tok.encode_to(text, add, p);
      REQUIRE(parts == whole);
      ++cuts;
    }
  }
  CHECK(cuts > 1000);
  // Error offsets count from the text's start, also in a part.
  CHECK_THROWS_WITH(tok.encode_to("ab\ncd\xff", [](const auto&) {}, 3), Catch::Contains("byte 5 (0xff)"));
}

}  // namespace test_bpe
