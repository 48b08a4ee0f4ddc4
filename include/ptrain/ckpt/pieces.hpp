#pragma once
// Pieces of logical tensors: what one rank of a sharded run saves (TensorPiece,
// ShardedState), and how a reader groups the pieces of an index back into
// whole tensors, checking that they tile each tensor exactly.
//
// Note [Sharded checkpoints]
// A rank saves pieces of logical tensors: elements [offset, offset + n) of a
// tensor in row-major order (an FSDP shard cuts parameters anywhere). A piece
// that is the whole tensor is stored under the tensor's name with its shape
// (a pipeline stage's files read like any safetensors file); a partial one
// under "name@offset", 1-D, and index.json's "pieces" records its tensor, whole
// shape, offset and length. The commit checks that each tensor's pieces tile
// it exactly. Readers see logical tensors only: read_into() assembles a whole
// tensor and read_range() any range of one, so a checkpoint saved on N ranks
// loads on M ranks with any other sharding, or in one process, and
// export_model() writes one unsharded file.

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "ptrain/core/safetensors.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/optim/optimizer.hpp"

namespace ptrain::ckpt {

/// Part of a logical tensor that one rank saves (Note [Sharded checkpoints]):
/// elements [offset, offset + numel) of tensor `name`, whose whole shape is `shape`.
struct TensorPiece {
  std::string name;
  Shape shape;              ///< of the whole tensor
  std::int64_t offset = 0;  ///< first element of the piece, row-major
  TensorRef data;           ///< the piece's elements (contiguous)
  Device device = Device::cpu();
  bool whole() const { return offset == 0 && data.shape.numel() == shape.numel(); }
  /// Name in the shard file: `name` for a whole tensor, "name@offset" for a part.
  std::string key() const { return whole() ? name : name + "@" + std::to_string(offset); }
};

/// The piece of tensor `name` (whole shape `whole_shape`) that starts at element
/// `offset` and holds part's elements; part may live on any device.
template <class T>
TensorPiece piece(std::string name, Shape whole_shape, std::int64_t offset, const Tensor<T>& part) {
  PTRAIN_CHECK(name.find('@') == std::string::npos && !name.empty(), CheckpointError, "[ptrain.ckpt.name] tensor "
               "name '", name, "' is empty or contains '@' (reserved for pieces)");
  PTRAIN_CHECK(offset >= 0 && offset + part.numel() <= whole_shape.numel(), CheckpointError, "[ptrain.ckpt.piece] "
               "piece [", offset, ", ", offset + part.numel(), ") of '", name, "' lies outside its ", whole_shape.numel(),
               " elements");
  const bool all = offset == 0 && part.numel() == whole_shape.numel();
  TensorPiece p{std::move(name), whole_shape, offset, {}, part.device()};
  p.data = {"", dtype_of<T>(), all ? whole_shape : Shape{part.numel()}, part.data()};
  return p;
}
/// All of tensor t, saved under `name`.
template <class T>
TensorPiece whole(std::string name, const Tensor<T>& t) {
  return piece(std::move(name), t.shape(), 0, t);
}

/// What one rank writes with save_sharded(): model tensors go to
/// model-RRRRR-of-WWWWW.safetensors, optimizer state to optimizer-RRRRR-of-WWWWW.safetensors.
struct ShardedState {
  std::vector<TensorPiece> model, optimizer;
  std::int64_t optimizer_steps = -1;  ///< with lr: saved in trainer.json when >= 0
  double lr = 0.0;
  /// Records opt's step count and learning rate.
  template <class T>
  void record(const optim::Optimizer<T>& opt) {
    optimizer_steps = opt.steps();
    lr = opt.lr();
  }
};

/// Every tensor of `params` and of opt's state, whole: what a rank that holds
/// its own distinct tensors (a pipeline stage) passes to save_sharded().
template <class T>
ShardedState whole_tensors(nn::FlatParameters<T>& params, std::type_identity_t<optim::Optimizer<T>>* opt) {
  ShardedState s;
  for (const auto& e : params.all_entries()) s.model.push_back(whole(e.name, e.param->value));
  for (const auto& b : params.buffers()) s.model.push_back(whole(b.name, *b.buffer));
  if (opt) {
    for (const auto& [n, t] : opt->state_tensors()) s.optimizer.push_back(whole(n, t));
    s.record(*opt);
  }
  return s;
}

namespace detail {

/// Where the elements of one logical tensor are stored.
struct PieceRef {
  std::int64_t offset, numel;
  std::string key;  // tensor name in the file
};
struct LogicalTensor {
  Shape shape;
  std::vector<PieceRef> pieces;  // sorted by offset, tiling [0, shape.numel())
};

/// Groups the "pieces" of an index ({key: {tensor, shape, offset, numel}}) by
/// tensor and checks that each tensor's pieces tile it exactly, with one shape
/// and no tensor also stored whole; `what` names the index in errors.
inline std::map<std::string, LogicalTensor> group_pieces(const nlohmann::json& pieces,
                                                         const std::map<std::string, std::string>& weight_map,
                                                         const std::string& what) {
  std::map<std::string, LogicalTensor> out;
  try {
    for (auto it = pieces.begin(); it != pieces.end(); ++it) {
      const auto& v = it.value();
      const std::string name = v.at("tensor").get<std::string>();
      const Shape shape(v.at("shape").get<std::vector<std::int64_t>>());
      PTRAIN_CHECK(!weight_map.count(name), CheckpointError, "[ptrain.ckpt.index] ", what, ": tensor '", name,
                   "' is stored whole and in pieces");
      auto [lt, fresh] = out.try_emplace(name, LogicalTensor{shape, {}});
      PTRAIN_CHECK(lt->second.shape == shape, CheckpointError, "[ptrain.ckpt.index] ", what, ": pieces of '", name,
                   "' disagree on its shape (", lt->second.shape, " and ", shape, ")");
      lt->second.pieces.push_back({v.at("offset").get<std::int64_t>(), v.at("numel").get<std::int64_t>(), it.key()});
    }
  } catch (const nlohmann::json::exception& e) {
    PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.index] ", what, ": bad piece entry: ", e.what());
  } catch (const ShapeError& e) {
    PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.index] ", what, ": bad piece shape: ", e.what());
  }
  for (auto& [name, lt] : out) {
    std::sort(lt.pieces.begin(), lt.pieces.end(), [](const PieceRef& a, const PieceRef& b) { return a.offset < b.offset; });
    std::int64_t next = 0;
    for (const auto& p : lt.pieces) {
      PTRAIN_CHECK(p.offset == next && p.numel > 0, CheckpointError, "[ptrain.ckpt.pieces] ", what, ": the pieces of '",
                   name, "' ", p.offset < next ? "overlap" : "leave a gap", " at element ", std::min(p.offset, next),
                   "; every element must be saved by exactly one rank (with replicas, let one of them write)");
      next += p.numel;
    }
    PTRAIN_CHECK(next == lt.shape.numel(), CheckpointError, "[ptrain.ckpt.pieces] ", what, ": the pieces of '", name,
                 "' cover ", next, " of its ", lt.shape.numel(), " elements; a rank's part is missing");
  }
  return out;
}

}  // namespace detail

}  // namespace ptrain::ckpt
