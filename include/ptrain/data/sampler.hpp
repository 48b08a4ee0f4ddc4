#pragma once
// DistributedSampler: each rank's share of a data set for one epoch, as
// torch.utils.data.DistributedSampler does it.
//
// The epoch's order is shuffled_indices(n, seed, epoch), identical on every
// rank. It is made divisible by the world size, by repeating its first
// indices (pad) or dropping its tail (drop_last), and rank r takes positions
// r, r + world, r + 2 world, ... So the shards are disjoint (up to padding)
// and together cover the data set. position() counts the samples this rank
// consumed in the current epoch; a checkpoint saves (epoch, position) and a
// resumed run continues with the next sample.

#include <cstdint>
#include <vector>

#include "ptrain/data/batches.hpp"

namespace ptrain {

class DistributedSampler {
 public:
  DistributedSampler(std::int64_t dataset_size, int rank, int world_size, std::uint64_t seed, bool shuffle = true,
                     bool drop_last = false)
      : n_(dataset_size), rank_(rank), world_(world_size), seed_(seed), shuffle_(shuffle), drop_last_(drop_last) {
    PTRAIN_CHECK(world_size > 0 && rank >= 0 && rank < world_size, Error, "[ptrain.sampler] rank ", rank,
                 " is not in [0, ", world_size, ")");
    PTRAIN_CHECK(dataset_size >= 0, Error, "[ptrain.sampler] negative data set size ", dataset_size);
    PTRAIN_CHECK(!drop_last || dataset_size >= world_size || dataset_size == 0, Error, "[ptrain.sampler] ",
                 dataset_size, " samples cannot be split over ", world_size, " ranks with drop_last");
    set_epoch(0);
  }

  /// Starts epoch e at its beginning (or at `position` samples in, when resuming).
  void set_epoch(std::uint64_t epoch, std::int64_t position = 0) {
    epoch_ = epoch;
    std::vector<std::int64_t> order;
    if (shuffle_) {
      order = shuffled_indices(n_, seed_, epoch);
    } else {
      order.resize(static_cast<std::size_t>(n_));
      for (std::int64_t i = 0; i < n_; ++i) order[static_cast<std::size_t>(i)] = i;
    }
    const std::int64_t per_rank = drop_last_ ? n_ / world_ : (n_ + world_ - 1) / world_;
    indices_.assign(static_cast<std::size_t>(per_rank), 0);
    for (std::int64_t k = 0; k < per_rank; ++k) {
      const std::int64_t pos = rank_ + k * world_;
      indices_[static_cast<std::size_t>(k)] = order[static_cast<std::size_t>(pos % n_)];  // pad wraps around
    }
    PTRAIN_CHECK(position >= 0 && position <= per_rank, Error, "[ptrain.sampler] position ", position,
                 " is outside this epoch's ", per_rank, " samples");
    position_ = position;
  }

  /// Up to `batch` next indices of this rank (fewer at the end of the epoch,
  /// none when it is over); advances position().
  std::vector<std::int64_t> next(std::int64_t batch) {
    const std::int64_t len = std::min<std::int64_t>(batch, num_samples() - position_);
    std::vector<std::int64_t> out(indices_.begin() + position_, indices_.begin() + position_ + len);
    position_ += len;
    return out;
  }

  /// Samples per rank in an epoch.
  std::int64_t num_samples() const { return static_cast<std::int64_t>(indices_.size()); }
  /// This rank's indices for the current epoch.
  const std::vector<std::int64_t>& indices() const { return indices_; }
  std::uint64_t epoch() const { return epoch_; }
  std::int64_t position() const { return position_; }
  bool epoch_done() const { return position_ >= num_samples(); }

 private:
  std::int64_t n_;
  int rank_, world_;
  std::uint64_t seed_;
  bool shuffle_, drop_last_;
  std::uint64_t epoch_ = 0;
  std::int64_t position_ = 0;
  std::vector<std::int64_t> indices_;
};

}  // namespace ptrain
