#pragma once
// Where a data-parallel sampler stood, independent of the world size, and the
// arithmetic that restarts it on another number of ranks (Note [Sampler reshape]).
//
//   ts.sampler = ckpt::sampler_state(sampler, comm->size());      // at save
//   ckpt::restore_sampler(sampler, *state.sampler, comm->size());  // at load, any world size

#include <algorithm>
#include <cstdint>

#include "ptrain/core/error.hpp"

namespace ptrain::ckpt {

/// Where the data-parallel sampler stood, independent of the world size.
///
/// Note [Sampler reshape]
/// DistributedSampler gives rank r positions r, r + W, r + 2W, ... of one
/// epoch order that does not depend on W. When all W ranks have consumed p
/// samples (they step together under DDP), exactly positions [0, p*W) of that
/// order are done. `consumed` = p*W is saved; on M ranks each rank restarts at
/// p' = consumed / M, so the new ranks continue with positions [consumed, ...)
/// and no sample is skipped or repeated. This needs consumed % M == 0;
/// otherwise restore_sampler throws, unless allow_repeat, in which case it
/// rounds down and at most M - 1 samples are seen twice (none skipped).
/// A position past the data (padding) means the epoch is over.
struct SamplerState {
  std::uint64_t epoch = 0;
  std::int64_t consumed = 0;  ///< global samples consumed in `epoch` (all ranks)
  int world_size = 1;         ///< ranks at save time (for messages)
};

/// The sampler's state, assuming every rank is at the same position (DDP).
template <class Sampler>
SamplerState sampler_state(const Sampler& s, int world_size) {
  return {s.epoch(), s.position() * world_size, world_size};
}

/// Position on one of `world_size` ranks that continues `st` (Note [Sampler reshape]);
/// per_rank_samples is the sampler's num_samples() at the new world size.
inline std::int64_t resume_position(const SamplerState& st, int world_size, std::int64_t per_rank_samples,
                                    bool allow_repeat = false) {
  PTRAIN_CHECK(world_size > 0 && st.consumed >= 0, CheckpointError, "[ptrain.ckpt.reshape] invalid sampler state");
  PTRAIN_CHECK(allow_repeat || st.consumed % world_size == 0, CheckpointError, "[ptrain.ckpt.reshape] the checkpoint "
               "was taken after ", st.consumed, " samples of epoch ", st.epoch, " on ", st.world_size,
               " ranks, which ", world_size, " ranks cannot continue exactly (", st.consumed, " % ", world_size,
               " != 0); resume on a world size that divides ", st.consumed,
               ", or pass allow_repeat to repeat up to ", world_size - 1, " samples");
  return std::min(st.consumed / world_size, per_rank_samples);
}

/// Restarts `s` (a DistributedSampler of the new world) where `st` stopped.
template <class Sampler>
void restore_sampler(Sampler& s, const SamplerState& st, int world_size, bool allow_repeat = false) {
  s.set_epoch(st.epoch);  // computes this world's num_samples() for the epoch
  s.set_epoch(st.epoch, resume_position(st, world_size, s.num_samples(), allow_repeat));
}

}  // namespace ptrain::ckpt
