#pragma once
// Number checks for the examples' flags, with short messages: CLI11's
// PositiveNumber prints the whole double range, and for a word it reports a range too.
//   --steps: abc is not a number        --epochs: -2 must be > 0

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
