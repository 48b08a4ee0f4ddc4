#pragma once
// The tokenizer tests' fixtures: each Python reference script (next to this file)
// writes its files once per test process, into a folder of its own.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <nlohmann/json.hpp>
#include <unistd.h>

namespace ptrain::test {

/// The folder where `script` (e.g. "bpe_reference.py") wrote its files, run once.
inline const std::filesystem::path& reference_dir(const std::string& script) {
  namespace fs = std::filesystem;
  static std::map<std::string, fs::path> dirs;
  auto it = dirs.find(script);
  if (it == dirs.end()) {
    const fs::path d = fs::temp_directory_path() /
                       ("ptrain_" + script.substr(0, script.find('.')) + "_" + std::to_string(::getpid()));
    fs::remove_all(d);
    fs::create_directories(d);
    // PTRAIN_TESTS_DIR (absolute) rather than __FILE__, which the build may spell relative to its folder.
    const fs::path path = fs::path(PTRAIN_TESTS_DIR) / "unit" / "data" / script;
    REQUIRE(std::system(("/usr/bin/python3 '" + path.string() + "' '" + d.string() + "'").c_str()) == 0);
    it = dirs.emplace(script, d).first;
  }
  return it->second;
}

inline nlohmann::json read_json(const std::filesystem::path& p) {
  nlohmann::json j;
  std::ifstream(p) >> j;
  return j;
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary) << bytes;
}

}  // namespace ptrain::test
