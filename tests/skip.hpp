#pragma once
// Skipping a test so that CTest reports it as skipped, with its reason.
//
// skip_test prints "SKIPPED: <reason>" to stdout and ends the process with exit
// status 77, which the CTest test running it maps to "skipped" through its
// SKIP_RETURN_CODE 77 property. Because it ends the whole process, use it only
// where one process runs one test case: a Catch2 test case that CTest runs on
// its own (catch_discover_tests registers every test case as its own CTest test,
// one process each) or a test executable run by one CTest test. Never in a
// multi-rank test executable: the other ranks would wait for this one forever.
//
// Only a prerequisite that tools/install-deps.sh --test does not install may
// skip (no GPU, no IPv4 address besides loopback, NCCL not configured, not
// root); a missing one that it installs fails the test instead (FAIL with the
// hint "run tools/install-deps.sh --test").

#include <cstdio>
#include <cstdlib>
#include <string>

namespace ptrain::testing {

[[noreturn]] inline void skip_test(const std::string& reason) {
  std::printf("SKIPPED: %s\n", reason.c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(77);
}

}  // namespace ptrain::testing
