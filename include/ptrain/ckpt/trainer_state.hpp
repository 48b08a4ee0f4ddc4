#pragma once
// TrainerState: everything besides tensors that a resumed run needs (step,
// sampler position, named random streams, optimizer step count and learning
// rate, LR schedule, user metadata), and its JSON form, trainer.json
// (format "ptrain.trainer/1").

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "ptrain/ckpt/sampler_state.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/optim/schedule.hpp"

namespace ptrain::ckpt {

/// Position of a random stream (see core/random.hpp: (seed, offset) resumes it exactly).
struct GeneratorState {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  static GeneratorState of(const Generator& g) { return {g.seed(), g.offset()}; }
  Generator generator() const { return Generator(seed, offset); }
};

/// Everything besides tensors that a resumed run needs: written to trainer.json.
struct TrainerState {
  std::int64_t step = 0;       ///< optimizer steps completed
  int world_size = 1;          ///< filled in by save()
  std::optional<SamplerState> sampler;
  std::map<std::string, GeneratorState> rng;  ///< named generators ("default", "dropout", ...)
  std::int64_t optimizer_steps = 0;           ///< filled in by save() when an optimizer is given
  double lr = 0.0;                            ///< likewise
  std::optional<optim::WarmupCosine> schedule;
  nlohmann::json user = nlohmann::json::object();  ///< free-form metadata (config, metrics)
};

inline nlohmann::json to_json(const TrainerState& s) {
  nlohmann::json j = {{"format", "ptrain.trainer/1"}, {"step", s.step}, {"world_size", s.world_size},
                      {"optimizer", {{"steps", s.optimizer_steps}, {"lr", s.lr}}}, {"user", s.user}};
  if (s.sampler)
    j["sampler"] = {{"epoch", s.sampler->epoch}, {"consumed", s.sampler->consumed},
                    {"world_size", s.sampler->world_size}};
  j["rng"] = nlohmann::json::object();
  for (const auto& [k, g] : s.rng) j["rng"][k] = {{"seed", g.seed}, {"offset", g.offset}};
  if (s.schedule)
    j["schedule"] = {{"type", "warmup_cosine"}, {"base_lr", s.schedule->base_lr}, {"warmup", s.schedule->warmup},
                     {"total", s.schedule->total}, {"min_lr", s.schedule->min_lr}};
  return j;
}

/// Parses trainer.json; `what` names the file in errors.
inline TrainerState trainer_state_from_json(const nlohmann::json& j, const std::string& what) {
  try {
    PTRAIN_CHECK(j.value("format", "") == "ptrain.trainer/1", CheckpointError, "[ptrain.ckpt.trainer] ", what,
                 ": unknown format '", j.value("format", ""), "'; expected ptrain.trainer/1");
    TrainerState s;
    s.step = j.at("step").get<std::int64_t>();
    s.world_size = j.at("world_size").get<int>();
    s.optimizer_steps = j.at("optimizer").at("steps").get<std::int64_t>();
    s.lr = j.at("optimizer").at("lr").get<double>();
    s.user = j.at("user");
    if (j.contains("sampler")) {
      const auto& sj = j["sampler"];
      s.sampler = SamplerState{sj.at("epoch").get<std::uint64_t>(), sj.at("consumed").get<std::int64_t>(),
                               sj.at("world_size").get<int>()};
    }
    for (auto it = j.at("rng").begin(); it != j.at("rng").end(); ++it)
      s.rng[it.key()] = {it.value().at("seed").get<std::uint64_t>(), it.value().at("offset").get<std::uint64_t>()};
    if (j.contains("schedule")) {
      const auto& c = j["schedule"];
      s.schedule = optim::WarmupCosine{c.at("base_lr").get<double>(), c.at("warmup").get<std::int64_t>(),
                                       c.at("total").get<std::int64_t>(), c.at("min_lr").get<double>()};
    }
    return s;
  } catch (const nlohmann::json::exception& e) {
    PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.trainer] ", what, ": ", e.what(),
                 "; the file is corrupt or from another program");
  }
}

}  // namespace ptrain::ckpt
