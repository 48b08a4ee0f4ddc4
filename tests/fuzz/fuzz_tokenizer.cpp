// libFuzzer target: tokenizer files. The first byte modulo 4 picks the format:
//   0: a GPT-2 BPE vocabulary (JSON) and merges file, split at the first
//      "\n%%\n" (data/bpe.hpp, BpeTokenizer::from_files); a tokenizer that
//      loads must encode text and decode it back to the same bytes;
//   1: a character tokenizer's JSON (data/text.hpp, CharTokenizer::load),
//      with the same round trip over its own characters;
//   2: a Hugging Face tokenizer.json (data/ranked_bpe.hpp), round trip as in 0;
//   3: tiktoken ranks (data/ranked_bpe.hpp), round trip as in 0.
// Anything else must be refused with DataError.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>

#include <ptrain/data/bpe.hpp>
#include <ptrain/data/ranked_bpe.hpp>
#include <ptrain/data/text.hpp>

namespace {

std::string write(const std::string& name, std::string_view bytes) {
  const std::string path = "/tmp/ptrain_fuzz_" + name + "_" + std::to_string(::getpid());
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    const std::string text = "Hello, world! 123 \xc3\xa9t\xc3\xa9  \n\tend it's\r\n";
    auto round_trip = [&](const auto& tok) {
      if (tok.decode(tok.encode(text)) != text) std::abort();
    };
    if (data[0] % 4 == 0) {
      const std::size_t cut = in.find("\n%%\n");
      const std::string vocab = write("vocab", in.substr(0, cut));
      const std::string merges = write("merges", cut == std::string_view::npos ? std::string_view() : in.substr(cut + 4));
      round_trip(ptrain::BpeTokenizer::from_files(vocab, merges));
    } else if (data[0] % 4 == 2) {
      round_trip(ptrain::RankedBpeTokenizer::from_tokenizer_json(write("tokenizer_json", in)));
    } else if (data[0] % 4 == 3) {
      round_trip(ptrain::RankedBpeTokenizer::from_tiktoken(write("tiktoken", in)));
    } else {
      const auto tok = ptrain::CharTokenizer::load(write("chars", in));
      for (std::int64_t id = 0; id < tok.vocab_size(); ++id) {
        const std::string s = tok.decode({static_cast<std::int32_t>(id)});
        const auto back = tok.encode(s);
        if (back.size() != 1 || back[0] != id) std::abort();
      }
    }
  } catch (const ptrain::DataError&) {
  }
  return 0;
}
