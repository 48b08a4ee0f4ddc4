// libFuzzer target: token files (Note [Token files] in data/text.hpp): raw
// uint16/int32 ids and llm.c shards with their 1024-byte header. The input is
// written to a file and opened in both raw widths. Invariants: the file is
// rejected with DataError, or every token the corpus reports lies inside the
// file (ASan checks each read) and the count agrees with the file's size.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include <ptrain/data/text.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = "/tmp/ptrain_fuzz_tokens_" + std::to_string(::getpid()) + ".bin";
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data),
                                                                static_cast<std::streamsize>(size));
  for (auto format : {ptrain::TokenFormat::U16, ptrain::TokenFormat::I32}) {
    try {
      const auto corpus = ptrain::TokenCorpus::open({path}, format);
      const std::int64_t n = corpus.size();
      if (n <= 0 || static_cast<std::size_t>(n) > size) std::abort();
      volatile std::int64_t sink = corpus.at(0, 0) + corpus.at(0, n - 1);
      (void)sink;
      const auto ids = ptrain::read_token_file(path, format, 1000);  // ids >= 1000 are refused
      if (ids.numel() != n) std::abort();
      for (std::int64_t i = 0; i < n; ++i)
        if (ids.data()[i] < 0 || ids.data()[i] >= 1000) std::abort();
    } catch (const ptrain::DataError&) {
    }
  }
  return 0;
}
