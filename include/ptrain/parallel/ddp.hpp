#pragma once
// Distributed data parallel: every rank holds the whole model, computes
// gradients on its own part of the batch, and the gradients are averaged
// across ranks before each optimizer step. An Engine (parallel/engine.hpp):
//
//   parallel::DDP<float> ddp(model, comm);              // broadcasts rank 0's parameters
//   optim::AdamW<float> opt(ddp.parameters(), {.lr = 1e-3});
//   ddp.zero_grad();
//   double loss = ddp.forward_backward(x, y);          // all-reduces start during backward
//   ddp.step(opt);                                     // waits for them, then steps
//
// Note [Bucketing]
// Gradients live in one flat buffer (nn::FlatParameters), parameters in
// registration order. Backward produces them roughly in reverse order, so
// buckets are contiguous ranges of the flat buffer taken from its end: bucket
// 0 holds the last parameters (ready first), bucket 1 the ones before, and so
// on. A bucket is all-reduced in place as soon as all of its parameters have
// announced their gradient (Module's gradient-ready hook), while backward goes
// on with earlier layers; no gradient is copied. Bucket 0 is small (default
// 1 MiB) so the first all-reduce starts early; the others hold up to
// bucket_cap_bytes (default 25 MiB, as PyTorch). Buckets are always launched in
// index order, on every rank, so the collective order is identical everywhere
// (see Note [Collective order contract] in dist/communicator.hpp) even if
// hooks fire in a different order on different ranks.
//
// Note [Unused parameters]
// A parameter that gets no gradient in a step (an unused branch) never
// announces it, so its bucket is not launched during backward.
// finish_gradient_sync() (called by step(), clip_grad_norm_() and the next
// forward_backward()) launches every bucket not launched yet, in index
// order, and waits for all. All ranks therefore make the same calls in the
// same order whatever each used, and nothing deadlocks; the unused parameter's
// (zero or accumulated) gradient is averaged like any other.
//
// Note [Determinism]
// The reduction of a bucket is one collective over a fixed range of a fixed
// buffer, in a fixed order; with a deterministic backend (MPI, Gloo, NCCL for a
// fixed size and world) the same run gives bitwise-equal parameters.
//
// Note [Frozen parameters under DDP]
// Frozen parameters (Parameter::requires_grad false) sit in FlatParameters'
// frozen_values(), outside the gradient buffer: buckets, hooks, the all-reduce
// and clip_grad_norm_() cover the trainable parameters only, and a frozen
// parameter keeps no gradient. The initial broadcast sends the frozen values
// too, so every replica starts, and stays, equal. docs/finetuning.md counts the memory.
//
// With DDPOptions::expert_parallel = ep > 1 the MoE layers' experts are split over
// groups of ep ranks (Note [Expert-parallel layout] in expert_parallel.hpp): buckets
// never mix dense and expert parameters; an expert bucket is averaged over the ranks
// that hold the same experts and divided by ep, a dense one averaged over the world.

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "ptrain/dist/communicator.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/ops/vector.hpp"
#include "ptrain/parallel/engine.hpp"
#include "ptrain/parallel/expert_parallel.hpp"
#include "ptrain/parallel/model_check.hpp"

namespace ptrain::parallel {

struct DDPOptions {
  std::int64_t bucket_cap_bytes = 25 << 20;
  std::int64_t first_bucket_bytes = 1 << 20;
  /// Copy rank 0's parameters to every rank at construction (as PyTorch DDP).
  bool broadcast_parameters = true;
  /// Copy rank 0's buffers (BatchNorm's running statistics) to every rank at the
  /// start of each forward, as PyTorch DDP's broadcast_buffers: every replica then
  /// evaluates, and checkpoints, the same statistics. One broadcast of all
  /// buffers per forward; a model without buffers pays nothing.
  bool broadcast_buffers = true;
  /// How gradients travel over the wire (as FSDPOptions::reduce_dtype): F32, the
  /// gradients' own type; or BF16, rounded to bf16 on their device, all-reduced in
  /// bf16 and widened back (half the bytes, ~3 significant digits; a no-op for bf16 models).
  DType reduce_dtype = DType::F32;
  /// Split the experts of every nn::MoE layer over groups of this many consecutive
  /// ranks (Note [Expert-parallel layout] in expert_parallel.hpp); 1: every rank holds all.
  int expert_parallel = 1;
};

/// Timing of one bucket's all-reduce in the last backward (steady-clock seconds).
struct BucketEvent {
  int bucket;
  double launched;  ///< when the all-reduce was started
};

template <class T>
class DDP : public nn::Module<T>, public Engine<T> {
 public:
  /// Wraps `module` (which, with `comm`, must outlive the wrapper) and packs its parameters
  /// into flat buffers. Verifies that every rank has the same parameters (names, shapes,
  /// dtype) and broadcasts rank 0's values.
  /// With opt.expert_parallel > 1 it first keeps only this rank's experts of the module's
  /// MoE layers (parallel::shard_experts).
  DDP(nn::Module<T>& module, dist::Communicator& comm, DDPOptions opt = {})
      : experts_(expert_mesh(module, comm, opt.expert_parallel)),
        owned_params_(std::make_unique<nn::FlatParameters<T>>(module)),
        module_(module), params_(*owned_params_), comm_(comm), opt_(opt) {
    init();
  }
  /// Wraps `module`, whose parameters `params` packs already; both must outlive the wrapper.
  DDP(nn::Module<T>& module, nn::FlatParameters<T>& params, dist::Communicator& comm, DDPOptions opt = {})
      : module_(module), params_(params), comm_(comm), opt_(opt) {
    PTRAIN_CHECK(opt.expert_parallel == 1, Error, "[ptrain.ep.engine] expert parallelism shards the module before "
                 "its parameters are packed: use DDP(module, comm, options) or make_engine");
    init();
  }
  ~DDP() override {
    for (auto& e : params_.entries()) e.param->on_grad_ready = nullptr;
  }

  Mode mode() const override { return Mode::DDP; }
  nn::FlatParameters<T>& parameters() override { return params_; }
  nn::Module<T>& local_module() override { return module_; }
  dist::Communicator& communicator() override { return comm_; }
  using Engine<T>::train;
  void zero_grad() override {
    finish_gradient_sync();
    params_.zero_grad();
  }

  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    sync_buffers();
    return module_.forward(x, cache);
  }
  Tensor<T> forward_tokens(const Tensor<std::int32_t>& ids, nn::Cache<T>& cache) override {
    sync_buffers();
    return module_.forward_tokens(ids, cache);
  }

  /// Backward of the wrapped module; full buckets start their all-reduce while it runs.
  /// finish_gradient_sync() (step() calls it) waits for them.
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    if (in_backward_) finish_gradient_sync();  // a second backward before step(): the first one's sync ends first
    if (this->syncing()) begin_sync();
    return module_.backward(dy, cache);
  }

  /// Launches buckets that backward left (unused parameters), waits for all
  /// all-reduces, and leaves the averaged gradients in the flat buffer.
  /// A no-op inside no_sync(). Throws CommError naming the bucket on failure or timeout.
  void finish_gradient_sync() override {
    if (!in_backward_) return;
    for (std::size_t b = next_launch_; b < buckets_.size(); ++b) buckets_[b].ready = buckets_[b].expected;
    launch_ready();
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      if (!buckets_[b].work) {
        scale_experts(buckets_[b]);
        continue;
      }
      try {
        obs::Span span("ddp.bucket_wait", "ddp", static_cast<std::int64_t>(b));
        buckets_[b].work->wait(comm_.timeout());
      } catch (const CommError& e) {
        in_backward_ = false;
        PTRAIN_THROW(CommError, "[ptrain.ddp.sync] gradient bucket ", b, " (", buckets_[b].names, ") failed: ",
                     e.what());
      }
      if (compressed()) unpack_bf16(buckets_[b]);
      scale_experts(buckets_[b]);
      buckets_[b].work.reset();
    }
    in_backward_ = false;
  }

  std::string describe() const override { return "DDP(" + module_.describe() + ")"; }
  std::size_t num_buckets() const { return buckets_.size(); }
  /// Element range [begin, end) of bucket b in the flat gradient buffer.
  std::pair<std::int64_t, std::int64_t> bucket_range(std::size_t b) const {
    return {buckets_.at(b).begin, buckets_.at(b).end};
  }
  /// When each bucket's all-reduce started in the last synchronised backward.
  const std::vector<BucketEvent>& bucket_events() const { return events_; }
  /// The expert-parallel groups (DDPOptions::expert_parallel > 1), or null.
  ExpertMesh* expert_mesh() { return experts_.get(); }
  /// Whether entry i of parameters() is an expert's (distinct on each expert-parallel rank).
  bool is_expert(std::size_t i) const { return !expert_.empty() && expert_.at(i); }
  /// The same for entry i of parameters().frozen_entries().
  bool is_frozen_expert(std::size_t i) const { return !frozen_expert_.empty() && frozen_expert_.at(i); }

 private:
  void init() {
    PTRAIN_CHECK(opt_.bucket_cap_bytes > 0 && opt_.first_bucket_bytes > 0, Error,
                 "[ptrain.ddp.options] bucket sizes must be positive");
    PTRAIN_CHECK(opt_.reduce_dtype == DType::F32 || opt_.reduce_dtype == DType::BF16, Error,
                 "[ptrain.ddp.options] reduce_dtype must be F32 (the gradients' own type) or BF16");
    comm_.check_serves(params_.values().device(), "DDP");
    if (experts_) {
      std::vector<nn::Parameter<T>*> mine;
      for (auto* moe : moe_layers(module_))
        for (auto& p : moe->experts().named_parameters()) mine.push_back(p.param);
      auto is_mine = [&](nn::Parameter<T>* p) { return std::find(mine.begin(), mine.end(), p) != mine.end(); };
      for (const auto& e : params_.entries()) expert_.push_back(is_mine(e.param));
      for (const auto& e : params_.frozen_entries()) frozen_expert_.push_back(is_mine(e.param));
      // Note [Bucketing]: whether an expert (trainable or frozen) lies before each trainable entry.
      bool seen = false;
      for (auto& p : module_.named_parameters()) {
        if (p.param->requires_grad) {
          expert_gap_.push_back(seen);
          seen = false;
        }
        if (is_mine(p.param)) seen = true;
      }
    }
    verify_same_parameters();
    build_buckets();
    if (opt_.broadcast_parameters) broadcast_values();
    install_hooks();
    detail::attach_replica_sum(module_, &comm_);
    buffers_ = module_.named_buffers();
  }

  struct Bucket {
    std::int64_t begin = 0, end = 0;  // element range of the flat buffers
    int expected = 0;                 // parameters in the bucket
    int ready = 0;                    // announced in this backward
    std::string names;                // for error messages
    bool expert = false;              // expert parameters: reduced over the expert-data group
    std::shared_ptr<dist::Work> work;
    Tensor<bf16> wire;                // BF16 compression buffer, on the gradients' device
  };

  double run(const BatchInput<T>& in, const Targets<T>& targets, double grad_scale,
             bool training) override {
    return this->run_module(*this, in, targets, grad_scale, training);
  }

  // DDPOptions::broadcast_parameters: rank 0's values to every rank, the frozen ones too
  // (Note [Frozen parameters] in nn/flat_parameters.hpp), so every replica starts equal.
  // With expert parallelism each bucket (and frozen tensor) comes from rank 0 of its group.
  void broadcast_values() {
    if (!experts_) {
      if (comm_.size() < 2) return;
      if (params_.values().numel() > 0) comm_.broadcast(params_.values(), 0);
      if (params_.frozen_values().numel() > 0) comm_.broadcast(params_.frozen_values(), 0);
      return;
    }
    for (auto& b : buckets_) {
      Tensor<T> v = params_.values().view(b.begin, {b.end - b.begin});
      if (group(b).size() > 1) group(b).broadcast(v, 0);
    }
    const auto& frozen = params_.frozen_entries();
    for (std::size_t i = 0; i < frozen.size(); ++i) {
      dist::Communicator& c = is_frozen_expert(i) ? experts_->expert_data_group() : comm_;
      if (c.size() > 1) c.broadcast(frozen[i].param->value, 0);
    }
  }

  // DDPOptions::broadcast_buffers: rank 0's buffers, packed into one tensor, to every rank.
  void sync_buffers() {
    if (!opt_.broadcast_buffers || comm_.size() < 2 || buffers_.empty()) return;
    std::int64_t total = 0;
    for (auto& b : buffers_) total += b.buffer->numel();
    if (buffer_pack_.numel() != total || buffer_pack_.device() != buffers_.front().buffer->device())
      buffer_pack_ = Tensor<T>::empty({total}, buffers_.front().buffer->device());
    std::int64_t at = 0;
    for (auto& b : buffers_) {
      buffer_pack_.view(at, b.buffer->shape()).copy_(*b.buffer);
      at += b.buffer->numel();
    }
    comm_.broadcast(buffer_pack_, 0);
    at = 0;
    for (auto& b : buffers_) {
      b.buffer->copy_(buffer_pack_.view(at, b.buffer->shape()));
      at += b.buffer->numel();
    }
  }

  // Dense parameters alike on every rank, experts alike on the ranks that hold the same ones.
  void verify_same_parameters() {
    std::vector<std::string> dense, experts;
    if (experts_) dense.push_back(::ptrain::detail::cat("DDPOptions{.expert_parallel = ", opt_.expert_parallel, "}"));
    const auto& entries = params_.entries();
    for (std::size_t i = 0; i < entries.size(); ++i)
      (is_expert(i) ? experts : dense)
          .push_back(entries[i].name + " " + entries[i].shape.str() + " " + dtype_name(dtype_of<T>()));
    const auto& frozen = params_.frozen_entries();
    for (std::size_t i = 0; i < frozen.size(); ++i)
      (is_frozen_expert(i) ? experts : dense)
          .push_back(frozen[i].name + " " + frozen[i].shape.str() + " " + dtype_name(dtype_of<T>()) + " frozen");
    if (!experts_) {
      check_same_model(comm_, dense);
      return;
    }
    dense.push_back(::ptrain::detail::cat(experts.size(), " expert tensors"));
    check_same_model(comm_, dense);
    check_same_model(experts_->expert_data_group(), experts);
  }

  // Agrees on the ep degree first (a rank with another ep would split the world
  // differently and hang), then splits the world and shards the MoE layers.
  static std::unique_ptr<ExpertMesh> expert_mesh(nn::Module<T>& module, dist::Communicator& comm, int ep) {
    if (ep == 1) return nullptr;  // a rank with ep = 1 meets this check in verify_same_parameters()
    check_same_model(comm, {::ptrain::detail::cat("DDPOptions{.expert_parallel = ", ep, "}")});
    auto mesh = std::make_unique<ExpertMesh>(comm, ep);
    PTRAIN_CHECK(shard_experts(module, *mesh) > 0, Error, "[ptrain.ep.model] expert_parallel = ", ep, " but ",
                 module.describe(), " has no nn::MoE layer; use expert_parallel = 1");
    return mesh;
  }
  dist::Communicator& group(const Bucket& b) { return b.expert ? experts_->expert_data_group() : comm_; }

  // Note [Bucketing]: walk the entries from the last, cut when a bucket is full. Only
  // trainable parameters have entries (and gradients); a wholly frozen model has no bucket.
  // With expert parallelism a bucket holds dense or expert parameters only, and a dense
  // bucket never spans a place where experts sit (expert_gap_), trainable or frozen, and
  // the first bucket of each kind is the small one: the dense buckets are then the same
  // on every rank even where ranks hold different numbers of trainable experts.
  void build_buckets() {
    const auto& entries = params_.entries();
    const std::int64_t n = params_.numel();
    const std::int64_t elem = static_cast<std::int64_t>(sizeof(T));
    entry_bucket_.assign(entries.size(), 0);
    if (entries.empty()) return;
    std::int64_t end = n;
    Bucket cur;
    cur.end = n;
    int made[2] = {0, 0};  // dense and expert buckets so far
    for (std::size_t i = entries.size(); i-- > 0;) {
      const std::int64_t begin = i == 0 ? 0 : entries[i].offset;
      const std::int64_t cap = made[cur.expert] == 0 ? opt_.first_bucket_bytes : opt_.bucket_cap_bytes;
      if (cur.expected > 0 && ((end - begin) * elem > cap || cur.expert != is_expert(i) ||
                               (!expert_gap_.empty() && expert_gap_[i + 1]))) {
        cur.begin = entries[i + 1].offset;
        ++made[cur.expert];
        buckets_.push_back(std::move(cur));
        cur = Bucket{};
        cur.end = end = buckets_.back().begin;
      }
      entry_bucket_[i] = static_cast<int>(buckets_.size());
      cur.expert = is_expert(i);
      ++cur.expected;
      cur.names = entries[i].name + (cur.names.empty() ? "" : ", " + cur.names);
    }
    cur.begin = 0;
    buckets_.push_back(std::move(cur));
  }

  void install_hooks() {
    const auto& entries = params_.entries();
    announced_.assign(entries.size(), 0);
    for (std::size_t i = 0; i < entries.size(); ++i)
      entries[i].param->on_grad_ready = [this, i](nn::Parameter<T>&) { on_ready(i); };
  }

  void begin_sync() {
    in_backward_ = true;
    next_launch_ = 0;
    events_.clear();
    for (auto& b : buckets_) b.ready = 0;
    std::fill(announced_.begin(), announced_.end(), 0);
  }

  void on_ready(std::size_t entry) {
    if (!in_backward_) return;
    PTRAIN_CHECK(!announced_[entry], Error, "[ptrain.ddp.hook] parameter ", params_.entries()[entry].name,
                 " announced its gradient twice in one backward; a module must call mark_grad_ready() once, "
                 "when the gradient is final (a shared weight announces after its last use)");
    announced_[entry] = 1;
    ++buckets_[static_cast<std::size_t>(entry_bucket_[entry])].ready;
    launch_ready();
  }

  // Launches ready buckets strictly in index order (Note [Bucketing]).
  void launch_ready() {
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready == buckets_[next_launch_].expected) {
      Bucket& b = buckets_[next_launch_];
      dist::CollectiveLabel label(b.expert ? "ddp.expert_bucket" : "ddp.bucket");
      Tensor<T> grad = bucket_grads(b);
      const auto count = static_cast<std::size_t>(grad.numel());
      events_.push_back({static_cast<int>(next_launch_), detail::steady_seconds()});
      dist::Communicator& c = group(b);
      if (c.size() == 1) {
        b.work = nullptr;  // experts without replicas: only the 1/ep below
      } else if (compressed()) {
        pack_bf16(b, grad);
        b.work = c.all_reduce_async(b.wire.data(), b.wire.data(), count, DType::BF16, dist::ReduceOp::Avg);
      } else {
        b.work = c.all_reduce_async(grad.data(), grad.data(), count, dtype_of<T>(), dist::ReduceOp::Avg);
      }
      ++next_launch_;
    }
  }

  Tensor<T> bucket_grads(const Bucket& b) { return params_.grads().view(b.begin, {b.end - b.begin}); }
  // Note [Expert-parallel layout]: the average over the expert-data group, divided by ep.
  void scale_experts(const Bucket& b) {
    if (!b.expert) return;
    Tensor<T> g = bucket_grads(b);
    ops::scale_(g, static_cast<acc_t<T>>(1.0 / experts_->ep_size()));
  }

  // Global-norm clipping: experts' squares summed over the expert-parallel group, dense ones once.
  double sum_over_model(double local) override {
    if (!experts_) return local;
    double mine = 0;
    const auto& entries = params_.entries();
    for (std::size_t i = 0; i < entries.size(); ++i)
      if (expert_[i]) mine += ops::sum_squares(entries[i].param->grad);
    double all = mine;
    experts_->expert_group().all_reduce(&all, 1, DType::F64, dist::ReduceOp::Sum);
    return local - mine + all;
  }
  // BF16 compression: the bucket's gradients rounded into its wire buffer (on
  // their device, so a GPU run never copies them to the host), and back.
  bool compressed() const { return opt_.reduce_dtype == DType::BF16 && !std::is_same_v<T, bf16>; }
  void pack_bf16(Bucket& b, const Tensor<T>& grad) {
    if (!b.wire.defined()) b.wire = Tensor<bf16>::empty(Shape{grad.numel()}, grad.device());
    ops::cast_into(grad, b.wire);
  }
  void unpack_bf16(Bucket& b) {
    Tensor<T> grad = bucket_grads(b);
    ops::cast_into(b.wire, grad);
  }

  std::unique_ptr<ExpertMesh> experts_;  // before owned_params_: the module is sharded before it is packed
  std::unique_ptr<nn::FlatParameters<T>> owned_params_;
  nn::Module<T>& module_;
  nn::FlatParameters<T>& params_;
  dist::Communicator& comm_;
  DDPOptions opt_;
  std::vector<nn::NamedBuffer<T>> buffers_;  // the module's, for broadcast_buffers
  Tensor<T> buffer_pack_;
  std::vector<Bucket> buckets_;
  std::vector<int> entry_bucket_;
  std::vector<char> expert_;  // per entry, with expert parallelism
  std::vector<char> frozen_expert_;  // per frozen entry, with expert parallelism
  std::vector<char> expert_gap_;     // per entry: an expert sits between it and the entry before
  std::vector<char> announced_;
  std::vector<BucketEvent> events_;
  std::size_t next_launch_ = 0;
  bool in_backward_ = false;
};

}  // namespace ptrain::parallel
