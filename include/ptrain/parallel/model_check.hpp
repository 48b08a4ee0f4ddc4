#pragma once
// Checks that every rank built the same model before a wrapper broadcasts or
// shards its parameters: a mismatch would otherwise corrupt parameters or hang
// in a collective whose sizes differ across ranks.

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "ptrain/dist/communicator.hpp"

namespace ptrain::parallel {

/// Collective over `comm`: throws on every rank, naming the first differing
/// entry of `descriptions` (one line per parameter, e.g. "0.weight [8, 6] F32")
/// and every rank's version of it. Uses fixed-size collectives only, so ranks
/// with different models still make identical calls and nothing hangs.
inline void check_same_model(dist::Communicator& comm, const std::vector<std::string>& descriptions) {
  const int n = comm.size();
  if (n == 1) return;
  const auto count = static_cast<std::int64_t>(descriptions.size());
  std::int64_t max_count = count;
  comm.all_reduce(&max_count, 1, DType::I64, dist::ReduceOp::Max);
  // Per-entry hashes (0 = no such entry), gathered from all ranks.
  std::vector<std::int64_t> mine(static_cast<std::size_t>(max_count), 0);
  for (std::size_t i = 0; i < descriptions.size(); ++i)
    mine[i] = static_cast<std::int64_t>(std::hash<std::string>{}(descriptions[i]) | 1);
  std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(n));
  comm.all_gather(mine.data(), all.data(), mine.size(), DType::I64);
  std::int64_t first_diff = -1;
  for (std::int64_t i = 0; i < max_count && first_diff < 0; ++i)
    for (int r = 1; r < n; ++r)
      if (all[static_cast<std::size_t>(r * max_count + i)] != all[static_cast<std::size_t>(i)]) first_diff = i;
  if (first_diff < 0) return;
  // Second round: every rank's text of the first differing entry, as I64 words.
  constexpr std::size_t kLen = 256;
  std::vector<char> text(kLen, 0), texts(kLen * static_cast<std::size_t>(n));
  const std::string d = first_diff < count ? descriptions[static_cast<std::size_t>(first_diff)] : "(none)";
  std::memcpy(text.data(), d.data(), std::min(d.size(), kLen - 1));
  comm.all_gather(text.data(), texts.data(), kLen / 8, DType::I64);
  std::string report;
  for (int r = 0; r < n; ++r) report += ::ptrain::detail::cat("\n  rank ", r, ": ", texts.data() + r * kLen);
  PTRAIN_THROW(Error, "[ptrain.parallel.mismatch] ranks build different models: parameter #", first_diff,
               " differs:", report, "\nEvery rank must construct the same model (same layers, sizes and order).");
}

}  // namespace ptrain::parallel
