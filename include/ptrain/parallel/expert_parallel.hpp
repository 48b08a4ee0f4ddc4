#pragma once
// Expert parallelism (GShard, Megatron-Core, DeepSpeed-MoE): the E experts of each
// nn::MoE layer are split over an expert-parallel group of ep ranks, rank e of the
// group holding experts [e E/ep, (e+1) E/ep); the router, the shared experts and
// every dense layer stay whole on every rank (under FSDP: sharded, Note [FSDP with expert
// parallelism] in fsdp.hpp). Used through DDP or FSDP:
//
//   auto engine = parallel::make_engine<double>(llama, *world, parallel::DDPOptions{.expert_parallel = 2});
//   engine->forward_backward(my_ids, my_targets);     // every rank its own slice of the global batch
//
// and through tensor parallelism, TensorParallelPlan{.tp = 2, .expert_parallel = 2}, on the
// same ExpertMesh (Note [Expert parallelism x TP] in parallel/tp_moe.hpp).
//
// Note [Expert-parallel layout]
// - Mesh: world = dp x ep, ep innermost (world rank r = replica * ep + e), so an
//   expert-parallel group is ep consecutive ranks (one node first: its all-to-alls
//   stay on the node's links). expert_group() is those ep ranks (rank = e);
//   expert_data_group() the dp ranks that hold the same experts (rank = replica).
// - Data: every world rank trains on its own slice of the global batch (for the
//   dense part expert parallelism is data parallelism over the whole world).
// - Forward of an MoE layer (Note [The dispatch seam] in nn/moe.hpp): route and
//   permute locally; one all_to_all of E int64 row counts (each rank learns how
//   many rows of each of its experts every rank sends); all_to_all_v of the rows
//   (source-major: rank s's rows for my experts, by expert); a local regroup into
//   expert-major order (expert l's rows from rank 0, then rank 1, ...: a fixed
//   order, so results are deterministic); the local experts' grouped GEMMs; the
//   reverse regroup and all_to_all_v back; combine locally. Backward sends the
//   output gradients the same way and the input gradients back (no count exchange:
//   the forward's counts are cached).
// - Gradients (DDP): dense parameters, the router included, are averaged over the
//   world. Expert e's gradient on a rank sums the contributions of the tokens of
//   its whole expert-parallel group, each scaled by 1/(its rank's tokens) as DDP's
//   local mean losses are; the true gradient of the global mean is the sum over
//   all world ranks divided by the world size, so expert gradients are averaged
//   over expert_data_group() (dp ranks) and divided by ep.
// - Capacity: one process's rule over the global batch (capacity = ceil(factor * S * k / E)
//   for the S tokens of the world; each expert keeps its first slots in world-rank, then
//   token order). Ranks plan dropless and send every slot; an expert's rank keeps the
//   first rows that arrive (source ranks in order) up to the capacity less what the
//   replicas before its own sent to that expert (a sum over the group and an all-gather
//   over the replicas per forward) and returns zeros for the rest. So, dropless or not,
//   expert parallelism equals one process on the global batch; the load-balancing loss
//   stays each rank's (one process taking one micro-batch per rank) unless
//   global_load_balance() takes its token fractions over the ranks.
// - Checkpoints keep each expert's global name (experts.{e}.w1.weight): world rank 0
//   writes the dense tensors, replica 0 of each expert-parallel index its experts
//   (ckpt/engine_checkpoint.hpp), so any ep (or one process) loads them by name.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/flight_recorder.hpp"
#include "ptrain/nn/moe.hpp"

namespace ptrain::parallel {

/// The groups of a dp x ep world (Note [Expert-parallel layout]).
class ExpertMesh {
 public:
  /// Collective over `world` (which must outlive the mesh); ep must divide its size.
  ExpertMesh(dist::Communicator& world, int ep) : ep_(ep) {
    PTRAIN_CHECK(ep >= 1 && world.size() % ep == 0, Error, "[ptrain.ep.world] expert_parallel = ", ep,
                 " does not divide the world of ", world.size(), " ranks; launch a multiple of ep processes");
    e_ = world.rank() % ep;
    replica_ = world.rank() / ep;
    // Collective over the world, in this order on every rank.
    experts_ = world.split(replica_, e_);
    data_ = world.split(e_, replica_);
    PTRAIN_CHECK(experts_ && data_ && experts_->rank() == e_ && data_->rank() == replica_, CommError,
                 "[ptrain.ep.split] the communicator split gave unexpected groups on world rank ", world.rank());
  }
  int ep_size() const { return ep_; }
  int dp_size() const { return data_->size(); }
  /// This rank's index in its expert-parallel group.
  int ep_rank() const { return e_; }
  /// Which copy of its experts this rank holds (0 .. dp - 1).
  int replica() const { return replica_; }
  /// The ep ranks whose experts together make the layer; rank = ep_rank().
  dist::Communicator& expert_group() { return *experts_; }
  /// The ranks that hold the same experts; rank = replica().
  dist::Communicator& expert_data_group() { return *data_; }

 private:
  int ep_, e_ = 0, replica_ = 0;
  std::unique_ptr<dist::Communicator> experts_, data_;
};

/// Runs an MoE layer's experts over an expert-parallel group (Note [Expert-parallel layout]).
template <class T>
class ExpertParallelDispatch : public nn::MoeDispatch<T> {
 public:
  /// `group` (ep ranks, which must outlive this) holds `num_experts` experts, num_experts / ep each.
  /// capacity_factor > 0: one process's capacity rule over the global batch (Note [Expert-parallel
  /// layout]), with `replicas` (the dp ranks holding the same experts, rank = replica; must outlive this).
  ExpertParallelDispatch(dist::Communicator& group, std::int64_t num_experts, double capacity_factor = 0,
                         dist::Communicator* replicas = nullptr)
      : group_(group), replicas_(replicas), E_(num_experts), factor_(capacity_factor) {
    PTRAIN_CHECK(factor_ <= 0 || replicas_, Error, "[ptrain.ep.dispatch] a capacity factor needs the replicas' group");
  }

  bool applies_capacity() const override { return factor_ > 0; }
  std::int64_t capacity() const override { return capacity_; }
  std::int64_t dropped() const override { return dropped_; }

  Tensor<T> forward(nn::MoeExperts<T>& local, const Tensor<T>& xp, const std::vector<std::int64_t>& offsets,
                    nn::Cache<T>& cache) override {
    const int P = group_.size();
    const std::int64_t L = E_ / P;
    PTRAIN_CHECK(local.size() == L && static_cast<std::int64_t>(offsets.size()) == E_ + 1, ShapeError,
                 "[ptrain.ep.dispatch] ", local.size(), " local experts and ", offsets.size(), " offsets for ", E_,
                 " experts over ", P, " ranks");
    // send[d * L + l]: my rows for expert l of rank d; recv[s * L + l]: rank s's rows for my expert l.
    std::vector<std::int64_t> send(static_cast<std::size_t>(E_)), recv(static_cast<std::size_t>(E_));
    for (std::int64_t e = 0; e < E_; ++e) send[static_cast<std::size_t>(e)] = offsets[e + 1] - offsets[e];
    {
      dist::CollectiveLabel label("ep.counts");
      group_.all_to_all(send.data(), recv.data(), static_cast<std::size_t>(L), DType::I64);
    }
    const std::vector<std::int64_t> rows = expert_rows(recv);
    const std::vector<std::int64_t> keep = factor_ > 0 ? budgets(send, rows) : rows;
    cache.values.assign(send.begin(), send.end());
    cache.values.insert(cache.values.end(), recv.begin(), recv.end());
    cache.values.insert(cache.values.end(), keep.begin(), keep.end());
    const auto xl = regroup(exchange(xp, send, recv, "ep.dispatch"), recv, true);
    std::vector<std::int64_t> koff{0};
    for (auto n : keep) koff.push_back(koff.back() + n);
    const auto yl = resegment(local.forward_grouped(resegment(xl, rows, keep), koff, cache.child(0)), keep, rows);
    return exchange(regroup(yl, recv, false), recv, send, "ep.combine");
  }

  Tensor<T> backward(nn::MoeExperts<T>& local, const Tensor<T>& dyp, nn::Cache<T>& cache) override {
    const std::int64_t L = E_ / group_.size();
    PTRAIN_CHECK(cache.values.size() == static_cast<std::size_t>(2 * E_ + L), Error,
                 "[ptrain.backward] ExpertParallelDispatch::backward without a forward");
    const std::vector<std::int64_t> send(cache.values.begin(), cache.values.begin() + E_),
        recv(cache.values.begin() + E_, cache.values.begin() + 2 * E_),
        keep(cache.values.begin() + 2 * E_, cache.values.end());
    const std::vector<std::int64_t> rows = expert_rows(recv);
    const auto dyl = regroup(exchange(dyp, send, recv, "ep.dispatch_grad"), recv, true);
    const auto dxl = resegment(local.backward(resegment(dyl, rows, keep), cache.child(0)), keep, rows);
    auto dxp = exchange(regroup(dxl, recv, false), recv, send, "ep.combine_grad");
    cache.clear();
    return dxp;
  }

 private:
  // My experts' rows from every rank: rows[l] = sum over ranks s of recv[s * L + l].
  std::vector<std::int64_t> expert_rows(const std::vector<std::int64_t>& recv) const {
    const std::int64_t L = E_ / group_.size();
    std::vector<std::int64_t> rows(static_cast<std::size_t>(L), 0);
    for (std::int64_t l = 0; l < L; ++l)
      for (int s = 0; s < group_.size(); ++s)
        rows[static_cast<std::size_t>(l)] += recv[static_cast<std::size_t>(s * L + l)];
    return rows;
  }

  // One process's capacity over the global batch: capacity = ceil(factor * S / E) for the S
  // slots of every rank, and each expert keeps its first `capacity` slots in world-rank order
  // (replica-major, so replicas before mine use prefix[l] of expert l's budget; within my
  // replica the rows arrive in rank order). Returns how many of its rows each of my experts
  // keeps. Two small collectives: a sum over my group and an all-gather over the replicas.
  std::vector<std::int64_t> budgets(const std::vector<std::int64_t>& send, const std::vector<std::int64_t>& rows) {
    const auto L = static_cast<std::int64_t>(rows.size());
    std::vector<std::int64_t> mine{0};  // my group's slots, then my experts' rows
    for (auto n : send) mine[0] += n;
    {
      dist::CollectiveLabel label("ep.capacity");
      group_.all_reduce(mine.data(), 1, DType::I64, dist::ReduceOp::Sum);
    }
    mine.insert(mine.end(), rows.begin(), rows.end());
    const int R = replicas_->size();
    std::vector<std::int64_t> all(static_cast<std::size_t>(R * (L + 1)));
    {
      dist::CollectiveLabel label("ep.capacity");
      replicas_->all_gather(mine.data(), all.data(), mine.size(), DType::I64);
    }
    std::int64_t slots = 0;
    for (int r = 0; r < R; ++r) slots += all[static_cast<std::size_t>(r * (L + 1))];
    capacity_ = static_cast<std::int64_t>(std::ceil(factor_ * static_cast<double>(slots) / double(E_)));
    std::vector<std::int64_t> keep(static_cast<std::size_t>(L));
    dropped_ = 0;
    for (std::int64_t l = 0; l < L; ++l) {
      std::int64_t before = 0;
      for (int r = 0; r < replicas_->rank(); ++r) before += all[static_cast<std::size_t>(r * (L + 1) + 1 + l)];
      const std::int64_t n = rows[static_cast<std::size_t>(l)];
      keep[static_cast<std::size_t>(l)] = std::clamp<std::int64_t>(capacity_ - before, 0, n);
      dropped_ += n - keep[static_cast<std::size_t>(l)];
    }
    return keep;
  }

  // x's segments of from[l] rows (expert-major) as segments of to[l] rows: each keeps its
  // first min(from[l], to[l]) rows, the rest are zero. Before the experts (rows -> keep) it
  // drops the slots past the capacity; after them (keep -> rows) those slots come back zero.
  // x itself when nothing is dropped.
  static Tensor<T> resegment(const Tensor<T>& x, const std::vector<std::int64_t>& from,
                             const std::vector<std::int64_t>& to) {
    if (from == to) return x;
    std::int64_t total = 0;
    for (auto n : to) total += n;
    auto y = Tensor<T>::zeros({total, x.size(1)}, x.device());
    std::int64_t src = 0, dst = 0;
    for (std::size_t l = 0; l < to.size(); src += from[l], dst += to[l], ++l)
      if (const auto n = std::min(from[l], to[l]); n > 0) y.narrow(dst, n).copy_(x.narrow(src, n));
    return y;
  }

  // all_to_all_v of the rows of x: rows[r * L .. r * L + L) go to (or come from) rank r.
  Tensor<T> exchange(const Tensor<T>& x, const std::vector<std::int64_t>& out_rows,
                     const std::vector<std::int64_t>& in_rows, const char* label) {
    const int P = group_.size();
    const std::int64_t L = E_ / P, C = x.size(1);
    std::vector<std::size_t> sc(static_cast<std::size_t>(P), 0), rc(static_cast<std::size_t>(P), 0);
    std::int64_t total = 0;
    for (int r = 0; r < P; ++r)
      for (std::int64_t l = 0; l < L; ++l) {
        sc[static_cast<std::size_t>(r)] += static_cast<std::size_t>(out_rows[static_cast<std::size_t>(r * L + l)] * C);
        rc[static_cast<std::size_t>(r)] += static_cast<std::size_t>(in_rows[static_cast<std::size_t>(r * L + l)] * C);
        total += in_rows[static_cast<std::size_t>(r * L + l)];
      }
    auto y = Tensor<T>::empty({total, C}, x.device());
    dist::CollectiveLabel l(label);
    group_.all_to_all_v(x, sc, y, rc);
    return y;
  }

  // Between source-major order (rank s's rows for my expert l at block s * L + l) and
  // expert-major order (block l * P + s): block row counts are rows[s * L + l].
  Tensor<T> regroup(const Tensor<T>& x, const std::vector<std::int64_t>& rows, bool to_expert_major) {
    const int P = group_.size();
    const std::int64_t L = E_ / P;
    std::vector<std::int64_t> src_at(static_cast<std::size_t>(E_)), exp_at(static_cast<std::size_t>(E_));
    std::int64_t at = 0;
    for (std::int64_t b = 0; b < E_; ++b) {  // source-major offsets
      src_at[static_cast<std::size_t>(b)] = at;
      at += rows[static_cast<std::size_t>(b)];
    }
    at = 0;
    for (std::int64_t l = 0; l < L; ++l)
      for (int s = 0; s < P; ++s) {
        exp_at[static_cast<std::size_t>(s * L + l)] = at;
        at += rows[static_cast<std::size_t>(s * L + l)];
      }
    auto y = Tensor<T>::empty(x.shape(), x.device());
    for (std::int64_t b = 0; b < E_; ++b) {
      const std::int64_t n = rows[static_cast<std::size_t>(b)];
      if (n == 0) continue;
      const std::int64_t src = src_at[static_cast<std::size_t>(b)], exp = exp_at[static_cast<std::size_t>(b)];
      y.narrow(to_expert_major ? exp : src, n).copy_(x.narrow(to_expert_major ? src : exp, n));
    }
    return y;
  }

  dist::Communicator& group_;
  dist::Communicator* replicas_;
  std::int64_t E_;
  double factor_;
  std::int64_t capacity_ = 0, dropped_ = 0;
};

namespace detail {
template <class T>
void collect_moe(nn::Module<T>& m, std::vector<nn::MoE<T>*>& out) {
  if (auto* moe = dynamic_cast<nn::MoE<T>*>(&m)) out.push_back(moe);
  for (auto& c : m.children()) collect_moe(*c.second, out);
}
}  // namespace detail

/// Every nn::MoE layer of `model`, in module order.
template <class T>
std::vector<nn::MoE<T>*> moe_layers(nn::Module<T>& model) {
  std::vector<nn::MoE<T>*> out;
  detail::collect_moe(model, out);
  return out;
}

/// Which of `entries` (a FlatParameters' trainable or frozen entries) belong to this rank's
/// experts in `model`'s MoE layers: one flag per entry.
template <class T, class Entries>
std::vector<char> expert_flags(nn::Module<T>& model, const Entries& entries) {
  std::vector<nn::Parameter<T>*> mine;
  for (nn::MoE<T>* moe : moe_layers(model))
    for (auto& p : moe->experts().named_parameters()) mine.push_back(p.param);
  std::vector<char> flags;
  for (const auto& e : entries) flags.push_back(std::find(mine.begin(), mine.end(), e.param) != mine.end());
  return flags;
}

/// Appends to `out` the global name (under `prefix`) of every expert parameter of every MoE
/// layer of `model`, whether or not this rank holds that expert: experts.{e}.w1.weight and so
/// on for e = 0 .. num_experts - 1, what a checkpoint of the whole model holds.
template <class T>
void all_expert_names(nn::Module<T>& model, const std::string& prefix, std::vector<std::string>& out) {
  if (auto* moe = dynamic_cast<nn::MoE<T>*>(&model)) {
    const auto inside = moe->experts().expert(0).named_parameters();  // w1.weight, w2.weight, w3.weight
    for (std::int64_t e = 0; e < moe->config().num_experts; ++e)
      for (const auto& p : inside) out.push_back(prefix + "experts." + std::to_string(e) + "." + p.name);
    return;
  }
  for (auto& [name, child] : model.children()) all_expert_names(*child, prefix + name + ".", out);
}

/// Keeps in every MoE layer of `model` only the experts of this rank's expert-parallel
/// index and routes their rows over mesh.expert_group() (which must outlive the model).
/// Every rank must have built the same model. Returns the number of layers sharded.
template <class T>
std::size_t shard_experts(nn::Module<T>& model, ExpertMesh& mesh) {
  const auto layers = moe_layers(model);
  const int ep = mesh.ep_size();
  for (nn::MoE<T>* moe : layers) {
    const std::int64_t E = moe->config().num_experts;
    PTRAIN_CHECK(E % ep == 0, Error, "[ptrain.ep.experts] expert_parallel = ", ep, " does not divide the ", E,
                 " experts of ", moe->describe(), "; choose an ep degree that divides num_experts");
    moe->shard_experts(mesh.ep_rank() * (E / ep), E / ep,
                       std::make_shared<ExpertParallelDispatch<T>>(mesh.expert_group(), E,
                                                                   moe->config().capacity_factor,
                                                                   &mesh.expert_data_group()));
  }
  return layers.size();
}

/// Undoes shard_experts() on world rank 0: each MoE layer of its `model` gets all its
/// experts back (replica 0 of each expert-parallel index sends its own) and runs them
/// alone, e.g. to sample or export after training (gpt_char). Collective over `world`,
/// the mesh's; the other ranks' models stay sharded.
template <class T>
void gather_experts(nn::Module<T>& model, ExpertMesh& mesh, dist::Communicator& world) {
  const bool lead = world.rank() == 0;
  for (nn::MoE<T>* moe : moe_layers(model)) {
    const nn::MoeConfig& c = moe->config();
    const std::int64_t per_rank = c.num_experts / mesh.ep_size();
    nn::MoeExperts<T>& local = moe->experts();
    std::shared_ptr<nn::MoeExperts<T>> all;
    if (lead) {
      Generator scratch(0);  // every value is overwritten
      all = std::make_shared<nn::MoeExperts<T>>(c.num_experts, c.n_embd, c.expert_hidden, scratch);
      all->to(moe->router().weight().value.device());
    }
    for (std::int64_t e = 0; e < c.num_experts; ++e) {
      const int owner = static_cast<int>(e / per_rank);  // world rank of replica 0's expert-parallel index
      const bool mine = mesh.replica() == 0 && mesh.ep_rank() == owner;
      if (!lead && !mine) continue;
      std::vector<nn::NamedParameter<T>> from, to;
      if (mine) from = local.expert(e - local.first()).named_parameters();
      if (lead) to = all->expert(e).named_parameters();
      for (std::size_t j = 0; j < std::max(from.size(), to.size()); ++j) {
        if (lead && mine) to[j].param->value.copy_(from[j].param->value);
        else if (lead) world.recv(to[j].param->value, owner);
        else world.send(from[j].param->value, 0);
      }
    }
    if (lead) moe->unshard_experts(std::move(all));
  }
}

/// Global-batch load balancing (Megatron-Core's global auxiliary loss): the load-balancing
/// loss of every MoE layer of `model` takes its token fractions f_e over all ranks of `comm`
/// (the data-parallel ranks: the world under DDP and FSDP, with or without expert
/// parallelism) instead of each rank's own tokens: one all-reduce of E + 1 numbers per layer
/// and forward, collective over `comm` (so every rank must run every forward). The mean over
/// the ranks of their losses is then one process's on the global batch (equal tokens per
/// rank; dropless, or plain DDP's per-rank capacity: the fractions count the slots each rank
/// keeps). Call it once, after make_engine.
template <class T>
void global_load_balance(nn::Module<T>& model, dist::Communicator& comm) {
  for (nn::MoE<T>* moe : moe_layers(model))
    moe->router().set_count_reducer([&comm](std::vector<double>& counts) {
      dist::CollectiveLabel label("moe.balance");
      comm.all_reduce(counts.data(), counts.size(), DType::F64, dist::ReduceOp::Sum);
    });
}

/// Ends the metrics window (Note [MoE metrics window] in nn/moe.hpp) of every MoE layer of
/// `model` with its sums over all ranks of `comm`, what window_stats() and
/// Module::named_metrics() then report: tokens_per_expert, dropped and the forwards counted
/// summed, so max_load and mean_load (the load imbalance) from the summed counts;
/// aux_loss, z_loss and loss the mean over every counted forward of every rank (capacity
/// stays this rank's). The next counted forward starts a new window, so a loop that calls
/// this before each record reports the forwards since the previous one. One all-reduce of
/// E + 5 numbers per layer (none on one rank); collective over `comm`, whose ranks must
/// hold the same MoE layers (every rank under Local, DDP with any expert_parallel, FSDP,
/// context parallelism and tensor parallelism, where each tp rank routes its own slice;
/// not pipeline stages). Backward does not read the window, so this may run between steps.
template <class T>
void all_reduce_moe_stats(nn::Module<T>& model, dist::Communicator& comm) {
  const auto layers = moe_layers(model);
  if (comm.size() == 1) {
    for (nn::MoE<T>* moe : layers) moe->end_window(moe->window());
    return;
  }
  if (layers.empty()) return;
  std::vector<double> v;
  for (nn::MoE<T>* moe : layers) {
    const nn::MoeWindow& w = moe->window();
    for (std::int64_t e = 0; e < moe->config().num_experts; ++e)
      v.push_back(w.forwards > 0 ? double(w.tokens_per_expert[static_cast<std::size_t>(e)]) : 0.0);
    v.insert(v.end(), {double(w.dropped), w.aux_loss, w.z_loss, w.loss, double(w.forwards)});
  }
  {
    dist::CollectiveLabel label("moe.stats");
    comm.all_reduce(v.data(), v.size(), DType::F64, dist::ReduceOp::Sum);
  }
  std::size_t at = 0;
  for (nn::MoE<T>* moe : layers) {
    const auto E = static_cast<std::size_t>(moe->config().num_experts);
    nn::MoeWindow w;
    w.forwards = static_cast<std::int64_t>(v[at + E + 4]);
    if (w.forwards > 0)  // empty: no forward counted on any rank
      for (std::size_t e = 0; e < E; ++e) w.tokens_per_expert.push_back(static_cast<std::int64_t>(v[at + e]));
    w.dropped = static_cast<std::int64_t>(v[at + E]);
    w.aux_loss = v[at + E + 1];
    w.z_loss = v[at + E + 2];
    w.loss = v[at + E + 3];
    w.capacity = moe->window().capacity;
    at += E + 5;
    moe->end_window(std::move(w));
  }
}

/// Starts a new, empty metrics window in every MoE layer of `model` (nn::MoE::reset_window;
/// the Trainer calls it after each record, on every rank).
template <class T>
void reset_moe_metrics(nn::Module<T>& model) {
  for (nn::MoE<T>* moe : moe_layers(model)) moe->reset_window();
}

}  // namespace ptrain::parallel
