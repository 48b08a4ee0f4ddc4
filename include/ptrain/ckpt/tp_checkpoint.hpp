#pragma once
// Checkpoints of a TensorParallel engine: full tensors under nn::GPT's names
// and shapes, so a checkpoint written at one tp degree loads at any other, into
// one process (CheckpointManager::load), FSDP or a pipeline, and exports like
// any other (Checkpoint::export_model).
//
// Save gathers each sharded tensor (and its optimizer state) over the tp group
// (collective) and tp rank 0 of replica 0 writes the full tensors of its stage
// (world rank 0 alone without a pipeline); load reads the full tensors on every
// rank and keeps its own shard (no collective). Vocabulary
// padding is dropped on save and zero on load (Note [Tensor parallel shards]).

#include <set>
#include <type_traits>

#include "ptrain/ckpt/checkpoint.hpp"
#include "ptrain/parallel/tensor_parallel.hpp"

namespace ptrain::ckpt {

/// What tp_state() hands to save_sharded(), with the gathered tensors it points into.
struct TensorParallelSnapshot {
  ShardedState state;
  std::vector<std::shared_ptr<void>> keep;  // the full host tensors the pieces refer to
};

/// The full tensors of this rank's stage (and of opt's state, "<param>.<kind>") on
/// tp rank 0 of replica 0 for save_sharded(); other ranks' parts are empty.
/// Collective over the tp groups.
template <class T>
TensorParallelSnapshot tp_state(parallel::TensorParallel<T>& engine, std::type_identity_t<optim::Optimizer<T>>* opt) {
  TensorParallelSnapshot snap;
  if (opt) snap.state.record(*opt);
  const bool writer = engine.mesh().replica() == 0 && engine.mesh().tp_rank() == 0;
  auto add = [&](std::vector<TensorPiece>& out, const std::string& name, auto full) {
    if (!writer) return;
    auto held = std::make_shared<decltype(full)>(std::move(full));
    snap.keep.push_back(held);
    out.push_back(whole(name, *held));
  };
  auto& params = engine.parameters();
  const auto& entries = params.entries();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    add(snap.state.model, e.name, parallel::detail::gather_full(e.param->value, engine.spec(i), engine.group()));
    if (opt)
      for (const auto& [kind, buf] : opt->flat_state())
        add(snap.state.optimizer, e.name + "." + kind,
            parallel::detail::gather_full(buf.view(e.offset, e.shape), engine.spec(i), engine.group()));
  }
  const auto& frozen = params.frozen_entries();  // no optimizer state
  for (std::size_t i = 0; i < frozen.size(); ++i)
    add(snap.state.model, frozen[i].name,
        parallel::detail::gather_full(frozen[i].param->value, engine.frozen_spec(i), engine.group()));
  if (writer)
    for (const auto& b : params.buffers()) snap.state.model.push_back(whole(b.name, *b.buffer));
  return snap;
}

/// Loads a checkpoint of any mode, world size or tp degree into `engine` (and opt's
/// state); every rank reads the full tensors and keeps its shard. Checks every
/// tensor before changing anything. Returns the trainer state.
template <class T>
TrainerState load_tp(const fs::path& path, parallel::TensorParallel<T>& engine,
                     std::type_identity_t<optim::Optimizer<T>>* opt = nullptr) {
  Checkpoint c(path);
  auto& params = engine.parameters();
  const auto& entries = params.entries();
  const auto& frozen = params.frozen_entries();
  std::set<std::string> names;
  for (const auto& e : entries) names.insert(e.name);
  for (const auto& e : frozen) names.insert(e.name);
  for (const auto& b : params.buffers()) names.insert(b.name);
  // With pp > 1 the checkpoint also holds the other stages' tensors.
  for (const auto& n : c.tensor_names("model"))
    PTRAIN_CHECK(engine.mesh().pp_size() > 1 || names.count(n), CheckpointError, "[ptrain.ckpt.unexpected] ",
                 path.string(), ": tensor '", n, "' is not a parameter or buffer of the model; the checkpoint is "
                 "from a different model");
  for (std::size_t i = 0; i < entries.size(); ++i) {
    c.check(entries[i].name, engine.full_shape(i), dtype_of<T>());
    if (opt)
      for (const auto& entry : opt->flat_state())
        c.check(entries[i].name + "." + entry.first, engine.full_shape(i), dtype_of<acc_t<T>>());
  }
  for (std::size_t i = 0; i < frozen.size(); ++i) c.check(frozen[i].name, engine.frozen_full_shape(i), dtype_of<T>());
  for (const auto& b : params.buffers()) c.check_matches(b.name, *b.buffer);
  const int t = engine.group().rank(), tp = engine.group().size();
  auto read = [&](const std::string& name, const Shape& shape, const parallel::ShardSpec& spec, auto dst) {
    using E = typename decltype(dst)::value_type;
    auto full = Tensor<E>::empty(shape);
    c.read_into(name, full);
    dst.copy_(parallel::detail::shard_of(full, spec, t, tp));
  };
  auto read_shard = [&](const std::string& name, std::size_t i, auto dst) {
    read(name, engine.full_shape(i), engine.spec(i), dst);
  };
  for (std::size_t i = 0; i < frozen.size(); ++i)
    read(frozen[i].name, engine.frozen_full_shape(i), engine.frozen_spec(i), frozen[i].param->value);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    read_shard(entries[i].name, i, entries[i].param->value);
    if (opt)
      for (const auto& [kind, buf] : opt->flat_state())
        read_shard(entries[i].name + "." + kind, i, buf.view(entries[i].offset, entries[i].shape));
  }
  for (const auto& b : params.buffers()) c.read_into(b.name, *b.buffer);
  engine.parameters_changed();
  return restore_trainer_state(c, opt);
}

}  // namespace ptrain::ckpt
