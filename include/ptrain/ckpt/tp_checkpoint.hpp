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
// Under FSDP x TP (Note [FSDP x TP]) save first gathers each rank's FSDP pieces
// into its tp shards over FSDP's shard group (one all-reduce per buffer), and
// load copies its pieces out of its tp shard: the files are the same.
// With MoE layers (Note [Expert parallelism x TP]) replica 0 of each expert-parallel
// index (world ranks 0 .. ep-1) writes its experts under their global names, and load
// keeps the experts this rank holds.

#include <map>
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

namespace detail {

// Under FSDP x TP: this rank's tp shards of every parameter (and of each optimizer
// state), gathered from the FSDP pieces over the shard group, by name.
template <class T>
struct FsdpTensorParallelShards {
  std::vector<std::pair<std::string, Shape>> shapes;  // the tp shards', FSDP's order
  std::map<std::string, std::int64_t> at;             // offset in a flat buffer
  std::int64_t total = 0;

  explicit FsdpTensorParallelShards(parallel::FSDP<T>& f) : shapes(f.parameter_shapes()) {
    for (const auto& [name, shape] : shapes) {
      at[name] = total;
      total += shape.numel();
    }
  }
  // The tp shards, flat, from each piece's values in piece_buffer(piece) (undefined: skip).
  template <class E, class Fn>
  Tensor<E> gather(parallel::FSDP<T>& f, Fn&& piece_buffer) {
    auto flat = Tensor<E>::zeros({total}, f.parameters().values().device());
    for (const auto& p : f.shard_pieces()) {
      Tensor<E> src = piece_buffer(p);
      if (src.defined()) flat.view(at.at(p.name) + p.param_offset, {p.numel}).copy_(src);
    }
    if (dist::Communicator* s = f.shard_group(); s && s->size() > 1) s->all_reduce(flat, dist::ReduceOp::Sum);
    return flat;
  }
};

// The full names of the engine's frozen parameters (pp = 1).
template <class T>
std::set<std::string> frozen_names(parallel::TensorParallel<T>& engine) {
  std::set<std::string> out;
  for (const auto& p : engine.model().named_parameters())
    if (!p.param->requires_grad) out.insert(p.name);
  return out;
}

// load_tp() under FSDP x TP: each rank reads the full tensors, cuts its tp shard
// and keeps its FSDP pieces of it (strategies that keep full frozen parameters load them whole).
template <class T>
TrainerState load_fsdp_tp(Checkpoint& c, parallel::TensorParallel<T>& engine, optim::Optimizer<T>* opt) {
  parallel::FSDP<T>& f = *engine.fsdp();
  auto& params = engine.parameters();
  const auto shapes = f.parameter_shapes();
  const auto frozen = frozen_names(engine);
  std::set<std::string> names;
  for (const auto& s : shapes) names.insert(s.first);
  for (const auto& b : params.buffers()) names.insert(b.name);
  for (const auto& n : c.tensor_names("model"))
    PTRAIN_CHECK(names.count(n), CheckpointError, "[ptrain.ckpt.unexpected] ", c.path().string(), ": tensor '", n,
                 "' is not a parameter or buffer of the model; the checkpoint is from a different model");
  auto full_shape = [&](const std::string& name, const Shape& shape) {
    return parallel::detail::full_shape(shape, engine.spec_of(name));
  };
  for (const auto& [name, shape] : shapes) {
    c.check(name, full_shape(name, shape), dtype_of<T>());
    if (opt && !frozen.count(name))
      for (const auto& entry : opt->flat_state())
        c.check(name + "." + entry.first, full_shape(name, shape), dtype_of<acc_t<T>>());
  }
  for (const auto& b : params.buffers()) c.check_matches(b.name, *b.buffer);
  const int t = engine.group().rank(), tp = engine.group().size();
  auto read = [&]<class E>(const std::string& name, const std::string& key, const Shape& shape) {
    auto full = Tensor<E>::empty(full_shape(name, shape));
    c.read_into(key, full);
    return parallel::detail::shard_of(full, engine.spec_of(name), t, tp);
  };
  std::multimap<std::string, const parallel::ShardPiece*> pieces;
  for (const auto& p : f.shard_pieces()) pieces.emplace(p.name, &p);
  auto whole = f.whole_frozen();
  for (const auto& [name, shape] : shapes) {
    const auto shard = read.template operator()<T>(name, name, shape);
    const auto [lo, hi] = pieces.equal_range(name);
    for (auto it = lo; it != hi; ++it) {
      const parallel::ShardPiece& p = *it->second;
      if (!p.frozen || whole.empty()) f.piece_values(p).copy_(shard.view(p.param_offset, {p.numel}));
    }
    for (auto& [n, value] : whole)
      if (n == name) value.copy_(shard);
    if (opt && !frozen.count(name))
      for (const auto& [kind, buf] : opt->flat_state()) {
        const auto state = read.template operator()<acc_t<T>>(name, name + "." + kind, shape);
        for (auto it = lo; it != hi; ++it)
          buf.view(it->second->local_offset, {it->second->numel}).copy_(state.view(it->second->param_offset,
                                                                                   {it->second->numel}));
      }
  }
  for (const auto& b : params.buffers()) c.read_into(b.name, *b.buffer);
  engine.parameters_changed();
  return restore_trainer_state(c, opt);
}

}  // namespace detail

/// The full tensors of this rank's stage (and of opt's state, "<param>.<kind>") on
/// tp rank 0 (and cp rank 0) of replica 0 for save_sharded(); other ranks' parts are empty.
/// Collective over the tp groups.
template <class T>
TensorParallelSnapshot tp_state(parallel::TensorParallel<T>& engine, std::type_identity_t<optim::Optimizer<T>>* opt) {
  TensorParallelSnapshot snap;
  if (opt) snap.state.record(*opt);
  const bool writer = engine.mesh().replica() == 0 && engine.mesh().cp_rank() == 0 && engine.mesh().tp_rank() == 0;
  const bool expert_writer = engine.expert_mesh() && engine.expert_mesh()->replica() == 0;
  auto add = [&](std::vector<TensorPiece>& out, const std::string& name, auto full, bool expert = false) {
    if (!(expert ? expert_writer : writer)) return;
    auto held = std::make_shared<decltype(full)>(std::move(full));
    snap.keep.push_back(held);
    out.push_back(whole(name, *held));
  };
  auto& params = engine.parameters();
  if (parallel::FSDP<T>* f = engine.fsdp()) {
    detail::FsdpTensorParallelShards<T> shards(*f);
    const auto values = shards.template gather<T>(*f, [&](const parallel::ShardPiece& p) { return f->piece_values(p); });
    const auto frozen = detail::frozen_names(engine);
    for (const auto& [name, shape] : shards.shapes)
      add(snap.state.model, name,
          parallel::detail::gather_full(values.view(shards.at.at(name), shape), engine.spec_of(name), engine.group()));
    if (opt)
      for (const auto& [kind, buf] : opt->flat_state()) {
        const auto state = shards.template gather<acc_t<T>>(*f, [&](const parallel::ShardPiece& p) {
          return p.frozen ? Tensor<acc_t<T>>() : buf.view(p.local_offset, {p.numel});
        });
        // Every trainable parameter, on every rank alike (a rank may hold no piece of one).
        for (const auto& [name, shape] : shards.shapes)
          if (!frozen.count(name))
            add(snap.state.optimizer, name + "." + kind,
                parallel::detail::gather_full(state.view(shards.at.at(name), shape), engine.spec_of(name),
                                              engine.group()));
      }
    if (writer)
      for (const auto& b : params.buffers()) snap.state.model.push_back(whole(b.name, *b.buffer));
    return snap;
  }
  const auto& entries = params.entries();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    add(snap.state.model, e.name, parallel::detail::gather_full(e.param->value, engine.spec(i), engine.group()),
        engine.is_expert(i));
    if (opt)
      for (const auto& [kind, buf] : opt->flat_state())
        add(snap.state.optimizer, e.name + "." + kind,
            parallel::detail::gather_full(buf.view(e.offset, e.shape), engine.spec(i), engine.group()),
            engine.is_expert(i));
  }
  const auto& frozen = params.frozen_entries();  // no optimizer state
  for (std::size_t i = 0; i < frozen.size(); ++i)
    add(snap.state.model, frozen[i].name,
        parallel::detail::gather_full(frozen[i].param->value, engine.frozen_spec(i), engine.group()),
        engine.is_frozen_expert(i));
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
  if (engine.fsdp()) return detail::load_fsdp_tp(c, engine, opt);
  auto& params = engine.parameters();
  const auto& entries = params.entries();
  const auto& frozen = params.frozen_entries();
  std::set<std::string> names;
  for (const auto& e : entries) names.insert(e.name);
  for (const auto& e : frozen) names.insert(e.name);
  for (const auto& b : params.buffers()) names.insert(b.name);
  // With pp > 1 the checkpoint also holds the other stages' tensors, with experts the other ranks' experts.
  for (const auto& n : c.tensor_names("model"))
    PTRAIN_CHECK(engine.mesh().pp_size() > 1 || names.count(n) ||
                     (engine.expert_mesh() && n.find(".experts.") != n.npos),
                 CheckpointError, "[ptrain.ckpt.unexpected] ",
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
