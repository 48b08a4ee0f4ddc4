#pragma once
// Sharded checkpoints of an FSDP model (Note [Sharded checkpoints]): each rank
// saves the pieces of parameters and optimizer state in its shard; a run of any
// world size or sharding strategy loads them back, and one file can be exported.
//
//   ckpt::CheckpointManager mgr(dir, comm.get());
//   if (auto last = mgr.latest(); last.found())
//     state = ckpt::load_fsdp(last.path, fsdp, &opt);              // saved on any number of ranks
//   ...
//   mgr.save_sharded(step, ckpt::fsdp_state(fsdp, &opt), state);  // collective
//   ckpt::Checkpoint(mgr.latest().path).export_model("model.safetensors");
//
// Names are the unwrapped model's (FSDPOptions::unit_names), so the same
// checkpoint also loads into the plain model with CheckpointManager::load().

#include <set>
#include <type_traits>

#include "ptrain/ckpt/checkpoint.hpp"
#include "ptrain/parallel/fsdp.hpp"

namespace ptrain::ckpt {

/// This rank's part of `fsdp` (and of opt's state, named "<param>.<kind>") for
/// save_sharded(). Replicas of a shard (Hybrid, NoShard) return an empty part
/// except the first of each replica group.
template <class T>
ShardedState fsdp_state(parallel::FSDP<T>& fsdp, std::type_identity_t<optim::Optimizer<T>>* opt) {
  ShardedState s;
  if (opt) s.record(*opt);
  // Buffers are whole on every rank; rank 0 writes them.
  if (fsdp.communicator().rank() == 0)
    for (const auto& b : fsdp.parameters().buffers()) s.model.push_back(whole(b.name, *b.buffer));
  if (!fsdp.writes_checkpoint()) return s;
  for (const auto& p : fsdp.shard_pieces()) {
    s.model.push_back(piece(p.name, p.shape, p.param_offset, fsdp.piece_values(p)));
    if (opt && !p.frozen)  // a frozen parameter has no optimizer state
      for (const auto& [kind, buf] : opt->flat_state())
        s.optimizer.push_back(piece(p.name + "." + kind, p.shape, p.param_offset, buf.view(p.local_offset, {p.numel})));
  }
  return s;
}

/// Loads a checkpoint written at any world size, by fsdp_state() + save_sharded()
/// or by save(), into fsdp's local shard and opt's state; collective (the full
/// parameters of ZeRO-1/2 are gathered again). Every parameter of the model must
/// be in the checkpoint with its shape, and no others; everything is checked
/// before anything is changed. Returns the trainer state.
template <class T>
TrainerState load_fsdp(const fs::path& path, parallel::FSDP<T>& fsdp,
                       std::type_identity_t<optim::Optimizer<T>>* opt = nullptr) {
  Checkpoint c(path);
  std::set<std::string> names;
  for (const auto& [name, shape] : fsdp.parameter_shapes()) names.insert(name);
  for (const auto& b : fsdp.parameters().buffers()) names.insert(b.name);
  for (auto& n : fsdp.expert_names()) names.insert(std::move(n));  // other ranks' experts: not read here
  for (const auto& n : c.tensor_names("model"))
    PTRAIN_CHECK(names.count(n), CheckpointError, "[ptrain.ckpt.unexpected] ", path.string(), ": tensor '", n,
                 "' is not a parameter or buffer of the model; the checkpoint is from a different model");
  // Everything is checked before the first copy, so a mismatch leaves the model
  // untouched. Optimizer state is acc_t<T> (F32 beside bf16 parameters).
  std::set<std::string> trainable;
  for (const auto& p : fsdp.shard_pieces())
    if (!p.frozen) trainable.insert(p.name);
  for (const auto& [name, shape] : fsdp.parameter_shapes()) {
    c.check(name, shape, dtype_of<T>());
    if (opt && trainable.count(name))
      for (const auto& entry : opt->flat_state()) c.check(name + "." + entry.first, shape, dtype_of<acc_t<T>>());
  }
  for (const auto& b : fsdp.parameters().buffers()) c.check_matches(b.name, *b.buffer);
  for (const auto& b : fsdp.parameters().buffers()) c.read_into(b.name, *b.buffer);
  // Frozen parameters (Note [Frozen parameters under FSDP]): whole where the strategy keeps
  // full parameters, else this rank's pieces; they have no optimizer state.
  auto whole_frozen = fsdp.whole_frozen();
  for (auto& [name, value] : whole_frozen) c.read_into(name, value);
  for (const auto& p : fsdp.shard_pieces()) {
    if (p.frozen && !whole_frozen.empty()) continue;
    auto values = fsdp.piece_values(p);
    c.read_range(p.name, p.param_offset, values);
    if (opt && !p.frozen)
      for (const auto& [kind, buf] : opt->flat_state()) {
        auto state = buf.view(p.local_offset, {p.numel});
        c.read_range(p.name + "." + kind, p.param_offset, state);
      }
  }
  fsdp.parameters_changed();
  return restore_trainer_state(c, opt);
}

}  // namespace ptrain::ckpt
