#pragma once
// Pipeline parallelism: a model given as an ordered list of units (embedding,
// blocks..., head) is cut into p contiguous stages, one per rank of a pipeline
// group. A batch is split into m micro-batches along its first dimension;
// activations travel forward and gradients backward between neighbouring
// stages by send/recv; the loss is computed on the last stage; gradients
// accumulate over the m micro-batches, and the user steps the optimizer once
// per batch.
//
//   auto part = parallel::partition_balanced(unit_costs, comm.size());
//   parallel::Pipeline<float> pipe(comm, num_units, make_unit, part,
//                                  {.schedule = parallel::Schedule::OneFOneB, .micro_batches = 8});
//   optim::AdamW<float> opt(pipe.parameters(), {.lr = 1e-3});
//   pipe.zero_grad();
//   double loss = pipe.forward_backward(x, y);   // x used on the first stage, y on the last
//   pipe.step(opt);
//
// An Engine (parallel/engine.hpp). Language models pass int32 token ids as the
// first stage's input (the only form for bf16, Note [bf16 kernels]).
//
// Each rank calls the factory only for its own units, so a stage never holds
// the rest of the model.
//
// Note [Schedules]
// GPipe runs every forward, then every backward: each stage holds m
// micro-batch caches at its peak. 1F1B (PipeDream-flush, as Megatron-LM) lets
// stage s run w = min(p - s - 1, m) warm-up forwards, then alternates one
// forward and one backward, then drains w backwards: at most min(p - s, m) <= p
// caches are alive at once, whatever m is. Both schedules do the same
// arithmetic per micro-batch and have the same bubble, (p - 1) / (m + p - 1) of
// each stage's time when forward and backward times are equal across stages;
// 1F1B only bounds activation memory. Interleaved 1F1B (v chunks per rank) is
// not offered: see docs/pipeline.md.
//
// Note [Communication order]
// Messages carry tag 0 and pair by order (Note [Point-to-point order] in
// dist/communicator.hpp), as NCCL requires: every message from stage s to s + 1
// is an activation (the shape message first, once), every message back a
// gradient, both in micro-batch order on each side. After each forward or
// backward a stage posts, in one group, the send of its result and the recv of
// the next action's input, and waits for that recv before computing. The group
// is what keeps NCCL from deadlocking, where a send may wait for its recv and
// transfers run in order on one stream: in 1F1B stage s sends activation i and
// then needs gradient j from s + 1, while s + 1 sends gradient j and then needs
// activation i from s (Megatron-LM's send_forward_recv_backward). MPI and Gloo
// start each transfer at once, so there the order of posting is what matters:
// a recv is posted just before the compute that needs it, never earlier (the
// Gloo backend reports p2p completions in posting order, so waiting on a later
// gradient could otherwise depend on an earlier activation whose sender is
// itself waiting for us). Sends are waited for only at the end of the step;
// their tensors stay alive in a pending list until then.

// Note [Shapes]
// Shapes are agreed once, on the first train_step: each stage sends the shape
// of its output (rank and dimensions as I64, a host buffer, outside any group)
// to the next stage before the first activation; gradients flowing back have
// the shape of the activation they belong to. Later steps must use the same micro-batch shape; a stage
// that sees another one throws ShapeError (its neighbours then fail with a
// CommError when it stops, or after the timeout).
//
// Note [Loss scaling]
// Each micro-batch's loss is the mean over its rows (CrossEntropyLoss); its
// gradient is scaled by 1/m, so the accumulated gradient is the gradient of
// the mean over micro-batches, which equals the full-batch mean when every
// micro-batch counts the same number of targets (no ignore_index rows). The
// returned loss is the mean of the micro-batch losses.

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ptrain/dist/communicator.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/nn/loss.hpp"
#include "ptrain/nn/module.hpp"
#include "ptrain/nn/sequential.hpp"
#include "ptrain/parallel/engine.hpp"
#include "ptrain/parallel/mesh.hpp"

namespace ptrain::parallel {

/// Which units each stage holds: stage s owns units [begin(s), end(s)).
class StagePartition {
 public:
  StagePartition() = default;
  /// bounds = {0, c1, ..., c_{p-1}, num_units}, strictly increasing.
  explicit StagePartition(std::vector<std::size_t> bounds) : bounds_(std::move(bounds)) {
    PTRAIN_CHECK(bounds_.size() >= 2 && bounds_.front() == 0, Error,
                 "[ptrain.pipeline.partition] bounds must start at 0 and have at least two entries");
    for (std::size_t i = 1; i < bounds_.size(); ++i)
      PTRAIN_CHECK(bounds_[i] > bounds_[i - 1], Error, "[ptrain.pipeline.partition] stage ", i - 1,
                   " would be empty (bounds ", bounds_[i - 1], " -> ", bounds_[i],
                   "); every stage needs at least one unit");
  }
  int num_stages() const { return static_cast<int>(bounds_.size()) - 1; }
  std::size_t num_units() const { return bounds_.back(); }
  std::size_t begin(int stage) const { return bounds_.at(static_cast<std::size_t>(stage)); }
  std::size_t end(int stage) const { return bounds_.at(static_cast<std::size_t>(stage) + 1); }
  /// The stage that owns `unit`.
  int stage_of(std::size_t unit) const {
    PTRAIN_CHECK(unit < num_units(), Error, "[ptrain.pipeline.partition] unit ", unit, " >= ", num_units());
    return static_cast<int>(std::upper_bound(bounds_.begin(), bounds_.end(), unit) - bounds_.begin()) - 1;
  }
  const std::vector<std::size_t>& bounds() const { return bounds_; }
  /// "[0,3) [3,6)".
  std::string str() const {
    std::string s;
    for (int i = 0; i < num_stages(); ++i)
      s += detail::cat(i ? " " : "", "[", begin(i), ",", end(i), ")");
    return s;
  }

 private:
  std::vector<std::size_t> bounds_;
};

/// Stages cut before the given units: partition_by_cuts(6, {2, 4}) gives [0,2) [2,4) [4,6).
inline StagePartition partition_by_cuts(std::size_t num_units, const std::vector<std::size_t>& cuts) {
  std::vector<std::size_t> b{0};
  for (std::size_t c : cuts) {
    PTRAIN_CHECK(c > b.back() && c < num_units, Error, "[ptrain.pipeline.cuts] cut points must be strictly "
                 "increasing and inside (0, ", num_units, "); got ", c, " after ", b.back());
    b.push_back(c);
  }
  b.push_back(num_units);
  return StagePartition(std::move(b));
}

/// Contiguous stages that minimise the largest stage cost (cost[u] of unit u:
/// parameter count, measured time, FLOPs). Ties go to the cut that puts more
/// units early. Exact dynamic programme, O(p n^2).
inline StagePartition partition_balanced(const std::vector<double>& cost, int stages) {
  const std::size_t n = cost.size();
  PTRAIN_CHECK(stages >= 1 && n >= static_cast<std::size_t>(stages), Error, "[ptrain.pipeline.balance] cannot "
               "split ", n, " units into ", stages, " non-empty stages; use fewer stages or finer units");
  for (double c : cost)
    PTRAIN_CHECK(c >= 0 && std::isfinite(c), Error, "[ptrain.pipeline.balance] unit costs must be finite and >= 0");
  std::vector<double> prefix(n + 1, 0.0);
  for (std::size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost[i];
  const double inf = std::numeric_limits<double>::infinity();
  const auto p = static_cast<std::size_t>(stages);
  // best[k][j]: smallest max-cost of the first j units in k stages; from[k][j]: where stage k-1 starts.
  std::vector<std::vector<double>> best(p + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<std::size_t>> from(p + 1, std::vector<std::size_t>(n + 1, 0));
  best[0][0] = 0;
  for (std::size_t k = 1; k <= p; ++k)
    for (std::size_t j = k; j <= n; ++j)
      for (std::size_t i = k - 1; i < j; ++i) {
        const double v = std::max(best[k - 1][i], prefix[j] - prefix[i]);
        if (v <= best[k][j]) {  // <=: a later start makes earlier stages longer
          best[k][j] = v;
          from[k][j] = i;
        }
      }
  std::vector<std::size_t> b(p + 1);
  b[p] = n;
  for (std::size_t k = p; k >= 1; --k) b[k - 1] = from[k][b[k]];
  return StagePartition(std::move(b));
}

enum class Schedule {
  GPipe,     ///< all forwards, then all backwards (m caches alive per stage)
  OneFOneB,  ///< warm-up, one forward one backward, drain (at most p caches alive)
};

inline const char* schedule_name(Schedule s) { return s == Schedule::GPipe ? "gpipe" : "1f1b"; }

/// One step of a stage's schedule.
struct PipelineAction {
  enum Kind : char { Forward = 'F', Backward = 'B' } kind;
  int micro_batch;
};

/// The order in which `stage` of `stages` runs forwards and backwards of m micro-batches (Note [Schedules]).
inline std::vector<PipelineAction> make_schedule(Schedule s, int stage, int stages, int m) {
  PTRAIN_CHECK(stages >= 1 && stage >= 0 && stage < stages && m >= 1, Error, "[ptrain.pipeline.schedule] stage ",
               stage, " of ", stages, " with ", m, " micro-batches is invalid");
  std::vector<PipelineAction> out;
  if (s == Schedule::GPipe) {
    for (int i = 0; i < m; ++i) out.push_back({PipelineAction::Forward, i});
    for (int i = 0; i < m; ++i) out.push_back({PipelineAction::Backward, i});
    return out;
  }
  const int warmup = std::min(stages - stage - 1, m);
  int f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back({PipelineAction::Forward, f});
  for (; f < m; ++f, ++b) {
    out.push_back({PipelineAction::Forward, f});
    out.push_back({PipelineAction::Backward, b});
  }
  for (; b < m; ++b) out.push_back({PipelineAction::Backward, b});
  return out;
}

/// Start and end of one forward or backward (steady-clock seconds, comparable across processes of one host).
struct PipelineEvent {
  int stage;
  int micro_batch;
  char kind;  ///< 'F' or 'B'
  double start, end;
};

template <class T>
struct PipelineOptions {
  Schedule schedule = Schedule::OneFOneB;
  int micro_batches = 1;  ///< m; the batch's first dimension must be divisible by it
  /// Parameter-name prefix of each unit (e.g. GPT's unit_names()); default: the unit index.
  std::vector<std::string> unit_names = {};
  /// Loss on the last stage; default: mean cross-entropy over the rows of the output.
  LossFn<T> loss = {};
  /// Replicas of this stage in other pipelines (data parallel): gradients are averaged over this group
  /// after the stage's last backward, overlapping the stages still running. Must outlive the pipeline.
  dist::Communicator* data_parallel = nullptr;
  /// train_step() zeroes the stage's gradients first (off: accumulate across steps).
  bool zero_grad = true;
  /// Broadcast the loss from the last stage so train_step returns it on every stage.
  bool broadcast_loss = true;
};

namespace detail {
using ::ptrain::detail::cat;

// The units of one stage, named by their global unit name so parameter names
// match the full model's (checkpoints, error messages).
template <class T>
class StageModule : public nn::UnitChain<T> {
 public:
  void add(const std::string& name, std::shared_ptr<nn::Module<T>> unit) { this->add_unit(name, std::move(unit)); }
  std::string describe() const override { return this->describe_units("Stage"); }
};

constexpr int kMaxShapeDims = 8;  // Note [Shapes]

// group_start() on construction, group_end() by end() or, after an exception, by the destructor.
class P2PGroup {
 public:
  explicit P2PGroup(dist::Communicator& c) : c_(c) { c_.group_start(); }
  P2PGroup(const P2PGroup&) = delete;
  P2PGroup& operator=(const P2PGroup&) = delete;
  void end() {
    open_ = false;
    c_.group_end();
  }
  ~P2PGroup() {
    if (!open_) return;
    try {
      c_.group_end();
    } catch (...) {  // the exception in flight says what went wrong first
    }
  }

 private:
  dist::Communicator& c_;
  bool open_ = true;
};

}  // namespace detail

/// One rank's stage of a pipeline over the ranks of `comm` (stage = comm.rank()).
template <class T>
class Pipeline : public Engine<T> {
 public:
  /// Builds unit u of the model; called only for this stage's units, in increasing u.
  using UnitFactory = std::function<std::shared_ptr<nn::Module<T>>(std::size_t unit)>;

  /// Collective over `comm` (size == partition.num_stages()). `comm` (and
  /// options.data_parallel) must outlive the pipeline.
  Pipeline(dist::Communicator& comm, std::size_t num_units, const UnitFactory& factory, StagePartition partition,
           PipelineOptions<T> options = {})
      : comm_(comm), part_(std::move(partition)), opt_(std::move(options)) {
    PTRAIN_CHECK(part_.num_units() == num_units, Error, "[ptrain.pipeline.partition] the partition covers ",
                 part_.num_units(), " units but the model has ", num_units);
    PTRAIN_CHECK(part_.num_stages() == comm_.size(), Error, "[ptrain.pipeline.stages] the partition has ",
                 part_.num_stages(), " stages but the pipeline group has ", comm_.size(),
                 " ranks; cut the model into exactly one stage per rank of the group");
    PTRAIN_CHECK(opt_.micro_batches >= 1, Error, "[ptrain.pipeline.micro_batches] micro_batches must be >= 1, got ",
                 opt_.micro_batches);
    PTRAIN_CHECK(opt_.unit_names.empty() || opt_.unit_names.size() == num_units, Error,
                 "[ptrain.pipeline.names] ", opt_.unit_names.size(), " unit names for ", num_units, " units");
    stage_ = comm_.rank();
    for (std::size_t u = part_.begin(stage_); u < part_.end(stage_); ++u) {
      auto unit = factory(u);
      PTRAIN_CHECK(unit != nullptr, Error, "[ptrain.pipeline.factory] the unit factory returned null for unit ", u);
      module_.add(opt_.unit_names.empty() ? std::to_string(u) : opt_.unit_names[u], std::move(unit));
    }
    reject_borrowed_across_stages();
    // A stage without parameters has empty flat buffers, so an optimizer is built
    // (and stepped) on every stage alike.
    if (!module_.named_parameters().empty()) flat_ = std::make_unique<nn::FlatParameters<T>>(module_);
    else flat_ = std::make_unique<nn::FlatParameters<T>>(Tensor<T>::zeros({0}), Tensor<T>::zeros({0}),
                                                         std::vector<nn::FlatEntry<T>>{});
    // Activations and gradients are received on the device of the stage's parameters.
    if (has_parameters()) device_ = flat_->values().device();
    PTRAIN_CHECK(has_parameters() || comm_.serves(Device::cpu()), Error, "[ptrain.pipeline.device] stage ", stage_,
                 " holds no parameters, so it has no GPU to receive activations on; over ", comm_.backend(),
                 " every stage needs a unit with parameters on its GPU (cut the model differently)");
    comm_.check_serves(device_, "Pipeline");
    if (opt_.data_parallel) opt_.data_parallel->check_serves(device_, "Pipeline (data-parallel group)");
    if (opt_.loss) this->set_loss(opt_.loss);
    detail::attach_replica_sum(module_, opt_.data_parallel);
  }

  /// This rank's stage on a dp x pp mesh: the pipeline of its replica, with
  /// gradients averaged over the replicas of its stage (mesh.data_group()).
  /// `mesh` must outlive the pipeline.
  Pipeline(Mesh& mesh, std::size_t num_units, const UnitFactory& factory, StagePartition partition,
           PipelineOptions<T> options = {})
      : Pipeline(mesh.pipeline_group(), num_units, factory, std::move(partition),
                 with_data_group(std::move(options), mesh)) {
    world_ = &mesh.world();
  }

  Mode mode() const override { return Mode::Pipeline; }
  nn::Module<T>& local_module() override { return module_; }
  /// The world of the mesh (or the pipeline group without one).
  dist::Communicator& communicator() override { return world_ ? *world_ : comm_; }
  dist::Communicator* data_parallel_group() override { return opt_.data_parallel; }
  void zero_grad() override {
    flat_->zero_grad();
  }
  /// The data-parallel average ends inside forward_backward(): nothing is outstanding after it.
  void finish_gradient_sync() override {}

  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // Note [Pipeline batches]
  // forward_backward(input, targets) runs one batch: forward and backward of m
  // micro-batches in the configured schedule, gradients accumulated into
  // parameters().grads() (and averaged over options.data_parallel, unless inside
  // no_sync()). input [B, ...] (features, or int32 token ids that the first unit
  // looks up) is read on the first stage and targets [B, ...] on the last; other
  // stages may pass empty tensors. B must be divisible by m and the same every
  // step. It returns the mean micro-batch loss (on every stage with
  // broadcast_loss, averaged over the replicas; else NaN off the last stage).
  // eval_loss() runs the m micro-batches forward only (no activations kept);
  // call train(false) first to turn dropout off.

  /// zero_grad() (unless options.zero_grad is off) and forward_backward().
  double train_step(const Tensor<T>& input, const Targets<T>& targets) {
    return run_step(input, targets, true, opt_.zero_grad);
  }
  /// train_step() from int32 token ids.
  double train_step(const Tensor<std::int32_t>& ids, const Targets<T>& targets) {
    return run_step(ids, targets, true, opt_.zero_grad);
  }

  int stage() const { return stage_; }
  int num_stages() const { return part_.num_stages(); }
  bool is_first() const { return stage_ == 0; }
  bool is_last() const { return stage_ == num_stages() - 1; }
  const StagePartition& partition() const { return part_; }
  const PipelineOptions<T>& options() const { return opt_; }
  /// Changes the number of micro-batches for later steps (shapes are re-agreed).
  void set_micro_batches(int m) {
    PTRAIN_CHECK(m >= 1, Error, "[ptrain.pipeline.micro_batches] micro_batches must be >= 1, got ", m);
    opt_.micro_batches = m;
    shapes_agreed_ = false;
  }
  void set_schedule(Schedule s) { opt_.schedule = s; }

  /// This stage's units in one module; parameter names are "<unit name>.<param>".
  nn::Module<T>& module() { return module_; }
  bool has_parameters() const override { return !flat_->entries().empty(); }
  /// The stage's parameters in flat buffers (for the optimizer); empty buffers on a stage without parameters.
  nn::FlatParameters<T>& parameters() override { return *flat_; }

  /// Forward/backward events of the last train_step (or eval_step), in execution order.
  const std::vector<PipelineEvent>& timeline() const { return events_; }
  /// Steady-clock time at which the last train_step started on this stage.
  double step_start() const { return step_start_; }
  /// Most micro-batch caches alive at once in the last train_step (Note [Schedules]).
  int peak_live_caches() const { return peak_live_; }
  /// Micro-batch caches alive now (0 between steps: each is freed when its backward ran).
  int live_caches() const { return static_cast<int>(caches_.size()); }

 private:
  // What one micro-batch keeps between its forward and its backward.
  struct MicroBatch {
    nn::Cache<T> cache;       // the stage's activations
    Tensor<T> dout;           // last stage: gradient of the scaled loss
  };
  struct Pending {  // a transfer in flight and the buffer it reads or writes
    std::shared_ptr<dist::Work> work;
    Tensor<T> keep;  // the buffer must outlive the transfer
  };

  static PipelineOptions<T> with_data_group(PipelineOptions<T> o, Mesh& mesh) {
    o.data_parallel = &mesh.data_group();
    return o;
  }

  double run(const BatchInput<T>& in, const Targets<T>& targets, double grad_scale,
             bool training) override {
    grad_scale_ = grad_scale;
    return in.ids ? run_step(*in.ids, targets, training, false) : run_step(*in.x, targets, training, false);
  }
  // The stages hold distinct parameters: their squared norms add up.
  double sum_over_model(double sq) override {
    if (comm_.size() > 1) comm_.all_reduce(&sq, 1, DType::F64, dist::ReduceOp::Sum);
    return sq;
  }

  template <class In>
  double run_step(const Tensor<In>& input, const Targets<T>& targets, bool training, bool zero) {
    const int m = opt_.micro_batches, p = num_stages();
    if (is_first()) check_batch(input, "input");
    if (is_last()) check_batch(targets, "targets");
    if (training && zero) zero_grad();
    training_ = training;
    events_.clear();
    caches_.clear();
    peak_live_ = backwards_done_ = 0;
    loss_sum_ = 0;
    agreeing_ = !shapes_agreed_;
    step_start_ = detail::steady_seconds();
    try {
      // Note [Communication order]: each action's result goes out in one group with the next action's input.
      std::vector<PipelineAction> plan;
      if (training) plan = make_schedule(opt_.schedule, stage_, p, m);
      else for (int mb = 0; mb < m; ++mb) plan.push_back({PipelineAction::Forward, mb});
      if (agreeing_ && !is_first()) in_shape_ = recv_shape();
      post_recv(plan.front());
      for (std::size_t k = 0; k < plan.size(); ++k) {
        const PipelineAction& a = plan[k];
        Tensor<T> out = a.kind == PipelineAction::Forward ? forward_one(a.micro_batch, input, targets)
                                                          : backward_one(a.micro_batch);
        const bool recv_next = k + 1 < plan.size() && source_of(plan[k + 1]) >= 0;
        if (out.defined() || recv_next) {
          doing_ = "posting the transfers to the neighbouring stages";
          detail::P2PGroup group(comm_);
          dist::CollectiveLabel label("pipeline.activation");
          if (out.defined()) {
            const int peer = a.kind == PipelineAction::Forward ? stage_ + 1 : stage_ - 1;
            sends_.push_back(
                {comm_.send_async(out.data(), static_cast<std::size_t>(out.numel()), dtype_of<T>(), peer), out});
          }
          if (recv_next) post_recv(plan[k + 1]);
          group.end();
        }
        reap_sends(false);
      }
      reap_sends(true);
      shapes_agreed_ = true;
      if (dp_work_) {
        doing_ = "averaging gradients over the data-parallel group";
        dp_work_->wait();
        dp_work_.reset();
      }
    } catch (const CommError& e) {
      abandon();
      PTRAIN_THROW(CommError, "[ptrain.pipeline.comm] stage ", stage_, " of ", p, " (rank ", comm_.rank(),
                   ") while ", doing(), ": ", e.what(), "; a neighbouring stage failed or died; every stage must "
                   "call the same step (train_step or eval_step) with the same micro_batches and schedule");
    } catch (...) {
      abandon();
      throw;
    }
    double loss = is_last() ? loss_sum_ / m : std::numeric_limits<double>::quiet_NaN();
    if (opt_.broadcast_loss && p > 1) comm_.broadcast(&loss, 1, DType::F64, p - 1);
    if (opt_.broadcast_loss && opt_.data_parallel && opt_.data_parallel->size() > 1)
      opt_.data_parallel->all_reduce(&loss, 1, DType::F64, dist::ReduceOp::Avg);
    return loss;
  }

  void check_batch(const auto& t, const char* what) const {
    PTRAIN_CHECK(t.defined() && t.dim() >= 1, ShapeError, "[ptrain.pipeline.batch] stage ", stage_, " needs the ",
                 what, " batch (first dimension = batch rows)");
    PTRAIN_CHECK(t.size(0) % opt_.micro_batches == 0, ShapeError, "[ptrain.pipeline.batch] ", what, " has ",
                 t.size(0), " rows, not divisible by micro_batches = ", opt_.micro_batches,
                 "; pick a batch size that is a multiple of m");
  }

  // A unit that uses a parameter owned outside this stage (a GPT head tied to
  // the token embedding, Note [Weight tying] in nn/models/gpt.hpp) would
  // update a weight that lives on another rank.
  void reject_borrowed_across_stages() {
    std::set<nn::Parameter<T>*> owned;
    for (auto& p : module_.named_parameters()) owned.insert(p.param);
    for (auto* p : module_.borrowed_parameters())
      PTRAIN_CHECK(owned.count(p), Error, "[ptrain.pipeline.tied] stage ", stage_, " has a unit that shares a "
                   "parameter with a unit of another stage (e.g. an LM head tied to the token embedding); a "
                   "pipeline cannot share a weight between stages: build the model untied (tie_weights = false)");
  }

  void record(char kind, int mb, double t0) {
    events_.push_back({stage_, mb, kind, t0, detail::steady_seconds()});
    if (obs::tracing())  // the same clock: trace_now_us() is steady_seconds() in microseconds
      obs::Tracer::get().complete(kind == 'F' ? "pipeline.forward" : "pipeline.backward", "pipeline", t0 * 1e6,
                                  events_.back().end * 1e6, mb);
  }

  // Note [Shapes]: sends this stage's output shape once, before the first activation.
  void send_shape(const Shape& s) {
    PTRAIN_CHECK(s.size() <= detail::kMaxShapeDims, ShapeError, "[ptrain.pipeline.shape] activations of rank ",
                 s.size(), " exceed ", detail::kMaxShapeDims, " dimensions");
    auto& msg = shape_msgs_.emplace_back();
    msg.fill(0);
    msg[0] = s.size();
    for (int i = 0; i < s.size(); ++i) msg[static_cast<std::size_t>(i) + 1] = s[i];
    sends_int_.push_back(comm_.send_async(msg.data(), msg.size(), DType::I64, stage_ + 1));
  }
  Shape recv_shape() {
    std::vector<std::int64_t> msg(detail::kMaxShapeDims + 1, 0);
    doing_ = "receiving the activation shape from the previous stage";
    comm_.recv(msg.data(), msg.size(), DType::I64, stage_ - 1);
    PTRAIN_CHECK(msg[0] >= 1 && msg[0] <= detail::kMaxShapeDims, CommError, "[ptrain.pipeline.shape] stage ",
                 stage_, " got a corrupt shape message from stage ", stage_ - 1);
    return Shape(std::vector<std::int64_t>(msg.begin() + 1, msg.begin() + 1 + msg[0]));
  }

  // The neighbour an action takes its input from, or -1 (first stage's forwards, last stage's backwards).
  int source_of(const PipelineAction& a) const {
    if (a.kind == PipelineAction::Forward) return is_first() ? -1 : stage_ - 1;
    return is_last() ? -1 : stage_ + 1;
  }

  // Posts the recv of action a's input into incoming_ (Note [Communication order]).
  void post_recv(const PipelineAction& a) {
    const int peer = source_of(a);
    if (peer < 0) return;
    const bool fwd = a.kind == PipelineAction::Forward;
    incoming_ = Tensor<T>::empty(fwd ? in_shape_ : out_shape_, device_);
    incoming_action_ = a;
    dist::CollectiveLabel label("pipeline.activation");
    incoming_work_ = comm_.recv_async(incoming_.data(), static_cast<std::size_t>(incoming_.numel()), dtype_of<T>(),
                                      peer);
  }
  // doing_ in words; a receive names what it waits for.
  std::string doing() const {
    if (doing_ != kReceiving) return doing_;
    const PipelineAction& a = incoming_action_;
    const bool fwd = a.kind == PipelineAction::Forward;
    return detail::cat("receiving ", fwd ? "the activation" : "the gradient", " of micro-batch ", a.micro_batch,
                       " from stage ", source_of(a));
  }
  // Waits for the recv post_recv() started; returns its tensor.
  Tensor<T> take_recv() {
    doing_ = kReceiving;
    incoming_work_->wait();
    incoming_work_.reset();
    return std::exchange(incoming_, Tensor<T>());
  }

  // Runs micro-batch mb's forward; returns the activation for the next stage (undefined on the last).
  template <class In>
  Tensor<T> forward_one(int mb, const Tensor<In>& input, const Targets<T>& targets) {
    const int m = opt_.micro_batches;
    Tensor<In> first;  // the first stage's micro-batch
    Tensor<T> x;       // a later stage's activation from the previous stage
    if (is_first()) {
      const std::int64_t rows = input.size(0) / m;
      first = input.narrow(mb * rows, rows);
      if (agreeing_ && mb == 0) in_shape_ = first.shape();
      PTRAIN_CHECK(first.shape() == in_shape_, ShapeError, "[ptrain.pipeline.shape] the micro-batch shape ",
                   first.shape(), " differs from ", in_shape_, " agreed on the first step; keep the batch size "
                   "fixed (drop a last partial batch) or call set_micro_batches() on every stage to agree again");
    } else {
      x = take_recv();
    }
    const double t0 = detail::steady_seconds();
    auto [it, fresh] = caches_.try_emplace(mb);
    PTRAIN_CHECK(fresh, Error, "[ptrain.pipeline.schedule] micro-batch ", mb, " ran forward twice");
    peak_live_ = std::max(peak_live_, static_cast<int>(caches_.size()));
    MicroBatch& state = it->second;
    // Every stage that was given the token ids puts its micro-batch's into the
    // context, for layers that read them (Note [Batch context] in nn/batch_context.hpp).
    if constexpr (std::is_same_v<In, std::int32_t>) {
      if (input.defined() && input.size(0) % m == 0) {
        const std::int64_t rows = input.size(0) / m;
        nn::detail::set_batch_ids(state.cache, input.narrow(mb * rows, rows));
      }
    }
    Tensor<T> y;
    if (!is_first()) y = module_.forward(x, state.cache);
    else if constexpr (std::is_same_v<In, std::int32_t>) y = module_.forward_tokens(first, state.cache);
    else y = module_.forward(first, state.cache);
    if (is_last()) {
      const std::int64_t rows = targets.size(0) / m;
      loss_sum_ += compute_loss(y, targets.narrow(mb * rows, rows), training_ ? &state.dout : nullptr);
    }
    if (!training_) caches_.erase(it);  // evaluation: nothing to keep for a backward
    record('F', mb, t0);
    if (is_last()) return {};
    if (agreeing_ && mb == 0) {
      out_shape_ = y.shape();
      send_shape(out_shape_);
    }
    PTRAIN_CHECK(y.shape() == out_shape_, ShapeError, "[ptrain.pipeline.shape] stage ", stage_,
                 " produced an activation of shape ", y.shape(), " but the shape agreed on the first step is ",
                 out_shape_, "; keep the batch size and sequence length fixed across steps");
    return y;
  }

  // The loss of one micro-batch and, with dout, the gradient of grad_scale * loss / m.
  double compute_loss(const Tensor<T>& y, const Targets<T>& t, Tensor<T>* dout) {
    return this->loss(y, t, dout, grad_scale_ / opt_.micro_batches);
  }

  // Runs micro-batch mb's backward; returns the input gradient for the previous stage (undefined on the first).
  Tensor<T> backward_one(int mb) {
    auto it = caches_.find(mb);
    PTRAIN_CHECK(it != caches_.end(), Error, "[ptrain.pipeline.schedule] backward of micro-batch ", mb,
                 " before its forward");
    Tensor<T> dy = is_last() ? it->second.dout : take_recv();
    const double t0 = detail::steady_seconds();
    Tensor<T> dx = module_.backward(dy, it->second.cache);
    caches_.erase(it);  // the activations of this micro-batch are no longer needed
    // The stage's gradients are final: average them over the replicas while
    // earlier stages still run their backwards.
    if (++backwards_done_ == opt_.micro_batches && this->syncing() && opt_.data_parallel &&
        opt_.data_parallel->size() > 1 && has_parameters())
      dp_work_ = opt_.data_parallel->all_reduce_async(flat_->grads(), dist::ReduceOp::Avg);
    record('B', mb, t0);
    if (is_first()) return {};
    PTRAIN_CHECK(dx.defined() && dx.shape() == in_shape_, ShapeError, "[ptrain.pipeline.shape] stage ", stage_,
                 " returned an input gradient of shape ", dx.defined() ? dx.shape().str() : std::string("(none)"),
                 " for an input of shape ", in_shape_, "; every unit after the first must return dx");
    return dx;
  }

  // Frees the buffers of finished sends; with `all`, waits for every one (end of step).
  void reap_sends(bool all) {
    doing_ = "completing sends to the neighbouring stages";
    if (all) {
      for (auto& s : sends_) s.work->wait();
      sends_.clear();
      for (auto& w : sends_int_) w->wait();
      sends_int_.clear();
      shape_msgs_.clear();
      return;
    }
    // Completions arrive in posting order, so only a prefix can be done.
    std::size_t done = 0;
    while (done < sends_.size() && sends_[done].work->is_completed()) ++done;
    if (done) sends_.erase(sends_.begin(), sends_.begin() + static_cast<std::ptrdiff_t>(done));
  }

  // After a failure: drop every micro-batch. Send buffers stay alive (the
  // failed communicator may still hold them) until the pipeline is destroyed.
  void abandon() {
    caches_.clear();
    abandoned_.insert(abandoned_.end(), sends_.begin(), sends_.end());
    if (incoming_work_) abandoned_.push_back({std::exchange(incoming_work_, nullptr), std::exchange(incoming_, {})});
    sends_.clear();
    sends_int_.clear();
    dp_work_.reset();
  }

  dist::Communicator& comm_;
  dist::Communicator* world_ = nullptr;  // the dp x pp mesh's world, when built on one
  StagePartition part_;
  PipelineOptions<T> opt_;
  int stage_ = 0;
  detail::StageModule<T> module_;
  std::unique_ptr<nn::FlatParameters<T>> flat_;
  std::map<int, MicroBatch> caches_;
  Device device_ = Device::cpu();  // of the parameters, where activations are received
  int peak_live_ = 0, backwards_done_ = 0;
  double loss_sum_ = 0;
  double grad_scale_ = 1.0;  // of the forward_backward() in progress
  bool shapes_agreed_ = false, agreeing_ = false, training_ = true;
  Shape in_shape_, out_shape_;
  Tensor<T> incoming_;  // the next action's input, being received
  std::shared_ptr<dist::Work> incoming_work_;
  PipelineAction incoming_action_{};
  std::vector<Pending> sends_, abandoned_;
  std::vector<std::shared_ptr<dist::Work>> sends_int_;
  std::deque<std::array<std::int64_t, detail::kMaxShapeDims + 1>> shape_msgs_;
  std::shared_ptr<dist::Work> dp_work_;
  std::vector<PipelineEvent> events_;
  double step_start_ = 0;
  // The communication in progress, for error messages (doing(); a literal, so nothing is allocated per action).
  const char* doing_ = "";
  static constexpr const char* kReceiving = "receiving";
};

}  // namespace ptrain::parallel
