// Instruction data (data/instruct.hpp): the Llama 3 rendering against Meta's
// chat_template run by Jinja2 (chat_template_reference.py next to this file), its
// ids against the tokenizer's own reading of the rendered text, and hand-written ids,
// masks, packed and padded rows on a byte-level tokenizer whose ids are the bytes.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <thread>
#include <nlohmann/json.hpp>
#include <ptrain/data/instruct.hpp>
#include <ptrain/nn/batch_context.hpp>

#include "instruct_fixtures.hpp"
#include "reference_files.hpp"

namespace test_instruct {

using namespace ptrain;
namespace fs = std::filesystem;

namespace {

constexpr std::int32_t kBos = 256, kEnd = 257, kStart = 262, kHeaderEnd = 263, kEot = 265, kIgnore = -100;

std::vector<std::int32_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::vector<std::int32_t> cat(std::initializer_list<std::vector<std::int32_t>> parts) {
  std::vector<std::int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::vector<std::int32_t> row(const Tensor<std::int32_t>& t, std::int64_t r) {
  const std::int64_t S = t.size(1);
  return {t.data() + r * S, t.data() + (r + 1) * S};
}

// The error message of `f`, which must throw DataError.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  FAIL("no DataError");
  return {};
}

}  // namespace

TEST_CASE("Llama 3 rendering equals Meta's chat_template in Jinja2, and its ids the rendered text's",
          "[data][instruct][jinja]") {
  if (std::system("/usr/bin/python3 -c 'import jinja2' >/dev/null 2>&1") != 0)
    FAIL("/usr/bin/python3 cannot import jinja2: run tools/install-deps.sh --test (it installs python3-jinja2)");
  const std::string odd = "\xC2\xA0 odd\xE3\x80\x80spaces\x1C\x1F\xE2\x80\xA8";  // U+00A0 ... U+3000 ... U+2028
  std::vector<ChatRecord> records = {
      {{"user", "Hi"}, {"assistant", "Yo"}},
      {{"system", "  Be brief.\n"}, {"user", "\t2+2?  "}, {"assistant", "\n\n4\n\n"}},
      {{"user", "first\n\nsecond"}, {"assistant", ""}, {"user", "   "}, {"assistant", "h\xC3\xA9llo \xE4\xB8\x96\xE7\x95\x8C"}},
      {{"user", odd}, {"assistant", " x y  z "}},
  };
  for (const auto& r : read_chat_records(test::instruct_file("instruct_jinja").string())) records.push_back(r);

  nlohmann::json in = nlohmann::json::array();
  for (const auto& r : records) {
    nlohmann::json msgs = nlohmann::json::array();
    for (const auto& m : r) msgs.push_back({{"role", m.role}, {"content", m.content}});
    in.push_back(msgs);
  }
  const fs::path dir = fs::temp_directory_path() / ("ptrain_chat_template_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  test::write_file(dir / "records.json", in.dump());
  const fs::path script = fs::path(PTRAIN_TESTS_DIR) / "unit/data/chat_template_reference.py";
  REQUIRE(std::system(("/usr/bin/python3 '" + script.string() + "' '" + (dir / "records.json").string() + "' '" +
                       (dir / "out.json").string() + "'")
                          .c_str()) == 0);
  const std::vector<std::string> want = test::read_json(dir / "out.json");
  REQUIRE(want.size() == records.size());

  // Merges that join across the header's "\n\n" and the content if the two were encoded as one piece.
  const fs::path tok_path = test::tiny_tokenizer("instruct_jinja", {"\n\n", "us", "er", "user", "\n\n4", "Hi", " x"});
  const Tokenizer tok = Tokenizer::load(tok_path.string());
  const RankedBpeTokenizer ranked = RankedBpeTokenizer::from_tiktoken(tok_path.string());
  for (std::size_t i = 0; i < records.size(); ++i) {
    INFO("record " << i << ": " << nlohmann::json(want[i]).dump());
    CHECK(render_llama3(records[i]) == want[i]);
    CHECK(tokenize_chat(tok, records[i], ChatTemplate::Llama3).ids == ranked.encode_with_specials(want[i]));
  }
  fs::remove_all(dir);
  fs::remove(tok_path);
}

TEST_CASE("Llama 3 and plain templates give the hand-written ids and answer targets", "[data][instruct]") {
  const fs::path tok_path = test::tiny_tokenizer("instruct_bytes");
  const Tokenizer tok = Tokenizer::load(tok_path.string());
  const ChatRecord r = parse_chat_record(nlohmann::json::parse(R"({"prompt": "Hi", "completion": "Yo"})"), "-");

  const TokenizedRecord l3 = tokenize_chat(tok, r, ChatTemplate::Llama3);
  const auto want = cat({{kBos, kStart}, bytes("user"), {kHeaderEnd}, bytes("\n\nHi"), {kEot, kStart},
                         bytes("assistant"), {kHeaderEnd}, bytes("\n\nYo"), {kEot}});
  CHECK(l3.ids == want);
  std::vector<std::int32_t> targets(want.size(), kIgnore);
  targets[want.size() - 4] = 'Y';  // "Y", "o" and <|eot_id|> are predicted; the header is not
  targets[want.size() - 3] = 'o';
  targets[want.size() - 2] = kEot;
  CHECK(answer_targets(l3) == targets);

  // Plain: separator, prompt, completion, end of text; multi-turn messages keep every assistant turn.
  const TokenizedRecord plain = tokenize_chat(tok, r, ChatTemplate::Plain);
  CHECK(plain.ids == cat({{kBos}, bytes("HiYo"), {kEnd}}));
  CHECK(answer_targets(plain) == std::vector<std::int32_t>{kIgnore, kIgnore, 'Y', 'o', kEnd, kIgnore});
  const ChatRecord turns = parse_chat_record(
      nlohmann::json::parse(R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]})"),
      "-");
  const TokenizedRecord t2 = tokenize_chat(tok, turns, ChatTemplate::Plain);
  CHECK(t2.ids == cat({{kBos}, bytes("abcd"), {kEnd}}));
  CHECK(answer_targets(t2) == std::vector<std::int32_t>{kIgnore, 'b', kIgnore, 'd', kEnd, kIgnore});
  fs::remove(tok_path);

  // GPT-2's files (bytes only, <|endoftext|> 256): the plain template starts and ends with
  // <|endoftext|>; the Llama 3 template has no headers to use and is refused.
  const fs::path gpt2 = fs::temp_directory_path() / ("ptrain_instruct_gpt2_" + std::to_string(::getpid()));
  fs::create_directories(gpt2);
  nlohmann::json vocab;
  for (unsigned b = 0; b < 256; ++b) {
    std::string stand_in;
    detail::append_utf8(stand_in, detail::byte_to_unicode(b));
    vocab[stand_in] = b;
  }
  vocab["<|endoftext|>"] = 256;
  test::write_file(gpt2 / "vocab.json", vocab.dump());
  test::write_file(gpt2 / "merges.txt", "#version: 0.2\n");
  const Tokenizer g = Tokenizer::load(gpt2.string());
  const TokenizedRecord gp = tokenize_chat(g, r, ChatTemplate::Plain);
  CHECK(gp.ids == cat({{256}, bytes("HiYo"), {256}}));
  CHECK(answer_targets(gp) == std::vector<std::int32_t>{kIgnore, kIgnore, 'Y', 'o', 256, kIgnore});
  CHECK_THAT(error_of([&] { (void)tokenize_chat(g, r, ChatTemplate::Llama3); }),
             Catch::Contains("[ptrain.instruct.template] the GPT-2 BPE tokenizer has no <|begin_of_text|>"));
  fs::remove_all(gpt2);
}

TEST_CASE("Instruction records pack into rows that start with the separator, or pad one per row",
          "[data][instruct]") {
  const fs::path tok_path = test::tiny_tokenizer("instruct_pack");
  const Tokenizer tok = Tokenizer::load(tok_path.string());
  const fs::path file = test::instruct_file("instruct_pack", R"({"prompt": "ab", "completion": "c"}
{"prompt": "d", "completion": "ef"}
{"prompt": "g", "completion": "h"}
{"prompt": "ijklmn", "completion": "opq"}
)");
  const std::int32_t P = kEnd, I = kIgnore;  // padding: the plain template's closing token
  // Lengths 5, 5, 4 and 11 in rows of 10: the first two fill a row, the third does not
  // fit with the fourth, and the fourth is cut to 10 tokens; its last target is the
  // end of text that was cut.
  InstructDataset<float> packed(file.string(), tok, {.seq_len = 10, .chat_template = ChatTemplate::Plain});
  REQUIRE(packed.size() == 3);
  CHECK(packed.truncated() == 1);
  CHECK(packed.dropped() == 0);
  CHECK(packed.answer_tokens() == 2 + 3 + 2 + 4);
  CHECK(packed.masks_targets());
  const Batch<float> b = packed.get({0, 1, 2});
  REQUIRE(b.ids.shape() == Shape{3, 10});
  REQUIRE(b.targets.ids().shape() == Shape{3, 10});
  CHECK(row(b.ids, 0) == cat({{kBos}, bytes("abc"), {kEnd, kBos}, bytes("def"), {kEnd}}));
  CHECK(row(b.targets.ids(), 0) == std::vector<std::int32_t>{I, I, 'c', kEnd, I, I, 'e', 'f', kEnd, I});
  CHECK(row(b.ids, 1) == cat({{kBos}, bytes("gh"), {kEnd, P, P, P, P, P, P}}));
  CHECK(row(b.targets.ids(), 1) == std::vector<std::int32_t>{I, 'h', kEnd, I, I, I, I, I, I, I});
  CHECK(row(b.ids, 2) == cat({{kBos}, bytes("ijklmnopq")}));
  CHECK(row(b.targets.ids(), 2) == std::vector<std::int32_t>{I, I, I, I, I, I, 'o', 'p', 'q', kEnd});
  // The packed-document masks see two documents in row 0, starting at the separators.
  CHECK(row(nn::document_starts(b.ids, kBos), 0) == std::vector<std::int32_t>{0, 0, 0, 0, 0, 5, 5, 5, 5, 5});

  InstructDataset<float> dropped(file.string(), tok,
                                 {.seq_len = 10, .chat_template = ChatTemplate::Plain, .overlong = Overlong::Drop});
  CHECK(dropped.size() == 2);
  CHECK(dropped.dropped() == 1);
  CHECK(dropped.truncated() == 0);

  InstructDataset<double> padded(file.string(), tok,
                                 {.seq_len = 10, .chat_template = ChatTemplate::Plain, .layout = InstructLayout::Padded});
  REQUIRE(padded.size() == 4);
  const Batch<double> p = padded.get({1, 3});
  CHECK(row(p.ids, 0) == cat({{kBos}, bytes("def"), {kEnd, P, P, P, P, P}}));
  CHECK(row(p.targets.ids(), 0) == std::vector<std::int32_t>{I, 'e', 'f', kEnd, I, I, I, I, I, I});
  CHECK(row(p.ids, 1) == row(b.ids, 2));

  // Llama 3 rows: every record starts with <|begin_of_text|>, and only that token.
  InstructDataset<float> chat(test::instruct_file("instruct_pack_chat").string(), tok, {.seq_len = 64});
  std::vector<std::int64_t> all(static_cast<std::size_t>(chat.size()));
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::int64_t>(i);
  const Batch<float> c = chat.get(all);
  std::int64_t docs = 0;
  for (std::int64_t r = 0; r < chat.size(); ++r) {
    CHECK(c.ids.data()[r * 64] == kBos);
    docs += std::count(c.ids.data() + r * 64, c.ids.data() + (r + 1) * 64, kBos);
  }
  CHECK(docs == 6);
  CHECK(chat.pad_id() == kEot);
  fs::remove(file);
  fs::remove(tok_path);
}

TEST_CASE("InstructDataset::get is deterministic from several threads", "[data][instruct]") {
  const fs::path tok_path = test::tiny_tokenizer("instruct_threads");
  const Tokenizer tok = Tokenizer::load(tok_path.string());
  InstructDataset<float> data(test::instruct_file("instruct_threads").string(), tok,
                              {.seq_len = 48, .layout = InstructLayout::Padded});
  REQUIRE(data.size() == 6);
  std::vector<std::vector<std::int64_t>> picks = {{0, 1}, {2, 3, 4}, {5, 0}, {4}, {3, 1, 2, 0}};
  std::vector<std::vector<std::int32_t>> want;
  for (const auto& p : picks) {
    const auto b = data.get(p);
    want.push_back(b.ids.to_vector());
    want.push_back(b.targets.ids().to_vector());
  }
  std::vector<int> bad(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 50; ++rep)
        for (std::size_t i = 0; i < picks.size(); ++i) {
          const auto b = data.get(picks[(i + t) % picks.size()]);
          const std::size_t k = (i + t) % picks.size();
          bad[t] += b.ids.to_vector() != want[2 * k] || b.targets.ids().to_vector() != want[2 * k + 1];
        }
    });
  for (auto& th : threads) th.join();
  CHECK(bad == std::vector<int>(4, 0));
  CHECK_THROWS_WITH(data.get({6}), Catch::Contains("[ptrain.instruct.index]"));
  fs::remove(tok_path);
}

TEST_CASE("Bad instruction lines are refused by file, line and problem", "[data][instruct]") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", "not JSON"},
      {"[1, 2]", "the line is array, not a JSON object"},
      {R"({"prompt": "a"})", "\"completion\" is missing or not a string"},
      {R"({"prompt": 1, "completion": "b"})", "\"prompt\" is missing or not a string"},
      {R"({"text": "a"})", "the record has neither \"messages\" nor \"prompt\""},
      {R"({"prompt": "a", "completion": "b", "messages": []})", "the record has both"},
      {R"({"messages": []})", "\"messages\" is not a non-empty array"},
      {R"({"messages": [{"role": "user"}]})", "message 0 is not an object with string \"role\" and \"content\""},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]})",
       "message 1 has role \"bot\""},
      {R"({"messages": [{"role": "user", "content": "a"}]})", "no message has role \"assistant\""},
  };
  for (const auto& [line, problem] : cases) {
    INFO(line);
    // The bad line is the third: a good one and a blank one before it.
    const fs::path file = test::instruct_file("instruct_bad", "{\"prompt\": \"p\", \"completion\": \"c\"}\n\n" + line + "\n");
    const std::string what = error_of([&] { (void)read_chat_records(file.string()); });
    CHECK_THAT(what, Catch::Contains("[ptrain.instruct.record] " + file.string() + ":3: " + problem));
    fs::remove(file);
  }
  CHECK_THAT(error_of([] { (void)read_chat_records("/nonexistent/x.jsonl"); }),
             Catch::Contains("[ptrain.instruct.file] cannot open '/nonexistent/x.jsonl'"));
  const fs::path empty = test::instruct_file("instruct_empty", "\n\n");
  CHECK_THAT(error_of([&] { (void)read_chat_records(empty.string()); }), Catch::Contains("holds no records"));
  fs::remove(empty);

  const fs::path tok_path = test::tiny_tokenizer("instruct_bad_tok");
  const Tokenizer tok = Tokenizer::load(tok_path.string());
  const fs::path file = test::instruct_file("instruct_long");
  CHECK_THAT(error_of([&] {
               InstructDataset<float>(file.string(), tok, {.seq_len = 8, .overlong = Overlong::Drop});
             }),
             Catch::Contains("[ptrain.instruct.empty] none of the 6 records fits in seq_len 8"));
  fs::remove(file);
  fs::remove(tok_path);
}

}  // namespace test_instruct
