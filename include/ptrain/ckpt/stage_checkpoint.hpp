#pragma once
// Checkpoints of a pipeline-parallel run (parallel/pipeline.hpp), one file per
// stage, through the checkpoint manager's sharded save.
//
//   parallel::Mesh mesh(*world, dp, pp);
//   parallel::Pipeline<float> pipe(mesh.pipeline_group(), n_units, make_unit, part,
//                                  {.micro_batches = 8, .data_parallel = &mesh.data_group()});
//   optim::AdamW<float> opt(pipe.parameters(), {.lr = 3e-4});
//   ckpt::CheckpointManager mgr("ckpt", world.get());        // the WORLD communicator
//   if (auto last = mgr.latest(); last.found()) ckpt::load_stage(mgr, last.path, pipe, &opt);
//   ...
//   ckpt::save_stage(mgr, step, pipe, &opt, {.step = step});  // every rank calls it
//
// Note [Stage checkpoints]
// Pipeline parameter names are the full model's names ("h.3.attn.c_attn.weight"),
// so the stages' tensors are disjoint and together form the whole model.
// Replica 0 of each stage writes its stage's parameters and optimizer state
// as whole tensors (model-RRRRR-of-WWWWW.safetensors, optimizer-...); the other
// replicas hold the same values and write nothing, but take part in the
// collective save. The result is an ordinary sharded checkpoint:
// CheckpointManager::load() reads it into the full model in one process, and
// Checkpoint::export_model() writes it as one file.
//
// Note [Stage layout]
// trainer.json's user["ptrain.pipeline"] records the layout: unit count, stage
// bounds, data-parallel size (which must match on load), micro-batches and
// schedule (informational: changing them keeps the arithmetic, up to the order
// of the gradient sums), and per stage its units and its optimizer's step
// count and learning rate. load_stage() refuses another unit count, cut or
// dp size with [ptrain.ckpt.layout] instead of loading a stage from tensors it
// does not own; a different layout goes through one process (load the full
// model, then build the new pipeline from it).
//
// Note [Stage optimizer and RNG]
// Every stage steps its own optimizer once per batch, so step counts and
// learning rates normally agree, but a run may give stages their own rates:
// each stage's count and rate are saved and restored per stage; the top-level
// TrainerState (what a one-process load restores) takes those of the first
// stage with an optimizer. default_generator() can differ on every rank
// (dropout draws, data on the first stage): each rank's (seed, offset) is
// gathered and saved as rng["default.stage<S>.replica<R>"], rng["default"] is
// world rank 0's, and load_stage() restores each rank's own. Other named
// generators in TrainerState::rng are the caller's, saved and returned as given.
//
// Note [Stage checkpoints with expert parallelism]
// With PipelineOptions::expert_parallel = ep > 1 (Note [Pipeline expert parallelism] in
// parallel/pipeline.hpp) replica 0 of each stage writes the dense tensors and replicas
// 0 .. ep - 1 (the first copy of the experts, expert-data rank 0) each its own experts,
// every one under its global name (experts.{e}.w1.weight) with its optimizer state, as
// DDP with expert parallelism does (ckpt/engine_checkpoint.hpp). So every tensor is
// written once: one process loads the whole model, and the same cut and dp resume at
// any ep (load_stage reads this replica's experts by name). The layout records ep
// (informational).

#include <bit>
#include <exception>
#include <set>
#include <string>
#include <vector>

#include "ptrain/ckpt/checkpoint.hpp"
#include "ptrain/parallel/pipeline.hpp"

namespace ptrain::ckpt {

/// This rank's part of a stage checkpoint: what save_stage() passes to save_sharded().
struct StageSnapshot {
  ShardedState tensors;  ///< whole tensors of this stage on replica 0; empty elsewhere
  TrainerState state;    ///< with the layout (Note [Stage layout]) and every rank's generator
};

namespace detail {

inline constexpr const char* kPipelineKey = "ptrain.pipeline";

inline std::string stage_rng_name(int stage, int replica) {
  return "default.stage" + std::to_string(stage) + ".replica" + std::to_string(replica);
}

template <class T>
int replica_of(const parallel::Pipeline<T>& pipe) {
  const auto* dp = pipe.options().data_parallel;
  return dp ? dp->rank() : 0;
}
template <class T>
int dp_size_of(const parallel::Pipeline<T>& pipe) {
  const auto* dp = pipe.options().data_parallel;
  return dp ? dp->size() : 1;
}

/// "4 units, stages [0,2) [2,4), dp 2" for error messages.
inline std::string layout_str(const nlohmann::json& l) {
  std::string s = ptrain::detail::cat(l.value("num_units", std::size_t{0}), " units in ", l.value("stages", 0),
                                      " stages ");
  const auto b = l.value("bounds", std::vector<std::size_t>{});
  for (std::size_t i = 0; i + 1 < b.size(); ++i) s += ptrain::detail::cat(i ? " " : "", "[", b[i], ",", b[i + 1], ")");
  return s + ptrain::detail::cat(", dp = ", l.value("data_parallel", 1));
}

// The communicator of the manager must be the world of the mesh: every rank of
// every replica takes part in the save and in the agreement on load.
template <class T>
void check_world(dist::Communicator* world, const parallel::Pipeline<T>& pipe, const char* what) {
  const int want = pipe.num_stages() * dp_size_of(pipe);
  const int have = world ? world->size() : 1;
  PTRAIN_CHECK(have == want, CheckpointError, "[ptrain.ckpt.stage_comm] ", what, ": the checkpoint manager's "
               "communicator has ", have, " ranks but the pipeline runs on ", pipe.num_stages(), " stages x ",
               dp_size_of(pipe), " replicas = ", want, "; give the manager the world communicator of the mesh");
}

// Runs `fn` on every rank and makes the outcome collective: when any rank
// throws, every rank throws (its own error, or one naming the failed rank),
// so no rank goes on to train_step while a neighbour gave up.
template <class Fn>
void all_or_none(dist::Communicator* world, const char* what, Fn&& fn) {
  std::exception_ptr err;
  try {
    fn();
  } catch (...) {
    err = std::current_exception();
  }
  std::int32_t failed = err ? (world ? world->rank() : 0) + 1 : 0;
  if (world && world->size() > 1) world->all_reduce(&failed, 1, DType::I32, dist::ReduceOp::Max);
  if (err) std::rethrow_exception(err);
  if (failed)
    PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.stage_peer] rank ", failed - 1, " failed while ", what,
                 " (its error says why); every rank stops here so that no stage trains on a partial state");
}

}  // namespace detail

/// The layout of `pipe` as stored in trainer.json's user["ptrain.pipeline"] (Note [Stage layout]).
template <class T>
nlohmann::json pipeline_layout(const parallel::Pipeline<T>& pipe) {
  const auto& part = pipe.partition();
  return {{"format", "ptrain.pipeline/1"},
          {"num_units", part.num_units()},
          {"stages", part.num_stages()},
          {"bounds", part.bounds()},
          {"partition", part.str()},
          {"data_parallel", detail::dp_size_of(pipe)},
          {"expert_parallel", pipe.options().expert_parallel},
          {"micro_batches", pipe.options().micro_batches},
          {"schedule", parallel::schedule_name(pipe.options().schedule)}};
}

/// Collective over `world` (the mesh's world communicator; null for one process):
/// gathers every rank's generator and every stage's optimizer step count and
/// learning rate into `state`, and returns this rank's tensors for save_sharded().
/// The snapshot points into the stage's parameters and optimizer state.
template <class T>
StageSnapshot stage_snapshot(dist::Communicator* world, parallel::Pipeline<T>& pipe, optim::Optimizer<T>* opt,
                             TrainerState state) {
  detail::check_world(world, pipe, "save_stage");
  // One record per rank: stage, replica, generator, optimizer (present, steps, lr bits).
  const Generator& g = default_generator();
  std::vector<std::int64_t> mine = {pipe.stage(),
                                    detail::replica_of(pipe),
                                    static_cast<std::int64_t>(g.seed()),
                                    static_cast<std::int64_t>(g.offset()),
                                    opt ? 1 : 0,
                                    opt ? opt->steps() : 0,
                                    std::bit_cast<std::int64_t>(opt ? opt->lr() : 0.0)};
  const std::size_t n = mine.size();
  const int ranks = world ? world->size() : 1;
  std::vector<std::int64_t> all(n * static_cast<std::size_t>(ranks));
  if (world && ranks > 1) world->all_gather(mine.data(), all.data(), n, DType::I64);
  else all = mine;

  nlohmann::json layout = pipeline_layout(pipe);
  nlohmann::json stages = nlohmann::json::array();
  for (int s = 0; s < pipe.num_stages(); ++s)
    stages.push_back({{"units", {pipe.partition().begin(s), pipe.partition().end(s)}}, {"optimizer", nullptr}});
  int top_stage = -1;
  for (int r = 0; r < ranks; ++r) {
    const std::int64_t* rec = all.data() + static_cast<std::size_t>(r) * n;
    const int stage = static_cast<int>(rec[0]), replica = static_cast<int>(rec[1]);
    state.rng[detail::stage_rng_name(stage, replica)] = {static_cast<std::uint64_t>(rec[2]),
                                                         static_cast<std::uint64_t>(rec[3])};
    if (r == 0 && !state.rng.count("default"))
      state.rng["default"] = {static_cast<std::uint64_t>(rec[2]), static_cast<std::uint64_t>(rec[3])};
    if (replica != 0 || rec[4] == 0) continue;  // replicas step together; replica 0 speaks for its stage
    const double lr = std::bit_cast<double>(rec[6]);
    stages.at(static_cast<std::size_t>(stage))["optimizer"] = {{"steps", rec[5]}, {"lr", lr}};
    if (top_stage < 0 || stage < top_stage) {
      state.optimizer_steps = rec[5];
      state.lr = lr;
      top_stage = stage;
    }
  }
  layout["per_stage"] = std::move(stages);
  if (!state.user.is_object()) state.user = nlohmann::json::object();
  state.user[detail::kPipelineKey] = std::move(layout);

  StageSnapshot snap;
  snap.state = std::move(state);
  // Note [Stage checkpoints]: the other replicas hold the same tensors.
  if (!pipe.has_parameters()) return snap;
  if (!pipe.expert_mesh()) {
    if (detail::replica_of(pipe) == 0) snap.tensors = whole_tensors(pipe.parameters(), opt);
    return snap;
  }
  // Note [Stage checkpoints with expert parallelism]: dense tensors from replica 0, experts from their first copy.
  snap.tensors = whole_tensors(pipe.parameters(), opt);
  std::set<std::string> experts;
  const auto& entries = pipe.parameters().entries();
  for (std::size_t i = 0; i < entries.size(); ++i)
    if (pipe.is_expert(i)) experts.insert(entries[i].name);
  const auto& frozen = pipe.parameters().frozen_entries();
  for (std::size_t i = 0; i < frozen.size(); ++i)
    if (pipe.is_frozen_expert(i)) experts.insert(frozen[i].name);
  const bool dense_writer = detail::replica_of(pipe) == 0, expert_writer = pipe.expert_mesh()->replica() == 0;
  auto keep = [&](std::vector<TensorPiece>& pieces, bool state) {  // optimizer state: "<param>.<kind>"
    std::erase_if(pieces, [&](const TensorPiece& p) {
      const std::string param = state ? p.name.substr(0, p.name.rfind('.')) : p.name;
      return !(experts.count(param) ? expert_writer : dense_writer);
    });
  };
  keep(snap.tensors.model, false);
  keep(snap.tensors.optimizer, true);
  return snap;
}

/// Saves a pipeline checkpoint of step `step` (collective over mgr's communicator,
/// which must be the world of the dp x pp mesh): replica 0 of each stage writes
/// its stage's parameters and optimizer state (Note [Stage checkpoints]).
template <class T>
void save_stage(CheckpointManager& mgr, std::int64_t step, parallel::Pipeline<T>& pipe, optim::Optimizer<T>* opt,
                TrainerState state = {}) {
  StageSnapshot snap = stage_snapshot(mgr.communicator(), pipe, opt, std::move(state));
  mgr.save_sharded(step, snap.tensors, std::move(snap.state));
}

/// The layout saved in `state`, or null when the checkpoint was not written by save_stage().
inline nlohmann::json saved_pipeline_layout(const TrainerState& state) {
  if (state.user.is_object() && state.user.contains(detail::kPipelineKey)) return state.user[detail::kPipelineKey];
  return nullptr;
}

namespace detail {
// What a stage checkpoint's layout must share with the pipeline that loads it.
inline constexpr const char* kLayoutKeys[] = {"num_units", "bounds", "data_parallel"};
}  // namespace detail

/// Whether `saved` (from saved_pipeline_layout) has the unit count, stage bounds and
/// data-parallel size of `pipe`, so that load_stage() can resume it. Local.
template <class T>
bool same_pipeline_layout(const nlohmann::json& saved, const parallel::Pipeline<T>& pipe) {
  if (!saved.is_object()) return false;
  const nlohmann::json now = pipeline_layout(pipe);
  for (const char* key : detail::kLayoutKeys)
    if (!saved.contains(key) || saved[key] != now[key]) return false;
  return true;
}

/// Throws [ptrain.ckpt.layout] unless same_pipeline_layout(saved, pipe). Local.
template <class T>
void check_pipeline_layout(const nlohmann::json& saved, const parallel::Pipeline<T>& pipe, const std::string& path) {
  const nlohmann::json now = pipeline_layout(pipe);
  PTRAIN_CHECK(saved.is_object(), CheckpointError, "[ptrain.ckpt.layout] ", path, " was not written by save_stage "
               "(no user[\"", detail::kPipelineKey, "\"] in trainer.json); load it into the full model in one "
               "process with CheckpointManager::load and build the pipeline from that model");
  for (const char* key : detail::kLayoutKeys)
    PTRAIN_CHECK(saved.contains(key), CheckpointError, "[ptrain.ckpt.layout] ", path, ": user[\"",
                 detail::kPipelineKey, "\"] in trainer.json has no \"", key, "\"; the checkpoint is corrupt");
  PTRAIN_CHECK(same_pipeline_layout(saved, pipe), CheckpointError, "[ptrain.ckpt.layout] ", path, " was saved by a pipeline of ",
               detail::layout_str(saved), " but this pipeline has ", detail::layout_str(now),
               "; resume with the saved layout (same units, cut points and data-parallel size), or load the "
               "checkpoint into the full model in one process (CheckpointManager::load) and cut that model anew");
}

/// Loads this rank's stage from a checkpoint written by save_stage() on the same
/// layout: parameters, optimizer state, the stage's step count and learning rate,
/// and this rank's default_generator(). Collective over mgr's communicator: if any
/// rank fails (layout, missing tensor, corrupt file), every rank throws.
template <class T>
TrainerState load_stage(CheckpointManager& mgr, const fs::path& path, parallel::Pipeline<T>& pipe,
                        optim::Optimizer<T>* opt = nullptr) {
  TrainerState state;
  detail::all_or_none(mgr.communicator(), "loading its pipeline stage", [&] {
    detail::check_world(mgr.communicator(), pipe, "load_stage");
    // Sizes and headers only: load() below verifies the data before copying.
    const TrainerState saved = Checkpoint(path, false).trainer_state();
    const nlohmann::json layout = saved_pipeline_layout(saved);
    check_pipeline_layout(layout, pipe, path.string());
    if (pipe.has_parameters()) state = mgr.load(path, pipe.parameters(), opt, LoadOptions{.partial = true});
    else state = saved;
    if (opt) {
      const auto& so = layout.at("per_stage").at(static_cast<std::size_t>(pipe.stage())).at("optimizer");
      PTRAIN_CHECK(so.is_object(), CheckpointError, "[ptrain.ckpt.stage_opt] ", path.string(), ": stage ",
                   pipe.stage(), " was saved without optimizer state; load without an optimizer or save with one");
      opt->set_steps(so.at("steps").get<std::int64_t>());
      opt->set_lr(so.at("lr").get<double>());
    }
    const auto g = state.rng.find(detail::stage_rng_name(pipe.stage(), detail::replica_of(pipe)));
    if (g != state.rng.end()) default_generator() = g->second.generator();
    else if (const auto d = state.rng.find("default"); d != state.rng.end()) default_generator() = d->second.generator();
  });
  return state;
}

}  // namespace ptrain::ckpt
