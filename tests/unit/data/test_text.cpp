// Token files, the character tokenizer, unigram entropy and random windows.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <ptrain/data/text.hpp>
#include <set>
#include <unistd.h>

namespace test_text {

using namespace ptrain;

namespace {
std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("ptrain_text_" + std::to_string(::getpid()) + "_" + name)).string();
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}
}  // namespace

TEST_CASE("CharTokenizer encodes, decodes, saves and loads", "[data][text]") {
  const std::string text = "hello, world\n\tzz";
  auto tok = CharTokenizer::fit(text);
  REQUIRE(tok.vocab_size() == 12);  // h e l o , space w r d \n \t z
  const auto ids = tok.encode(text);
  // Ids follow byte order: '\t' (9) is the smallest byte, 'z' the largest.
  REQUIRE(ids[14] == tok.vocab_size() - 1);
  REQUIRE(ids[13] == 0);
  REQUIRE(tok.decode(ids) == text);
  REQUIRE_THROWS_WITH(tok.encode("hex"), Catch::Contains("[ptrain.data.tokenizer.unknown]") &&
                                             Catch::Contains("byte 120 at offset 2"));
  REQUIRE_THROWS_AS(tok.decode({0, 12}), DataError);

  const std::string path = temp_path("tok.json");
  tok.save(path);
  auto back = CharTokenizer::load(path);
  REQUIRE(back.chars() == tok.chars());
  REQUIRE(back.encode(text) == ids);
  write_bytes(path, "{\"type\": \"bpe\"}");
  REQUIRE_THROWS_AS(CharTokenizer::load(path), DataError);
  write_bytes(path, "not json");
  REQUIRE_THROWS_AS(CharTokenizer::load(path), DataError);
  write_bytes(path, "{\"type\": [10, 32], \"bytes\": [97]}");  // found by fuzz_tokenizer: a type that is no string
  REQUIRE_THROWS_AS(CharTokenizer::load(path), DataError);
  std::filesystem::remove(path);
}

TEST_CASE("Token files round-trip and are validated", "[data][text]") {
  const std::string path = temp_path("tokens.bin");
  auto t = Tensor<std::int32_t>::from({0, 1, 65535, 300}, {4});
  write_token_file(path, t, TokenFormat::U16);
  REQUIRE(std::filesystem::file_size(path) == 8);
  REQUIRE(read_token_file(path, TokenFormat::U16).to_vector() == t.to_vector());
  // Little-endian on disk: 300 = 0x012C -> bytes 2C 01.
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  REQUIRE(static_cast<unsigned char>(bytes[6]) == 0x2C);
  REQUIRE(static_cast<unsigned char>(bytes[7]) == 0x01);
  REQUIRE_THROWS_WITH(read_token_file(path, TokenFormat::U16, 1000),
                      Catch::Contains("[ptrain.data.tokens.range]") && Catch::Contains("token 2"));

  auto big = Tensor<std::int32_t>::from({70000, 5}, {2});
  REQUIRE_THROWS_AS(write_token_file(path, big, TokenFormat::U16), DataError);
  write_token_file(path, big, TokenFormat::I32);
  REQUIRE(read_token_file(path, TokenFormat::I32).to_vector() == big.to_vector());

  write_bytes(path, std::string("\x01\x00\x02", 3));
  REQUIRE_THROWS_WITH(read_token_file(path, TokenFormat::U16), Catch::Contains("[ptrain.data.tokens.size]"));
  write_bytes(path, "");
  REQUIRE_THROWS_AS(read_token_file(path, TokenFormat::U16), DataError);
  write_bytes(path, std::string("\xff\xff\xff\xff", 4));  // -1 as int32
  REQUIRE_THROWS_AS(read_token_file(path, TokenFormat::I32), DataError);
  std::filesystem::remove(path);
  REQUIRE_THROWS_WITH(read_token_file(path), Catch::Contains("[ptrain.data.tokens.missing]"));
}

TEST_CASE("unigram_entropy matches hand-computed values", "[data][text]") {
  REQUIRE(unigram_entropy(Tensor<std::int32_t>::from({0, 1, 0, 1}, {4}), 2) == Approx(std::log(2.0)));
  REQUIRE(unigram_entropy(Tensor<std::int32_t>::from({2, 2, 2}, {3}), 3) == 0.0);
  const double p = 0.25, q = 0.75;
  REQUIRE(unigram_entropy(Tensor<std::int32_t>::from({1, 0, 0, 0}, {4}), 2) ==
          Approx(-(p * std::log(p) + q * std::log(q))));
}

TEST_CASE("RandomWindows: targets are the next tokens, shards partition the single-process stream",
          "[data][text]") {
  const std::int64_t n = 500, S = 8;
  auto tokens = Tensor<std::int32_t>::empty({n});
  for (std::int64_t i = 0; i < n; ++i) tokens.data()[i] = static_cast<std::int32_t>(i);  // id = position
  RandomWindows single(tokens, S, 42);
  Tensor<double> x;
  Tensor<std::int32_t> y;
  std::set<std::int64_t> starts;
  for (int step = 0; step < 20; ++step) {
    single.next(4, x, y);
    REQUIRE(x.shape() == Shape{4, S});
    for (std::int64_t j = 0; j < 4; ++j) {
      const auto s = static_cast<std::int64_t>(x.at({j, 0}));
      starts.insert(s);
      REQUIRE(s >= 0);
      REQUIRE(s + S + 1 <= n);
      for (std::int64_t i = 0; i < S; ++i) {
        REQUIRE(x.at({j, i}) == static_cast<double>(s + i));
        REQUIRE(y.data()[j * S + i] == s + i + 1);
      }
    }
  }
  REQUIRE(single.position() == 20);
  REQUIRE(starts.size() > 60);  // 80 windows from 492 starts: nearly all distinct

  // Two ranks with batch 2 == one process with batch 4, step by step.
  RandomWindows ref(tokens, S, 7), r0(tokens, S, 7, 0, 2), r1(tokens, S, 7, 1, 2);
  Tensor<float> xa, x0, x1;
  Tensor<std::int32_t> ya, y0, y1;
  for (int step = 0; step < 5; ++step) {
    ref.next(4, xa, ya);
    r0.next(2, x0, y0);
    r1.next(2, x1, y1);
    for (std::int64_t i = 0; i < 2 * S; ++i) {
      REQUIRE(x0.data()[i] == xa.data()[i]);
      REQUIRE(x1.data()[i] == xa.data()[2 * S + i]);
      REQUIRE(y1.data()[i] == ya.data()[2 * S + i]);
    }
  }

  // Resuming at a saved position continues the same stream.
  RandomWindows a(tokens, S, 3), b(tokens, S, 3);
  for (int i = 0; i < 6; ++i) a.next(3, xa, ya);
  b.set_position(5);
  a.set_position(5);
  a.next(3, xa, ya);
  b.next(3, x0, y0);
  REQUIRE(xa.to_vector() == x0.to_vector());
  RandomWindows other_seed(tokens, S, 4);
  other_seed.set_position(5);
  other_seed.next(3, x1, y1);
  REQUIRE(x1.to_vector() != x0.to_vector());

  REQUIRE_THROWS_AS(RandomWindows(tokens.narrow(0, S), S, 1), DataError);  // needs S + 1 tokens
  REQUIRE_THROWS_AS(RandomWindows(tokens, S, 1, 2, 2), DataError);
}

namespace {
// An llm.c shard built byte by byte: 256 little-endian int32 (magic, version, count), then the ids.
std::string llmc_shard(std::int32_t version, std::int32_t count, const std::vector<std::uint32_t>& ids) {
  std::string b(1024, '\0');
  auto put32 = [&](std::size_t at, std::uint32_t v) {
    for (int k = 0; k < 4; ++k) b[at + k] = static_cast<char>((v >> (8 * k)) & 0xFF);
  };
  put32(0, 20240520);
  put32(4, static_cast<std::uint32_t>(version));
  put32(8, static_cast<std::uint32_t>(count));
  for (std::uint32_t v : ids)
    for (int k = 0; k < (version == 1 ? 2 : 4); ++k) b.push_back(static_cast<char>((v >> (8 * k)) & 0xFF));
  return b;
}
}  // namespace

TEST_CASE("TokenCorpus maps nanoGPT files and llm.c shards, and refuses corrupt ones", "[data][text]") {
  const std::string a = temp_path("shard_a.bin"), b = temp_path("shard_b.bin");
  write_bytes(a, llmc_shard(1, 3, {7, 50256, 300}));
  write_bytes(b, llmc_shard(2, 2, {70000, 1}));
  const TokenCorpus c = TokenCorpus::open({a, b});
  REQUIRE(c.num_parts() == 2);
  REQUIRE(c.size() == 5);
  REQUIRE(c.part_name(1) == b);
  REQUIRE(std::vector<std::int64_t>{c.at(0, 0), c.at(0, 1), c.at(0, 2), c.at(1, 0), c.at(1, 1)} ==
          std::vector<std::int64_t>{7, 50256, 300, 70000, 1});
  REQUIRE(read_token_file(a).to_vector() == std::vector<std::int32_t>{7, 50256, 300});  // whatever format is asked

  // A pattern expands to its matches in name order.
  const std::string pattern = temp_path("shard_?.bin");
  REQUIRE(glob_paths({pattern}) == std::vector<std::string>{a, b});
  REQUIRE_THROWS_WITH(glob_paths({temp_path("none_*.bin")}), Catch::Contains("[ptrain.data.tokens.missing]"));

  // Truncated, a count that disagrees with the size, an unknown version.
  std::string bytes = llmc_shard(1, 3, {7, 8, 9});
  write_bytes(a, bytes.substr(0, bytes.size() - 1));
  REQUIRE_THROWS_WITH(TokenCorpus::open({a}), Catch::Contains("[ptrain.data.tokens.size]") &&
                                                  Catch::Contains("header says 3 tokens"));
  write_bytes(a, llmc_shard(1, 4, {7, 8, 9}));
  REQUIRE_THROWS_WITH(TokenCorpus::open({a}), Catch::Contains("[ptrain.data.tokens.size]"));
  write_bytes(a, llmc_shard(3, 3, {7, 8, 9}));
  REQUIRE_THROWS_WITH(TokenCorpus::open({a}), Catch::Contains("[ptrain.data.tokens.header]") &&
                                                  Catch::Contains("version 3"));
  REQUIRE_THROWS_WITH(TokenCorpus::open({}), Catch::Contains("[ptrain.data.tokens.missing]"));
  std::filesystem::remove(a);
  std::filesystem::remove(b);
  REQUIRE_THROWS_WITH(TokenCorpus::open({a}), Catch::Contains("[ptrain.data.tokens.missing]"));
}

TEST_CASE("write_token_shard writes llm.c's layout, whole or not at all", "[data][text]") {
  const std::string a = temp_path("written.bin");
  auto read_all = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  write_token_shard(a, {7, 50256, 300});
  REQUIRE(read_all(a) == llmc_shard(1, 3, {7, 50256, 300}));
  write_token_shard(a, {70000, 1}, /*uint32_ids=*/true);
  REQUIRE(read_all(a) == llmc_shard(2, 2, {70000, 1}));
  REQUIRE_THROWS_WITH(write_token_shard(a, {1, 70000}), Catch::Contains("[ptrain.data.tokens.range]") &&
                                                            Catch::Contains("token 1 is 70000"));
  REQUIRE_THROWS_WITH(write_token_shard(a, {}), Catch::Contains("[ptrain.data.tokens.write]"));
  REQUIRE(read_all(a) == llmc_shard(2, 2, {70000, 1}));  // a refused write leaves the file as it was
  REQUIRE_FALSE(std::filesystem::exists(a + ".tmp"));
  REQUIRE_THROWS_WITH(write_token_shard(temp_path("no/such/dir.bin"), {1}), Catch::Contains("cannot write"));
  std::filesystem::remove(a);
}

TEST_CASE("RandomWindows over token files: the same windows as in memory, never across files", "[data][text]") {
  const std::int64_t S = 8;
  // One file: windows equal those of the same ids in memory.
  auto ids = Tensor<std::int32_t>::empty({300});
  for (std::int64_t i = 0; i < 300; ++i) ids.data()[i] = static_cast<std::int32_t>((i * 37) % 1000);
  const std::string one = temp_path("one.bin");
  write_token_file(one, ids, TokenFormat::U16);
  RandomWindows mem(ids, S, 5, 1, 2), file(TokenCorpus::open({one}), S, 5, 1, 2, 1000);
  Tensor<std::int32_t> xm, xf, ym, yf;
  for (int step = 0; step < 10; ++step) {
    mem.next(4, xm, ym);
    file.next(4, xf, yf);
    REQUIRE(xm.to_vector() == xf.to_vector());
    REQUIRE(ym.to_vector() == yf.to_vector());
  }

  // Three files, ids 10000 * file + position; the middle one is too short for a window.
  // Each window is consecutive ids of one file, and the files are drawn in proportion to
  // their starts (100 - S and 400 - S of 492).
  std::vector<std::string> paths;
  const std::int64_t sizes[] = {100, 5, 400};
  for (std::int64_t f = 0; f < 3; ++f) {
    auto t = Tensor<std::int32_t>::empty({sizes[f]});
    for (std::int64_t i = 0; i < sizes[f]; ++i) t.data()[i] = static_cast<std::int32_t>(10000 * f + i);
    paths.push_back(temp_path("part" + std::to_string(f) + ".bin"));
    write_token_file(paths.back(), t, TokenFormat::I32);
  }
  RandomWindows w(TokenCorpus::open(paths, TokenFormat::I32), S, 11);
  std::int64_t from_first = 0, total = 0;
  Tensor<std::int32_t> x, y;
  for (int step = 0; step < 250; ++step) {
    w.next(8, x, y);
    for (std::int64_t j = 0; j < 8; ++j, ++total) {
      const std::int32_t s = x.data()[j * S];
      REQUIRE(s / 10000 != 1);
      from_first += s / 10000 == 0;
      for (std::int64_t i = 0; i < S; ++i) {
        REQUIRE(x.data()[j * S + i] == s + i);
        REQUIRE(y.data()[j * S + i] == s + i + 1);
      }
      REQUIRE(s % 10000 + S < (s / 10000 == 0 ? 100 : 400));
    }
  }
  // 2000 windows, p = 92 / 484 for the first file: mean 380, sd 17.5.
  REQUIRE(std::abs(static_cast<double>(from_first) - 2000.0 * 92 / 484) < 5 * 17.5);
  REQUIRE(total == 2000);

  // An id outside the vocabulary fails the batch that copies it, naming the file.
  RandomWindows small_vocab(TokenCorpus::open(paths, TokenFormat::I32), S, 11, 0, 1, 10000);
  REQUIRE_THROWS_WITH([&] { for (int step = 0; step < 50; ++step) small_vocab.next(8, x, y); }(),
                      Catch::Contains("[ptrain.data.tokens.range]") && Catch::Contains(paths[2]));
  REQUIRE_THROWS_WITH(RandomWindows(TokenCorpus::open({paths[1]}, TokenFormat::I32), S, 1),
                      Catch::Contains("no part holds a window"));
  for (const auto& p : paths) std::filesystem::remove(p);
  std::filesystem::remove(one);
}

}  // namespace test_text
