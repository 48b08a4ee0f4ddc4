#pragma once
// Checkpoints of a training run: includes every part, in dependency order, so
// that `#include "ptrain/ckpt/checkpoint.hpp"` brings the whole checkpoint API.
//
//   sampler_state.hpp   SamplerState, sampler_state(), restore_sampler()  (Note [Sampler reshape])
//   trainer_state.hpp   TrainerState, GeneratorState and trainer.json
//   files.hpp           directory layout, durable writes, checksums       (Note [Checkpoint layout], [Checksums])
//   pieces.hpp          TensorPiece, ShardedState, piece grouping          (Note [Sharded checkpoints])
//   reader.hpp          Checkpoint (verified reader), restore_trainer_state()
//   manager.hpp         CheckpointManager: save, latest, load, rotation   (Note [Commit protocol])

#include "ptrain/ckpt/sampler_state.hpp"
#include "ptrain/ckpt/trainer_state.hpp"
#include "ptrain/ckpt/files.hpp"
#include "ptrain/ckpt/pieces.hpp"
#include "ptrain/ckpt/reader.hpp"
#include "ptrain/ckpt/manager.hpp"
