#pragma once
// Number checks for the examples' flags, with short messages: CLI11's
// PositiveNumber prints the whole double range, and for a word it reports a range too.
//   --steps: abc is not a number        --epochs: -2 must be > 0
// and parse_command_line, which ends a usage error with exit code 2.

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <string>

inline CLI::Validator number_check(bool allow_zero) {
  return CLI::Validator(
      [allow_zero](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0') return s + " is not a number";
        if (allow_zero ? v >= 0 : v > 0) return "";
        return s + (allow_zero ? " must be >= 0" : " must be > 0");
      },
      allow_zero ? "NUMBER >= 0" : "NUMBER > 0");
}
/// Accepts numbers > 0.
inline const CLI::Validator positive = number_check(false);
/// Accepts numbers >= 0.
inline const CLI::Validator non_negative = number_check(true);

/// Parses the command line as CLI11_PARSE does, except that a usage error (an unknown
/// flag, a number that does not convert, a failed check) exits with 2, as argparse and
/// torchrun do, instead of CLI11's own codes (104, 105, ...). Returns -1 to go on, else
/// the exit code (0 after --help).
inline int parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
}
