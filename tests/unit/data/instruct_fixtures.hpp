#pragma once
// Fixtures of the instruction-data tests (data/instruct.hpp) and of the masked,
// token-weighted loss tests (tests/unit/train, tests/dist/parallel): a tiny
// byte-level tokenizer written as tiktoken ranks, whose ids a test can write by
// hand, and a few records of different lengths.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>
#include <unistd.h>

#include <ptrain/data/instruct.hpp>

namespace ptrain::test {

/// Standard base64 of `bytes`.
inline std::string base64(const std::string& bytes) {
  static const char* digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (std::size_t i = 0; i < bytes.size(); i += 3) {
    std::uint32_t v = static_cast<unsigned char>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) v |= static_cast<unsigned char>(bytes[i + 1]) << 8;
    if (i + 2 < bytes.size()) v |= static_cast<unsigned char>(bytes[i + 2]);
    const std::size_t left = bytes.size() - i;
    out += digits[(v >> 18) & 63];
    out += digits[(v >> 12) & 63];
    out += left > 1 ? digits[(v >> 6) & 63] : '=';
    out += left > 2 ? digits[v & 63] : '=';
  }
  return out;
}

/// A tiktoken ranks file: the 256 bytes (id = byte) and then `merged` tokens (ids 256,
/// 257, ...; each must split into two earlier tokens); Llama 3's 256 special tokens
/// follow, so with no merges <|begin_of_text|> is 256, <|end_of_text|> 257,
/// <|start_header_id|> 262, <|end_header_id|> 263 and <|eot_id|> 265.
inline std::filesystem::path tiny_tokenizer(const std::string& name, const std::vector<std::string>& merged = {}) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("ptrain_" + name + "_" + std::to_string(::getpid()) + ".tiktoken");
  std::ofstream out(path, std::ios::binary);
  int rank = 0;
  for (int b = 0; b < 256; ++b) out << base64(std::string(1, static_cast<char>(b))) << ' ' << rank++ << '\n';
  for (const auto& m : merged) out << base64(m) << ' ' << rank++ << '\n';
  return path;
}

/// Records of different lengths, both forms, as JSON lines.
inline const char* kInstructLines =
    R"({"prompt": "Hi", "completion": "Yo"}
{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
{"prompt": "Name a colour.", "completion": "  Teal, or maybe red. "}

{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c?"}, {"role": "assistant", "content": "dd"}]}
{"prompt": "Count:", "completion": "1 2 3 4 5 6"}
{"prompt": "x", "completion": "a much longer answer than the others"}
)";

/// kInstructLines in a file of its own.
inline std::filesystem::path instruct_file(const std::string& name, const std::string& lines = kInstructLines) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("ptrain_" + name + "_" + std::to_string(::getpid()) + ".jsonl");
  std::ofstream(path, std::ios::binary) << lines;
  return path;
}

}  // namespace ptrain::test
