#pragma once
// make_engine: the one line of a training program that picks how it is spread
// over the ranks of its world. The rest of the program talks to the Engine.
//
//   auto world = dist::init_process_group();
//   parallel::Plan<float> plan = parallel::FSDPOptions{};       // or LocalOptions, DDPOptions, PipelinePlan,
//                                                               // TensorParallelPlan, ContextParallelPlan
//                                                               // (nn::GPT, nn::Llama; TensorParallelPlan{.cp}
//                                                               // runs context parallelism inside tp);
//                                                               // DDPOptions{.expert_parallel = ep} splits MoE experts,
//                                                               // so do FSDPOptions{.expert_parallel = ep} (and shards
//                                                               // them) and TensorParallelPlan{.tp, .expert_parallel}
//   auto engine = parallel::make_engine<float>(model, *world, plan);
//
// `model` is a std::shared_ptr to a model whose forward runs its units() in
// order (nn::Sequential, nn::MLP, nn::GPT): FSDP shards unit by unit and the
// pipeline cuts between units, under the names unit_names(), so parameter
// names (and checkpoints) are the same in every mode. Local and DDP train the
// model as it is. The engine keeps the model (and a pipeline's mesh) alive.
//
// Larger models that no rank can build whole use the engines' own
// constructors: FSDP(num_units, make_unit, world, ...) and Pipeline(mesh,
// num_units, make_unit, ...) build only the units each rank holds.

#include <memory>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "ptrain/parallel/cp_engine.hpp"
#include "ptrain/parallel/ddp.hpp"
#include "ptrain/parallel/fsdp.hpp"
#include "ptrain/parallel/local.hpp"
#include "ptrain/parallel/mesh.hpp"
#include "ptrain/parallel/pipeline.hpp"
#include "ptrain/parallel/tensor_parallel.hpp"

namespace ptrain::parallel {

/// One process: no communication, whatever the world.
struct LocalOptions {};

/// Pipeline parallel on a dp x pp mesh of the world.
template <class T>
struct PipelinePlan {
  /// Stages per pipeline (pp); the world holds world / pp replicas (dp). 0: every rank one stage.
  int stages = 0;
  /// Relative cost of each unit (e.g. forward FLOPs) for balancing the stages; empty: equal.
  std::vector<double> unit_costs = {};
  /// Schedule, micro-batches, virtual stages (the units are balanced into stages * virtual_stages
  /// chunks), loss and expert_parallel (the experts split over ep of the dp replicas of each
  /// stage, Note [Pipeline expert parallelism]); data_parallel and unit_names are set by make_engine.
  PipelineOptions<T> options = {};
};

template <class T>
using Plan =
    std::variant<LocalOptions, DDPOptions, FSDPOptions, PipelinePlan<T>, TensorParallelPlan, ContextParallelPlan>;

/// A model that make_engine can cut into units.
template <class M, class T>
concept UnitModel = std::is_base_of_v<nn::Module<T>, M> && requires(M& m) {
  { m.units() } -> std::convertible_to<std::vector<std::shared_ptr<nn::Module<T>>>>;
  { m.unit_names() } -> std::convertible_to<std::vector<std::string>>;
};

namespace detail {
// Holds what an engine refers to (the model, a mesh). A base class of Owned
// declared before the engine, so it is destroyed after the engine.
struct Keep {
  std::vector<std::shared_ptr<void>> held;
};
template <class E>
class Owned : private Keep, public E {
 public:
  template <class... Args>
  explicit Owned(std::vector<std::shared_ptr<void>> held, Args&&... args)
      : Keep{std::move(held)}, E(std::forward<Args>(args)...) {}
};
}  // namespace detail

/// The engine of `plan` for `model` over `world` (collective: every rank calls it with
/// the same plan). `world` must outlive the engine.
template <class T, class M>
  requires UnitModel<M, T>
std::unique_ptr<Engine<T>> make_engine(std::shared_ptr<M> model, dist::Communicator& world, const Plan<T>& plan) {
  PTRAIN_CHECK(model != nullptr, Error, "[ptrain.engine.model] make_engine was given no model");
  std::vector<std::shared_ptr<void>> held{model};
  if (std::holds_alternative<LocalOptions>(plan)) return std::make_unique<detail::Owned<Local<T>>>(held, *model);
  if (auto* o = std::get_if<DDPOptions>(&plan))
    return std::make_unique<detail::Owned<DDP<T>>>(held, *model, world, *o);
  if (auto* tp = std::get_if<TensorParallelPlan>(&plan)) {
    // The engine copies its shards out of the model, which it then no longer needs.
    if constexpr (std::is_base_of_v<nn::GPT<T>, M>) {
      return std::make_unique<TensorParallel<T>>(static_cast<nn::GPT<T>&>(*model), world, *tp);
    } else if constexpr (std::is_base_of_v<nn::Llama<T>, M>) {
      return std::make_unique<TensorParallel<T>>(static_cast<nn::Llama<T>&>(*model), world, *tp);
    } else {
      PTRAIN_THROW(Error, "[ptrain.tp.model] tensor parallelism splits the layers of nn::GPT and nn::Llama; ",
                   model->describe(), " has no tensor-parallel form: use DDPOptions or FSDPOptions");
    }
  }
  if (auto* cp = std::get_if<ContextParallelPlan>(&plan)) {
    // The engine shares the model's modules, so it keeps the model alive.
    if constexpr (std::is_base_of_v<nn::GPT<T>, M>) {
      return std::make_unique<detail::Owned<ContextParallel<T>>>(held, static_cast<nn::GPT<T>&>(*model), world, *cp);
    } else if constexpr (std::is_base_of_v<nn::Llama<T>, M>) {
      return std::make_unique<detail::Owned<ContextParallel<T>>>(held, static_cast<nn::Llama<T>&>(*model), world, *cp);
    } else {
      PTRAIN_THROW(Error, "[ptrain.cp.model] context parallelism splits the attention of nn::GPT and nn::Llama; ",
                   model->describe(), " has no context-parallel form: use DDPOptions or FSDPOptions");
    }
  }
  const auto units = model->units();
  const auto names = model->unit_names();
  if (auto* o = std::get_if<FSDPOptions>(&plan)) {
    FSDPOptions fo = *o;
    if (fo.unit_names.empty()) fo.unit_names = names;
    return std::make_unique<detail::Owned<FSDP<T>>>(held, units, world, fo);
  }
  const auto& pp = std::get<PipelinePlan<T>>(plan);
  const int stages = pp.stages > 0 ? pp.stages : world.size();
  PTRAIN_CHECK(world.size() % stages == 0, Error, "[ptrain.engine.pipeline] ", stages,
               " stages do not divide the world of ", world.size(), " ranks; launch a multiple of the stage count");
  auto mesh = std::make_shared<Mesh>(world, world.size() / stages, stages);
  held.push_back(mesh);
  const std::vector<double> costs = pp.unit_costs.empty() ? std::vector<double>(units.size(), 1.0) : pp.unit_costs;
  PTRAIN_CHECK(costs.size() == units.size(), Error, "[ptrain.engine.pipeline] ", costs.size(), " unit costs for ",
               units.size(), " units");
  PipelineOptions<T> po = pp.options;
  po.unit_names = names;
  auto pipe = std::make_unique<detail::Owned<Pipeline<T>>>(
      held, *mesh, units.size(), [units](std::size_t u) { return units[u]; },
      partition_balanced(costs, stages * std::max(1, po.virtual_stages)), po);
  // Replica 0's values, as DDP (with expert parallelism each expert from the first replica holding it).
  if (pipe->has_parameters()) pipe->broadcast_parameters();
  return pipe;
}

}  // namespace ptrain::parallel
