#pragma once
// The whole trained model on one rank, whatever the parallel layout: PyTorch's
// get_model_state_dict(model, StateDictOptions(full_state_dict=True, cpu_offload=True))
// with rank0_only. At the end of training:
//
//   auto full = ckpt::full_state_dict(*engine);   // collective; on rank 0 every tensor, whole, in host memory
//   ckpt::gather_full_model(*engine, model);      // collective; rank 0's model gets the trained values
//   if (world.rank() == 0) sample(model);
//
// Note [Gathering the full model]
// The pieces are those of a checkpoint of the engine (detail::engine_parts, Note
// [Sharded checkpoints]): rank 0's whole model (Local, DDP), every shard group's
// pieces (FSDP), replica 0 of each stage (Pipeline), tp rank 0's gathered tensors
// (TensorParallel), replica 0 of each expert-parallel index its experts; so each
// element travels once, from the rank that would write it, and replicas send
// nothing. Every rank sends the root the size of its pieces' description (one
// all_gather), then the description (names, whole shapes, offsets, lengths, as
// JSON), and, once the root has checked that the pieces tile every tensor exactly
// (and, for gather_full_model, that they match the model) and every rank agreed
// (one all_reduce: an error anywhere ends every rank before any data moves), the
// pieces' elements, one message per piece, in the same order. Pieces on a GPU go
// through host memory when the communicator serves the host (MPI, Gloo), and
// through a buffer on the engine's device when it serves only the device (NCCL).
// The root holds the model once in host memory; another rank holds at most one
// piece's copy at a time beyond what a checkpoint save of its layout gathers (tp
// rank 0's full tensors under tensor parallelism).

#include <cstring>
#include <exception>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ptrain/ckpt/engine_checkpoint.hpp"

namespace ptrain::ckpt {

namespace detail {

// The device a rank's transfers go through: the host when the communicator serves
// it, else the engine's device (NCCL).
template <class T>
Device transfer_device(dist::Communicator& world, parallel::Engine<T>& engine) {
  if (world.serves(Device::cpu())) return Device::cpu();
  const Device d = engine.has_parameters() ? engine.parameters().values().device() : Device::cpu();
  world.check_serves(d, "ckpt::full_state_dict");
  return d;
}

// Runs `fn` on every rank; when it throws on any rank every rank throws (its own
// error, or one naming the first failed rank), so no rank waits for a transfer.
template <class Fn>
void gather_agree(dist::Communicator& world, Fn&& fn) {
  std::exception_ptr err;
  try {
    fn();
  } catch (...) {
    err = std::current_exception();
  }
  std::int32_t failed = err ? world.size() - world.rank() : 0;  // the lowest failed rank wins the max
  if (world.size() > 1) world.all_reduce(&failed, 1, DType::I32, dist::ReduceOp::Max);
  if (err) std::rethrow_exception(err);
  if (failed)
    PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.gather] rank ", world.size() - failed, " failed while gathering the "
                 "full model (its error says why); every rank stops before any tensor moves");
}

// The description of `pieces` that the root reads: [{name, shape, offset, numel, dtype}].
inline std::string describe_pieces(const std::vector<TensorPiece>& pieces) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& p : pieces)
    j.push_back({{"name", p.name},
                 {"shape", p.shape.vec()},
                 {"offset", p.offset},
                 {"numel", p.data.shape.numel()},
                 {"dtype", dtype_name(p.data.dtype)}});
  return j.dump();
}

// The whole model on `root` from every rank's `pieces` (Note [Gathering the full model]);
// `check(shapes)` runs on root before any data moves. Collective over `world`.
template <class T, class Check>
std::map<std::string, Tensor<T>> assemble(dist::Communicator& world, Device via, int root,
                                          const std::vector<TensorPiece>& pieces, Check&& check) {
  const int n = world.size(), me = world.rank();
  // 1. The descriptions' sizes, then the descriptions, to the root.
  const std::string mine = describe_pieces(pieces);
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(n));
  const std::int64_t my_size = pieces.empty() ? 0 : static_cast<std::int64_t>(mine.size());
  if (n > 1) world.all_gather(&my_size, sizes.data(), 1, DType::I64);
  else sizes[0] = my_size;
  std::vector<std::string> texts(static_cast<std::size_t>(n));
  // As 8-byte words: not every backend moves bytes (MPI's has no U8).
  auto words = [](std::int64_t bytes) { return static_cast<std::size_t>((bytes + 7) / 8); };
  if (me == root) {
    for (int r = 0; r < n; ++r) {
      const std::int64_t bytes = sizes[static_cast<std::size_t>(r)];
      if (bytes == 0) continue;
      if (r == root) {
        texts[static_cast<std::size_t>(r)] = mine;
        continue;
      }
      std::vector<std::int64_t> buf(words(bytes));
      world.recv(buf.data(), buf.size(), DType::I64, r);
      texts[static_cast<std::size_t>(r)].assign(reinterpret_cast<const char*>(buf.data()),
                                                static_cast<std::size_t>(bytes));
    }
  } else if (my_size > 0) {
    std::vector<std::int64_t> buf(words(my_size), 0);
    std::memcpy(buf.data(), mine.data(), mine.size());
    world.send(buf.data(), buf.size(), DType::I64, root);
  }
  // 2. The root checks that the pieces tile every tensor exactly, and `check`; every rank agrees.
  std::map<std::string, Tensor<T>> full;
  std::vector<nlohmann::json> described(static_cast<std::size_t>(n), nlohmann::json::array());
  gather_agree(world, [&] {
    for (const auto& p : pieces)
      PTRAIN_CHECK(p.data.dtype == dtype_of<T>(), CheckpointError, "[ptrain.ckpt.gather] piece of '", p.name, "' is ",
                   dtype_name(p.data.dtype), " but the engine's model is ", dtype_name(dtype_of<T>()));
    if (me != root) return;
    for (int r = 0; r < n; ++r)
      if (!texts[static_cast<std::size_t>(r)].empty())
        described[static_cast<std::size_t>(r)] = nlohmann::json::parse(texts[static_cast<std::size_t>(r)]);
    nlohmann::json index = nlohmann::json::object();
    for (int r = 0; r < n; ++r)
      for (const auto& d : described[static_cast<std::size_t>(r)])
        index[std::to_string(r) + "/" + std::to_string(index.size())] = {
            {"tensor", d.at("name")}, {"shape", d.at("shape")}, {"offset", d.at("offset")}, {"numel", d.at("numel")}};
    std::map<std::string, Shape> shapes;
    for (const auto& [name, lt] : group_pieces(index, {}, "the gathered model")) shapes.emplace(name, lt.shape);
    check(shapes);
    for (const auto& [name, shape] : shapes) full.emplace(name, Tensor<T>::empty(shape));  // host
  });
  // 3. The elements, one message per piece, in the order described.
  const std::size_t esize = dtype_size(dtype_of<T>());
  if (me != root) {
    for (const auto& p : pieces) {
      const auto count = static_cast<std::size_t>(p.data.shape.numel());
      if (world.serves(p.device)) {
        world.send(p.data.data, count, dtype_of<T>(), root);
      } else {  // through `via`: the host (MPI, Gloo) or the communicator's device (NCCL)
        auto buf = Tensor<T>::empty({p.data.shape.numel()}, via);
        ptrain::detail::copy_bytes(buf.data(), via, p.data.data, p.device, count * esize);
        world.send(buf.data(), count, dtype_of<T>(), root);
      }
    }
    return {};
  }
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < described[static_cast<std::size_t>(r)].size(); ++i) {
      const auto& d = described[static_cast<std::size_t>(r)][i];
      T* dst = full.at(d.at("name").get<std::string>()).data() + d.at("offset").get<std::int64_t>();
      const std::int64_t numel = d.at("numel").get<std::int64_t>();
      if (r == root) {
        ptrain::detail::copy_bytes(dst, Device::cpu(), pieces[i].data.data, pieces[i].device,
                                   static_cast<std::size_t>(numel) * esize);
      } else if (via.is_cpu()) {
        world.recv(dst, static_cast<std::size_t>(numel), dtype_of<T>(), r);
      } else {
        auto buf = Tensor<T>::empty({numel}, via);
        world.recv(buf.data(), static_cast<std::size_t>(numel), dtype_of<T>(), r);
        ptrain::detail::copy_bytes(dst, Device::cpu(), buf.data(), via, static_cast<std::size_t>(numel) * esize);
      }
    }
  }
  return full;
}

// full_state_dict() with `check(shapes)` run on root before any data moves.
template <class T, class Check>
std::map<std::string, Tensor<T>> full_state_dict_checked(parallel::Engine<T>& engine, int root, Check&& check) {
  dist::Communicator& world = engine.communicator();
  PTRAIN_CHECK(root >= 0 && root < world.size(), CheckpointError, "[ptrain.ckpt.gather] root ", root,
               " is not a rank of the engine's ", world.size(), " ranks");
  const Device via = transfer_device(world, engine);
  std::map<std::string, Tensor<T>> full;
  engine_parts(
      &world, engine, static_cast<optim::Optimizer<T>*>(nullptr), TrainerState{},
      [&](nn::FlatParameters<T>& params, TrainerState) {  // the whole model on every rank: rank 0's
        const auto model = world.rank() == 0 ? whole_tensors(params, nullptr).model : std::vector<TensorPiece>{};
        full = assemble<T>(world, via, root, model, check);
      },
      [&](const ShardedState& mine, TrainerState) { full = assemble<T>(world, via, root, mine.model, check); });
  return full;
}

}  // namespace detail

/// The whole model of `engine`, on rank `root` of engine.communicator(): every
/// parameter (frozen ones too) and buffer, whole, in host memory, under its name in
/// the one-process model (as a checkpoint names it), sorted by name; empty on the
/// other ranks. Collective: every rank of the engine calls it. The optimizer's
/// state is not included. Note [Gathering the full model].
template <class T>
std::map<std::string, Tensor<T>> full_state_dict(parallel::Engine<T>& engine, int root = 0) {
  return detail::full_state_dict_checked(engine, root, [](const std::map<std::string, Shape>&) {});
}

/// full_state_dict() copied into `model` on rank `root` (collective): each of
/// model's parameters (frozen ones too) and buffers gets the tensor of its name, on
/// the device it lives on, as loading a checkpoint of the engine into one process
/// would; a parameter whose tensor the engine released (FSDP frees the model's own)
/// gets a new one on the engine's device. The other ranks leave `model` untouched.
/// A name missing on either side or a shape that differs throws [ptrain.ckpt.gather]
/// on every rank before anything changes. A tied weight is one parameter under one
/// name (GPT's "wte.weight"); a model whose head is untied (a pipeline's) needs an
/// engine of an untied model.
template <class T>
void gather_full_model(parallel::Engine<T>& engine, nn::Module<T>& model, int root = 0) {
  const bool mine = engine.communicator().rank() == root;
  std::vector<std::pair<std::string, Tensor<T>*>> targets;
  if (mine) {
    for (auto& p : model.named_parameters()) targets.emplace_back(p.name, &p.param->value);
    for (auto& b : model.named_buffers()) targets.emplace_back(b.name, b.buffer);
  }
  auto full = detail::full_state_dict_checked(engine, root, [&](const std::map<std::string, Shape>& shapes) {
    std::set<std::string> known;
    for (const auto& [name, t] : targets) {
      known.insert(name);
      const auto it = shapes.find(name);
      PTRAIN_CHECK(it != shapes.end(), CheckpointError, "[ptrain.ckpt.gather] the model has '", name,
                   "' but the engine's model does not; gather into a model of the same architecture as the engine's");
      PTRAIN_CHECK(!t->defined() || it->second == t->shape(), CheckpointError, "[ptrain.ckpt.gather] '", name,
                   "' is ", it->second, " in the engine's model but ", t->shape(),
                   " in the model to fill; build it with the same config");
    }
    for (const auto& [name, shape] : shapes)
      PTRAIN_CHECK(known.count(name), CheckpointError, "[ptrain.ckpt.gather] the engine's model has '", name,
                   "' but the model to fill does not (a tied weight there, untied in the engine?); build it with the "
                   "same config");
  });
  const Device released = engine.has_parameters() ? engine.parameters().values().device() : Device::cpu();
  for (auto& [name, t] : targets) {
    if (t->defined()) t->copy_(full.at(name));
    else *t = released.is_cpu() ? full.at(name) : full.at(name).to(released);  // released by the engine (FSDP)
    full.erase(name);                       // the host copy goes as soon as the model holds it
  }
}

}  // namespace ptrain::ckpt
