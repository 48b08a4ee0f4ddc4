#pragma once
// Checkpoints of any Engine (parallel/engine.hpp): one call saves and one
// loads, whatever the mode, and a checkpoint of one mode or world size loads
// into another (the tensors keep the model's names in every mode).
//
//   ckpt::CheckpointManager mgr(dir, &engine->communicator());
//   if (auto last = mgr.latest(); last.found()) state = ckpt::load(mgr, last.path, *engine, &opt);
//   ...
//   ckpt::save(mgr, step, *engine, &opt, state);          // collective
//
// What each mode writes:
//   Local, DDP   rank 0 writes the whole model (model.safetensors, optimizer.safetensors)
//   DDP with expert parallelism  rank 0 writes the dense tensors, replica 0 of each
//                expert-parallel index its experts, under their global names
//   FSDP         every shard group writes its pieces (ckpt/fsdp_checkpoint.hpp); also a
//                context-parallel engine with ContextParallelPlan::fsdp; with expert
//                parallelism the experts' pieces under their global names
//   Pipeline     replica 0 of each stage writes its stage (ckpt/stage_checkpoint.hpp)
//   TensorParallel  rank 0 writes the full tensors, gathered over tp (ckpt/tp_checkpoint.hpp)
// Loading reads the tensors (or the ranges of them) that this rank holds, from
// a checkpoint of any of these. A pipeline resumes its own layout bit for bit
// (per-stage optimizer counts and generators); another layout or mode loads
// its stage's tensors by name.

#include "ptrain/ckpt/async_writer.hpp"
#include "ptrain/ckpt/checkpoint.hpp"
#include "ptrain/ckpt/fsdp_checkpoint.hpp"
#include "ptrain/ckpt/stage_checkpoint.hpp"
#include "ptrain/ckpt/tp_checkpoint.hpp"
#include "ptrain/parallel/ddp.hpp"
#include "ptrain/parallel/engine.hpp"

namespace ptrain::ckpt {

namespace detail {
inline void check_same_world(const CheckpointManager& mgr, dist::Communicator& world) {
  PTRAIN_CHECK(mgr.world_size() == world.size() && mgr.rank() == world.rank(), CheckpointError,
               "[ptrain.ckpt.world] the checkpoint manager spans ", mgr.world_size(), " ranks (this is rank ",
               mgr.rank(), ") but the engine spans ", world.size(), " (rank ", world.rank(),
               "); make the manager with &engine.communicator()");
}

// DDP with expert parallelism (Note [Expert-parallel layout]): world rank 0's dense
// tensors and the experts of replica 0 of each expert-parallel index, with their
// optimizer state ("<param>.<kind>"); every expert keeps its global name.
template <class T>
ShardedState expert_parallel_state(parallel::DDP<T>& ddp, optim::Optimizer<T>* opt) {
  ShardedState s = whole_tensors(ddp.parameters(), opt);
  std::set<std::string> experts;
  const auto& entries = ddp.parameters().entries();
  for (std::size_t i = 0; i < entries.size(); ++i)
    if (ddp.is_expert(i)) experts.insert(entries[i].name);
  const auto& frozen = ddp.parameters().frozen_entries();  // frozen experts: written like the others
  for (std::size_t i = 0; i < frozen.size(); ++i)
    if (ddp.is_frozen_expert(i)) experts.insert(frozen[i].name);
  const bool dense_writer = ddp.communicator().rank() == 0, expert_writer = ddp.expert_mesh()->replica() == 0;
  auto keep = [&](std::vector<TensorPiece>& pieces, bool state) {
    std::erase_if(pieces, [&](const TensorPiece& p) {
      const std::string param = state ? p.name.substr(0, p.name.rfind('.')) : p.name;
      return !(experts.count(param) ? expert_writer : dense_writer);
    });
  };
  keep(s.model, false);
  keep(s.optimizer, true);
  return s;
}

// The FSDP of a Mode::FSDP engine, its local_module(): the FSDP itself, or the one a
// context-parallel engine with ContextParallelPlan::fsdp runs its units in.
template <class T>
parallel::FSDP<T>& fsdp_of(parallel::Engine<T>& engine) {
  auto* f = dynamic_cast<parallel::FSDP<T>*>(&engine.local_module());
  PTRAIN_CHECK(f != nullptr, CheckpointError, "[ptrain.ckpt.mode] an engine of Mode::FSDP whose local_module() is "
               "not an FSDP; make local_module() return the FSDP that holds the shards");
  return *f;
}

// Hands this rank's part of a checkpoint of `engine` to `replicated(params, state)`
// (the whole model, written by rank 0) or `sharded(pieces, state)`; collective over
// `world` (the engine's ranks; a pipeline gathers its stages' state over it). The
// pieces live only during the call.
template <class T, class Replicated, class Sharded>
void engine_parts(dist::Communicator* world, parallel::Engine<T>& engine, optim::Optimizer<T>* opt,
                  TrainerState state, Replicated&& replicated, Sharded&& sharded) {
  switch (engine.mode()) {
    case parallel::Mode::Local:
      replicated(engine.parameters(), std::move(state));
      return;
    case parallel::Mode::DDP:  // a DDP, or another engine that replicates the whole model (ContextParallel)
      if (auto* ddp = dynamic_cast<parallel::DDP<T>*>(&engine); ddp && ddp->expert_mesh())
        sharded(expert_parallel_state(*ddp, opt), std::move(state));
      else
        replicated(engine.parameters(), std::move(state));
      return;
    case parallel::Mode::FSDP:
      sharded(fsdp_state(fsdp_of(engine), opt), std::move(state));
      return;
    case parallel::Mode::Pipeline: {
      StageSnapshot snap = stage_snapshot(world, static_cast<parallel::Pipeline<T>&>(engine), opt, std::move(state));
      sharded(snap.tensors, std::move(snap.state));
      return;
    }
    case parallel::Mode::TensorParallel: {
      TensorParallelSnapshot snap = tp_state(static_cast<parallel::TensorParallel<T>&>(engine), opt);
      sharded(snap.state, std::move(state));
      return;
    }
  }
}

// engine_parts() for a checkpoint saved through `mgr`, which must span the engine's ranks.
template <class T, class Replicated, class Sharded>
void save_parts(CheckpointManager& mgr, parallel::Engine<T>& engine, optim::Optimizer<T>* opt, TrainerState state,
                Replicated&& replicated, Sharded&& sharded) {
  check_same_world(mgr, engine.communicator());
  engine_parts(mgr.communicator(), engine, opt, std::move(state), std::forward<Replicated>(replicated),
               std::forward<Sharded>(sharded));
}
}  // namespace detail

/// Saves step `step` of `engine` and `opt` (collective over the engine's ranks, which
/// mgr must span); returns when the checkpoint is committed.
template <class T>
void save(CheckpointManager& mgr, std::int64_t step, parallel::Engine<T>& engine,
          std::type_identity_t<optim::Optimizer<T>>* opt, TrainerState state = {}) {
  detail::save_parts(
      mgr, engine, opt, std::move(state),
      [&](nn::FlatParameters<T>& params, TrainerState s) { mgr.save(step, params, opt, std::move(s)); },
      [&](const ShardedState& mine, TrainerState s) { mgr.save_sharded(step, mine, std::move(s)); });
}

/// save() in the background (collective): returns once the tensors are copied to host memory.
template <class T>
void save(AsyncCheckpointer& saver, CheckpointManager& mgr, std::int64_t step, parallel::Engine<T>& engine,
          std::type_identity_t<optim::Optimizer<T>>* opt, TrainerState state = {}) {
  detail::save_parts(
      mgr, engine, opt, std::move(state),
      [&](nn::FlatParameters<T>& params, TrainerState s) { saver.save(step, params, opt, std::move(s)); },
      [&](const ShardedState& mine, TrainerState s) { saver.save_sharded(step, mine, std::move(s)); });
}

namespace detail {
// ckpt::load without the manager's bookkeeping: the engine's mode picks the reader.
template <class T>
TrainerState load_engine(CheckpointManager& mgr, const fs::path& path, parallel::Engine<T>& engine,
                         optim::Optimizer<T>* opt) {
  check_same_world(mgr, engine.communicator());
  switch (engine.mode()) {
    case parallel::Mode::Local:
      return mgr.load(path, engine.parameters(), opt);
    case parallel::Mode::DDP: {  // with expert parallelism: this rank's experts of all of them
      auto* ddp = dynamic_cast<parallel::DDP<T>*>(&engine);
      return mgr.load(path, engine.parameters(), opt, LoadOptions{.partial = ddp && ddp->expert_mesh() != nullptr});
    }
    case parallel::Mode::FSDP:
      return load_fsdp(path, fsdp_of(engine), opt);
    case parallel::Mode::Pipeline: {
      auto& pipe = static_cast<parallel::Pipeline<T>&>(engine);
      if (same_pipeline_layout(saved_pipeline_layout(Checkpoint(path, false).trainer_state()), pipe))
        return load_stage(mgr, path, pipe, opt);
      // Another mode or cut: this stage's tensors by name.
      TrainerState state;
      all_or_none(mgr.communicator(), "loading its pipeline stage", [&] {
        state = pipe.has_parameters() ? mgr.load(path, pipe.parameters(), opt, LoadOptions{.partial = true})
                                      : Checkpoint(path).trainer_state();
      });
      return state;
    }
    case parallel::Mode::TensorParallel:
      return load_tp(path, static_cast<parallel::TensorParallel<T>&>(engine), opt);
  }
  return {};
}
}  // namespace detail

/// Loads a checkpoint written by save() in any mode and world size into `engine`
/// (and opt's state, step count and learning rate); collective. Restores
/// default_generator() and returns the trainer state. A mismatch (another model,
/// a missing tensor, a corrupt file) throws before anything is changed.
/// Marks the manager as resumed from `path` (CheckpointManager::resumed_from).
template <class T>
TrainerState load(CheckpointManager& mgr, const fs::path& path, parallel::Engine<T>& engine,
                  std::type_identity_t<optim::Optimizer<T>>* opt = nullptr) {
  TrainerState state = detail::load_engine(mgr, path, engine, opt);
  mgr.resumed_from(path);
  return state;
}

}  // namespace ptrain::ckpt
