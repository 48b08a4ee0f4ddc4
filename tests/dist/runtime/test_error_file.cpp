// ptrain::dist::record_error: the exception a program ends with, in torchrun's error-file
// shape at TORCHELASTIC_ERROR_FILE (what torchrun's and ptrun's agents copy for the
// scheduler); nothing without the variable.

#include <catch2/catch.hpp>

#include <cstdlib>
#include <ctime>
#include <nlohmann/json.hpp>
#include <string>

#include "process_util.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/dist/error_file.hpp"

namespace test_error_file {

using ptrain_test::TempDir;

namespace {
// TORCHELASTIC_ERROR_FILE for one scope.
struct ErrorFileVar {
  explicit ErrorFileVar(const std::string& path) { ::setenv("TORCHELASTIC_ERROR_FILE", path.c_str(), 1); }
  ~ErrorFileVar() { ::unsetenv("TORCHELASTIC_ERROR_FILE"); }
};
}  // namespace

TEST_CASE("record_error writes the exception in torchrun's error-file shape", "[error_file]") {
  TempDir dir;
  const std::string path = dir.file("error.json");
  ErrorFileVar var(path);
  const long long t0 = static_cast<long long>(std::time(nullptr));
  try {
    throw ptrain::CommError("[ptrain.dist.test] the peer hung up");
  } catch (const std::exception& e) {
    CHECK(ptrain::dist::record_error(e));
  }
  const auto j = nlohmann::json::parse(ptrain_test::read_text(path));
  // Exactly torchrun's keys (ErrorHandler.record_exception): a reader of torchrun's files reads these.
  REQUIRE(j.size() == 1);
  const auto& m = j.at("message");
  CHECK(m.size() == 2);
  CHECK(m.at("message") == "ptrain::CommError: [ptrain.dist.test] the peer hung up");
  CHECK(m.at("extraInfo").size() == 2);
  CHECK(m.at("extraInfo").at("py_callstack") == m.at("message"));
  const std::string stamp = m.at("extraInfo").at("timestamp");  // a string of seconds, as torchrun's
  CHECK(std::stoll(stamp) >= t0);
  CHECK(std::stoll(stamp) <= static_cast<long long>(std::time(nullptr)));

  // A second failure replaces the first; a plain message works too.
  CHECK(ptrain::dist::record_error(std::string("out of patience")));
  CHECK(nlohmann::json::parse(ptrain_test::read_text(path))["message"]["message"] == "out of patience");
}

TEST_CASE("record_error without TORCHELASTIC_ERROR_FILE, or where it cannot write, returns false", "[error_file]") {
  ::unsetenv("TORCHELASTIC_ERROR_FILE");
  CHECK_FALSE(ptrain::dist::record_error(std::string("nowhere to go")));
  TempDir dir;
  ErrorFileVar var(dir.file("missing/folder/error.json"));
  CHECK_FALSE(ptrain::dist::record_error(std::runtime_error("x")));
  CHECK_FALSE(ptrain_test::file_exists(dir.file("missing")));
}

}  // namespace test_error_file
