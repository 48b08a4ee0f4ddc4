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
// With virtual stages the model is cut into p * v chunks, v per rank, taken in
// turn round the ring (Megatron-LM's interleaved 1F1B, Note [Schedules] in
// parallel/pipeline_schedule.hpp):
//
//   auto part = parallel::partition_balanced(unit_costs, comm.size() * 2);
//   parallel::Pipeline<float> pipe(comm, num_units, make_unit, part,
//                                  {.schedule = parallel::Schedule::Interleaved, .micro_batches = 8,
//                                   .virtual_stages = 2});   // m a multiple of p
//
// An Engine (parallel/engine.hpp). Language models pass int32 token ids as the
// first stage's input (the only form for bf16, Note [bf16 kernels]).
//
// Each rank calls the factory only for its own units, so a stage never holds
// the rest of the model.
//
// The partitions and schedules (StagePartition, partition_balanced, Schedule,
// make_schedule) live in parallel/pipeline_schedule.hpp, which this header
// includes; this header runs them over a communicator.
//
// Note [Communication order]
// Messages carry tag 0 and pair by order (Note [Point-to-point order] in
// dist/communicator.hpp), as NCCL requires. A stage runs its schedule in
// steps (Note [Action order] in parallel/pipeline_schedule.hpp, which also
// says why both ends of a link see the transfers in one order). After each
// step a stage posts, in one group, the sends of the step's results and the
// recvs of the next step's inputs (the first step's before it starts), and
// waits for each recv just before the compute that needs it. Recvs are thus posted in the order they are waited
// for, which the Gloo backend needs (it reports p2p completions in posting
// order: waiting on a recv posted after an unfinished one could depend on a
// sender that is itself waiting for us). Sends are waited for only at the end
// of the step; their tensors stay alive in a pending list until then.
//
// Deadlock freedom under NCCL, where a send may wait for its recv and a rank's
// transfers run in order on one stream, needs every group to be matched by
// groups its neighbours can post without waiting for it. 1F1B: stage s sends
// activation i and then needs gradient j from s + 1, while s + 1 sends
// gradient j and then needs activation i (Megatron-LM's
// send_forward_recv_backward); one action per step, the group holds the send
// of its result and the recv of the next action's input. Interleaved: with one
// action per step, a stage that just ran a backward would send its gradient
// alone (its next forward reads a chunk-0 batch, no recv) while the peer sends
// the next gradient before receiving that one, and both sends wait: a
// deadlock. Megatron-LM's interleaved schedule therefore exchanges once per
// forward-backward pair (send_forward_backward_recv_forward_backward): the
// results of both and the inputs of the next pair travel in one group.
// Number a stage's groups j = 0, 1, ... (group j before step j, empty ones
// counted) and give group j of stage s the tick j + s: for m > p every
// transfer, the wrap-around included, joins two groups of the same tick (the
// warm-up of stage s is two actions, one step, longer than that of s + 1). A
// group waits only for groups of its own tick, and each tick's groups are the
// next ones posted on their ranks once the earlier ticks are done: no cycle of
// waits. Within a group forward transfers come before backward ones on both
// sides, which keeps the order of a p = 2 link carrying both. With m = p the
// warm-up cap m·v makes some stages run all forwards first and the ticks no
// longer line up exactly. A test ("interleaved transfers" in
// tests/dist/pipeline/test_pipeline.cpp) replays every stage's groups under
// these rules for p = 2..6, v = 1..4 and m up to 4p, shape messages included,
// and finds every transfer paired and no deadlock; the pipelines also train
// under NCCL's rules on the CPU (nccl_model.hpp). Eval runs only forwards,
// one per step, in the same order.
// MPI and Gloo start each transfer at once, so the groups are no-ops there.

// Note [Shapes]
// Shapes are agreed once, on the first train_step (or eval_loss): before the
// first activation of each chunk, a stage sends that chunk's output shape
// (rank and dimensions as I64, a host buffer, outside any group) to the next
// stage; gradients flowing back have the shape of the activation they belong
// to. The receiver posts the shape's recv where the activation's would go,
// ends the group there, waits for it (it sizes the activation's buffer) and
// opens a new group for the activation and the rest of the step's inputs, so
// the order on each link stays the sender's. Later steps must use the same
// micro-batch shape; a stage that sees another one throws ShapeError (its
// neighbours then fail with a CommError when it stops, or after the timeout).
//
// Note [Loss scaling]
// Each micro-batch's loss is the mean over its rows (CrossEntropyLoss); its
// gradient is scaled by 1/m, so the accumulated gradient is the gradient of
// the mean over micro-batches, which equals the full-batch mean when every
// micro-batch counts the same number of targets (no ignore_index rows). The
// returned loss is the mean of the micro-batch losses. The auxiliary losses of
// the stage's MoE layers (load balancing, z-loss) are scaled alike
// (MoE::set_aux_loss_scale(grad_scale / m)), so a batch adds the mean of its
// micro-batches' auxiliary losses, as Megatron-Core does, whatever m.
//
// Note [Pipeline expert parallelism]
// With options.expert_parallel = ep > 1 (Megatron-Core's PP x EP) the replicas of a
// stage (options.data_parallel, dp ranks) play the part DDP's world plays in Note
// [Expert-parallel layout] (parallel/expert_parallel.hpp): an ExpertMesh over the dp
// group (replica r is expert-parallel index r % ep of expert-data copy r / ep), each
// MoE layer of the stage keeps E / ep experts (shard_experts) and sends its tokens to
// the experts' ranks by all-to-all inside the dp group, in every micro-batch's forward
// and backward. The replicas of a stage run the same schedule, so they issue these
// collectives in one order. After the stage's last backward the dense gradients are
// averaged over the dp group, the experts' over the dp / ep replicas that hold the
// same experts and divided by ep (one contiguous run of the flat buffer at a time);
// clip_grad_norm_() sums the experts' squares over the expert-parallel group and the
// dense ones once, then over the stages. The step equals one process on the global
// batch that takes the dp x m micro-batches one at a time (each MoE layer's auxiliary
// losses are those of its micro-batch, scaled by 1/m as in Note [Loss scaling]). Refused: ep not
// dividing dp or a layer's E, no data_parallel group, virtual stages (untested with the
// all-to-alls between the chunks' transfers), a capacity factor (its rule would span
// the replicas' micro-batch of one index: not built), and a pipeline without any MoE
// layer. Checkpoints: ckpt/stage_checkpoint.hpp.

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
#include "ptrain/parallel/expert_parallel.hpp"
#include "ptrain/parallel/mesh.hpp"
#include "ptrain/parallel/pipeline_schedule.hpp"

namespace ptrain::parallel {

template <class T>
struct PipelineOptions {
  Schedule schedule = Schedule::OneFOneB;
  int micro_batches = 1;  ///< m; the batch's first dimension must be divisible by it
  /// v, with Schedule::Interleaved: the model is cut into p * v chunks (the partition's "stages") and
  /// stage s holds chunks s, s + p, ..., s + (v - 1)p; m must be a multiple of p. 1: one chunk per stage.
  int virtual_stages = 1;
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
  /// ep: split the experts of the stage's nn::MoE layers over groups of ep replicas of the stage
  /// (Note [Pipeline expert parallelism]); needs data_parallel, ep must divide its size. 1: every
  /// replica holds all experts.
  int expert_parallel = 1;
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

  /// Collective over `comm` (size * options.virtual_stages == partition.num_stages()).
  /// `comm` (and options.data_parallel) must outlive the pipeline.
  Pipeline(dist::Communicator& comm, std::size_t num_units, const UnitFactory& factory, StagePartition partition,
           PipelineOptions<T> options = {})
      : comm_(comm), part_(std::move(partition)), opt_(std::move(options)) {
    PTRAIN_CHECK(part_.num_units() == num_units, Error, "[ptrain.pipeline.partition] the partition covers ",
                 part_.num_units(), " units but the model has ", num_units);
    PTRAIN_CHECK(opt_.unit_names.empty() || opt_.unit_names.size() == num_units, Error,
                 "[ptrain.pipeline.names] ", opt_.unit_names.size(), " unit names for ", num_units, " units");
    const int p = comm_.size(), v = opt_.virtual_stages;
    detail::check_schedule(opt_.schedule, p, opt_.micro_batches, v);
    PTRAIN_CHECK(part_.num_stages() == p * v, Error, "[ptrain.pipeline.stages] the partition has ",
                 part_.num_stages(), " stages but the pipeline group has ", p, " ranks",
                 v > 1 ? detail::cat(" x ", v, " virtual stages = ", p * v, " chunks") : std::string(),
                 "; cut the model into exactly one ", v > 1 ? "chunk per rank and virtual stage" : "stage per rank",
                 " of the group (partition_balanced(costs, ", v > 1 ? "p * v" : "p", "))");
    stage_ = comm_.rank();
    // Note [Schedules] in parallel/pipeline_schedule.hpp: chunk c of this stage is the model's chunk c * p + stage.
    for (int c = 0; c < v; ++c) {
      auto& chunk = *chunks_.emplace_back(std::make_unique<detail::StageModule<T>>());
      for (std::size_t u = part_.begin(c * p + stage_); u < part_.end(c * p + stage_); ++u) {
        auto unit = factory(u);
        PTRAIN_CHECK(unit != nullptr, Error, "[ptrain.pipeline.factory] the unit factory returned null for unit ", u);
        const std::string name = opt_.unit_names.empty() ? std::to_string(u) : opt_.unit_names[u];
        chunk.add(name, unit);
        module_.add(name, std::move(unit));
      }
    }
    in_shape_.resize(static_cast<std::size_t>(v));
    out_shape_.resize(static_cast<std::size_t>(v));
    reject_borrowed_across_stages();
    if (opt_.expert_parallel != 1) shard_experts_over_replicas();
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
    if (experts_) mark_experts();
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

  /// The expert-parallel groups over the stage's replicas (options.expert_parallel > 1), or null.
  ExpertMesh* expert_mesh() { return experts_.get(); }
  const ExpertMesh* expert_mesh() const { return experts_.get(); }
  /// Whether entry i of parameters() is an expert's (distinct on each expert-parallel rank).
  bool is_expert(std::size_t i) const { return !expert_.empty() && expert_.at(i); }
  /// The same for entry i of parameters().frozen_entries().
  bool is_frozen_expert(std::size_t i) const { return !frozen_expert_.empty() && frozen_expert_.at(i); }
  /// Replica 0's values on every replica of the stage (collective over options.data_parallel);
  /// with expert parallelism each expert from the first replica that holds it. What
  /// make_engine does after building the pipeline; call it when building one by hand.
  void broadcast_parameters() {
    dist::Communicator* dp = opt_.data_parallel;
    if (!dp || dp->size() == 1) return;
    if (!experts_) {
      if (flat_->values().numel() > 0) dp->broadcast(flat_->values(), 0);
      if (flat_->frozen_values().numel() > 0) dp->broadcast(flat_->frozen_values(), 0);
      return;
    }
    for_each_run([&](Tensor<T> values, Tensor<T>, bool expert) { group_of(expert).broadcast(values, 0); });
    const auto& frozen = flat_->frozen_entries();
    for (std::size_t i = 0; i < frozen.size(); ++i) group_of(is_frozen_expert(i)).broadcast(frozen[i].param->value, 0);
  }

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
  /// Ranks of the pipeline (p).
  int num_stages() const { return comm_.size(); }
  /// Chunks per stage (v; Schedule::Interleaved).
  int virtual_stages() const { return opt_.virtual_stages; }
  bool is_first() const { return stage_ == 0; }
  bool is_last() const { return stage_ == num_stages() - 1; }
  /// The model's p * v chunks (p stages without virtual stages).
  const StagePartition& partition() const { return part_; }
  /// The units `stage` holds, in increasing order: those of its chunks stage, stage + p, ...
  std::vector<std::size_t> units_of(int stage) const {
    std::vector<std::size_t> units;
    for (int k = stage; k < part_.num_stages(); k += num_stages())
      for (std::size_t u = part_.begin(k); u < part_.end(k); ++u) units.push_back(u);
    return units;
  }
  const PipelineOptions<T>& options() const { return opt_; }
  /// Changes the number of micro-batches for later steps (shapes are re-agreed).
  void set_micro_batches(int m) {
    detail::check_schedule(opt_.schedule, num_stages(), m, opt_.virtual_stages);
    opt_.micro_batches = m;
    shapes_agreed_ = false;
  }
  /// Another schedule for later steps; with virtual stages only Interleaved.
  void set_schedule(Schedule s) {
    detail::check_schedule(s, num_stages(), opt_.micro_batches, opt_.virtual_stages);
    opt_.schedule = s;
  }

  /// This stage's units (of all its chunks) in one module; parameter names are "<unit name>.<param>".
  nn::Module<T>& module() { return module_; }
  /// Whether this stage holds parameters, trainable or frozen (Note [Frozen parameters] in
  /// nn/flat_parameters.hpp: a stage of frozen units has parameters but no gradients).
  bool has_parameters() const override { return !flat_->entries().empty() || !flat_->frozen_entries().empty(); }
  /// The stage's parameters in flat buffers (for the optimizer); empty buffers on a stage without parameters.
  nn::FlatParameters<T>& parameters() override { return *flat_; }

  /// Forward/backward events of the last train_step (or eval_step), in execution order.
  const std::vector<PipelineEvent>& timeline() const { return events_; }
  /// Steady-clock time at which the last train_step started on this stage.
  double step_start() const { return step_start_; }
  /// Most micro-batch caches (one per chunk and micro-batch) alive at once in the last train_step
  /// (Note [Schedules] in parallel/pipeline_schedule.hpp).
  int peak_live_caches() const { return peak_live_; }
  /// Micro-batch caches alive now (0 between steps: each is freed when its backward ran).
  int live_caches() const { return static_cast<int>(caches_.size()); }

 private:
  // What one micro-batch keeps between a chunk's forward and its backward.
  struct MicroBatch {
    nn::Cache<T> cache;       // the chunk's activations
    Tensor<T> dout;           // the model's last chunk: gradient of the scaled loss
  };
  struct Pending {  // a transfer in flight and the buffer it reads or writes
    std::shared_ptr<dist::Work> work;
    Tensor<T> keep;  // the buffer must outlive the transfer
  };
  struct Incoming {  // the input of a later action, being received
    PipelineAction action;
    Tensor<T> buffer;
    std::shared_ptr<dist::Work> work;
  };
  using Results = std::vector<std::pair<PipelineAction, Tensor<T>>>;  // a step's outputs for the neighbours

  static PipelineOptions<T> with_data_group(PipelineOptions<T> o, Mesh& mesh) {
    o.data_parallel = &mesh.data_group();
    return o;
  }

  double run(const BatchInput<T>& in, const Targets<T>& targets, double grad_scale,
             bool training) override {
    grad_scale_ = grad_scale;
    return in.ids ? run_step(*in.ids, targets, training, false) : run_step(*in.x, targets, training, false);
  }
  // The stages hold distinct parameters: their squared norms add up. With expert parallelism
  // (Note [Pipeline expert parallelism]) the experts' squares are first summed over the
  // expert-parallel group (each expert once), the dense ones counted once, as DDP does.
  double sum_over_model(double sq) override {
    if (experts_) {
      double mine = 0;
      for_each_run([&](Tensor<T>, Tensor<T> grads, bool expert) {
        if (expert) mine += ops::sum_squares(grads);
      });
      double all = mine;
      experts_->expert_group().all_reduce(&all, 1, DType::F64, dist::ReduceOp::Sum);
      sq += all - mine;
    }
    if (comm_.size() > 1) comm_.all_reduce(&sq, 1, DType::F64, dist::ReduceOp::Sum);
    return sq;
  }

  template <class In>
  double run_step(const Tensor<In>& input, const Targets<T>& targets, bool training, bool zero) {
    const int m = opt_.micro_batches, p = num_stages(), v = opt_.virtual_stages;
    if (is_first()) check_batch(input, "input");
    if (is_last()) check_batch(targets, "targets");
    if (training && zero) zero_grad();
    training_ = training;
    for (nn::MoE<T>* moe : moe_layers<T>(module_)) moe->set_aux_loss_scale(grad_scale_ / m);  // Note [Loss scaling]
    events_.clear();
    caches_.clear();
    peak_live_ = backwards_done_ = 0;
    loss_sum_ = 0;
    agreeing_ = !shapes_agreed_;
    step_start_ = detail::steady_seconds();
    try {
      std::vector<PipelineAction> plan;
      if (training) plan = make_schedule(opt_.schedule, stage_, p, m, v);
      else for (int k = 0; k < m * v; ++k) plan.push_back(detail::nth_action(PipelineAction::Forward, k, p, v));
      // Note [Communication order]: after each step, its results go out in one group with the next step's inputs.
      Results results;
      exchange(results, plan, 0);
      for (std::size_t k = 0; k < plan.size(); ++k) {
        const PipelineAction& a = plan[k];
        Tensor<T> out = a.kind == PipelineAction::Forward ? forward_one(a, input, targets) : backward_one(a);
        if (out.defined()) results.emplace_back(a, std::move(out));
        if (a.with_next) continue;
        exchange(results, plan, k + 1);
        reap_sends(false);
      }
      reap_sends(true);
      shapes_agreed_ = true;
      if (syncing_grads_) {
        doing_ = "averaging gradients over the data-parallel group";
        for (auto& w : dp_work_) w->wait();
        dp_work_.clear();
        syncing_grads_ = false;
        if (experts_)  // Note [Pipeline expert parallelism]: the experts' average over their copies, / ep
          for_each_run([&](Tensor<T>, Tensor<T> grads, bool expert) {
            if (expert) ops::scale_(grads, static_cast<acc_t<T>>(1.0 / experts_->ep_size()));
          });
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

  void record(const PipelineAction& a, double t0) {
    const char kind = static_cast<char>(a.kind);
    events_.push_back({stage_, a.micro_batch, kind, t0, detail::steady_seconds(), a.chunk});
    if (obs::tracing())  // the same clock: trace_now_us() is steady_seconds() in microseconds
      obs::Tracer::get().complete(kind == 'F' ? "pipeline.forward" : "pipeline.backward", "pipeline", t0 * 1e6,
                                  events_.back().end * 1e6, a.micro_batch);
  }

  // The ring of stages (Note [Schedules] in parallel/pipeline_schedule.hpp): activations go to the next
  // stage, gradients to the previous one.
  int next_stage() const { return (stage_ + 1) % num_stages(); }
  int prev_stage() const { return (stage_ + num_stages() - 1) % num_stages(); }
  // Whether this stage's chunk c is the model's first (reads the input) or last (computes the loss).
  bool holds_input(int c) const { return is_first() && c == 0; }
  bool holds_loss(int c) const { return is_last() && c == opt_.virtual_stages - 1; }
  // The stage an action takes its input from, or -1 (the input batch, the loss).
  int source_of(const PipelineAction& a) const {
    if (a.kind == PipelineAction::Forward) return holds_input(a.chunk) ? -1 : prev_stage();
    return holds_loss(a.chunk) ? -1 : next_stage();
  }
  // The stage an action's result goes to, or -1.
  int dest_of(const PipelineAction& a) const {
    if (a.kind == PipelineAction::Forward) return holds_loss(a.chunk) ? -1 : next_stage();
    return holds_input(a.chunk) ? -1 : prev_stage();
  }
  // Note [Shapes]: a chunk's first activation is preceded by its shape in the first step.
  bool carries_shape(const PipelineAction& a) const {
    return agreeing_ && a.kind == PipelineAction::Forward && a.micro_batch == 0;
  }

  // Note [Communication order]: in one group, the sends of a step's results and
  // the recvs of the inputs of the step that starts at plan[next].
  void exchange(Results& results, const std::vector<PipelineAction>& plan, std::size_t next) {
    std::vector<PipelineAction> inputs;
    for (std::size_t k = next; k < plan.size(); ++k) {
      if (source_of(plan[k]) >= 0) inputs.push_back(plan[k]);
      if (!plan[k].with_next) break;
    }
    if (results.empty() && inputs.empty()) return;
    doing_ = "posting the transfers to the neighbouring stages";
    dist::CollectiveLabel label("pipeline.activation");
    std::optional<detail::P2PGroup> group(std::in_place, comm_);
    for (auto& [a, out] : results)
      sends_.push_back(
          {comm_.send_async(out.data(), static_cast<std::size_t>(out.numel()), dtype_of<T>(), dest_of(a)), out});
    results.clear();
    for (const PipelineAction& a : inputs) {
      if (carries_shape(a)) {  // it sizes the activation's buffer: end the group and wait for it
        shape_in_.fill(0);
        auto work = comm_.recv_async(shape_in_.data(), shape_in_.size(), DType::I64, source_of(a));
        group->end();
        doing_ = "receiving an activation shape from the previous stage";
        work->wait();
        const std::int64_t dims = shape_in_[0];
        PTRAIN_CHECK(dims >= 1 && dims <= detail::kMaxShapeDims, CommError, "[ptrain.pipeline.shape] stage ",
                     stage_, " got a corrupt shape message from stage ", source_of(a));
        in_shape_[static_cast<std::size_t>(a.chunk)] =
            Shape(std::vector<std::int64_t>(shape_in_.begin() + 1, shape_in_.begin() + 1 + dims));
        group.emplace(comm_);
      }
      post_recv(a);
    }
    group->end();
  }

  // Note [Shapes]: sends the shape of chunk c's output once, before its first activation.
  void send_shape(const Shape& s) {
    PTRAIN_CHECK(s.size() <= detail::kMaxShapeDims, ShapeError, "[ptrain.pipeline.shape] activations of rank ",
                 s.size(), " exceed ", detail::kMaxShapeDims, " dimensions");
    auto& msg = shape_msgs_.emplace_back();
    msg.fill(0);
    msg[0] = s.size();
    for (int i = 0; i < s.size(); ++i) msg[static_cast<std::size_t>(i) + 1] = s[i];
    sends_int_.push_back(comm_.send_async(msg.data(), msg.size(), DType::I64, next_stage()));
  }

  // Posts the recv of action a's input (inside exchange()'s group).
  void post_recv(const PipelineAction& a) {
    const auto c = static_cast<std::size_t>(a.chunk);
    Incoming& in = incoming_.emplace_back();
    in.action = a;
    in.buffer = Tensor<T>::empty(a.kind == PipelineAction::Forward ? in_shape_[c] : out_shape_[c], device_);
    in.work = comm_.recv_async(in.buffer.data(), static_cast<std::size_t>(in.buffer.numel()), dtype_of<T>(),
                               source_of(a));
  }
  // doing_ in words; a receive names what it waits for.
  std::string doing() const {
    if (doing_ != kReceiving || incoming_.empty()) return doing_;
    const PipelineAction& a = incoming_.front().action;
    const bool fwd = a.kind == PipelineAction::Forward;
    return detail::cat("receiving ", fwd ? "the activation" : "the gradient", " of micro-batch ", a.micro_batch,
                       opt_.virtual_stages > 1 ? detail::cat(" (chunk ", a.chunk, ")") : std::string(),
                       " from stage ", source_of(a));
  }
  // Waits for the input of action a, the oldest recv posted; returns its tensor.
  Tensor<T> take_recv(const PipelineAction& a) {
    PTRAIN_CHECK(!incoming_.empty() && incoming_.front().action == a, Error, "[ptrain.pipeline.schedule] the "
                 "input of micro-batch ", a.micro_batch, " was not posted before its ",
                 a.kind == PipelineAction::Forward ? "forward" : "backward", " (a schedule without its exchange)");
    doing_ = kReceiving;
    incoming_.front().work->wait();
    Tensor<T> x = std::move(incoming_.front().buffer);
    incoming_.pop_front();
    return x;
  }

  // Runs the forward of action a; returns the activation for the next stage (undefined for the model's last chunk).
  template <class In>
  Tensor<T> forward_one(const PipelineAction& a, const Tensor<In>& input, const Targets<T>& targets) {
    const int m = opt_.micro_batches, mb = a.micro_batch;
    const auto c = static_cast<std::size_t>(a.chunk);
    Tensor<In> first;  // the first chunk's micro-batch
    Tensor<T> x;       // a later chunk's activation from the previous stage
    if (holds_input(a.chunk)) {
      const std::int64_t rows = input.size(0) / m;
      first = input.narrow(mb * rows, rows);
      if (agreeing_ && mb == 0) in_shape_[0] = first.shape();
      PTRAIN_CHECK(first.shape() == in_shape_[0], ShapeError, "[ptrain.pipeline.shape] the micro-batch shape ",
                   first.shape(), " differs from ", in_shape_[0], " agreed on the first step; keep the batch size "
                   "fixed (drop a last partial batch) or call set_micro_batches() on every stage to agree again");
    } else {
      x = take_recv(a);
    }
    const double t0 = detail::steady_seconds();
    auto [it, fresh] = caches_.try_emplace({a.chunk, mb});
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
    detail::StageModule<T>& chunk = *chunks_[c];
    Tensor<T> y;
    if (!holds_input(a.chunk)) y = chunk.forward(x, state.cache);
    else if constexpr (std::is_same_v<In, std::int32_t>) y = chunk.forward_tokens(first, state.cache);
    else y = chunk.forward(first, state.cache);
    if (holds_loss(a.chunk)) {
      const std::int64_t rows = targets.size(0) / m;
      loss_sum_ += compute_loss(y, targets.narrow(mb * rows, rows), training_ ? &state.dout : nullptr);
    }
    if (!training_) caches_.erase(it);  // evaluation: nothing to keep for a backward
    record(a, t0);
    if (holds_loss(a.chunk)) return {};
    if (carries_shape(a)) {
      out_shape_[c] = y.shape();
      send_shape(out_shape_[c]);
    }
    PTRAIN_CHECK(y.shape() == out_shape_[c], ShapeError, "[ptrain.pipeline.shape] stage ", stage_,
                 " produced an activation of shape ", y.shape(), " but the shape agreed on the first step is ",
                 out_shape_[c], "; keep the batch size and sequence length fixed across steps");
    return y;
  }

  // The loss of one micro-batch and, with dout, the gradient of grad_scale * loss / m.
  double compute_loss(const Tensor<T>& y, const Targets<T>& t, Tensor<T>* dout) {
    return this->loss(y, t, dout, grad_scale_ / opt_.micro_batches);
  }

  // Runs the backward of action a; returns the input gradient for the previous stage (undefined for chunk 0 of the model).
  Tensor<T> backward_one(const PipelineAction& a) {
    auto it = caches_.find({a.chunk, a.micro_batch});
    PTRAIN_CHECK(it != caches_.end(), Error, "[ptrain.pipeline.schedule] backward of micro-batch ", a.micro_batch,
                 " before its forward");
    Tensor<T> dy = holds_loss(a.chunk) ? it->second.dout : take_recv(a);
    const double t0 = detail::steady_seconds();
    Tensor<T> dx = chunks_[static_cast<std::size_t>(a.chunk)]->backward(dy, it->second.cache);
    caches_.erase(it);  // the activations of this micro-batch are no longer needed
    // The stage's gradients are final: average them over the replicas while
    // earlier stages still run their backwards.
    if (++backwards_done_ == opt_.micro_batches * opt_.virtual_stages && this->syncing() && opt_.data_parallel &&
        opt_.data_parallel->size() > 1 && flat_->numel() > 0)  // trainable gradients only
      start_gradient_sync();
    record(a, t0);
    if (holds_input(a.chunk)) return {};
    const Shape& in = in_shape_[static_cast<std::size_t>(a.chunk)];
    PTRAIN_CHECK(dx.defined() && dx.shape() == in, ShapeError, "[ptrain.pipeline.shape] stage ", stage_,
                 " returned an input gradient of shape ", dx.defined() ? dx.shape().str() : std::string("(none)"),
                 " for an input of shape ", in, "; every unit after the first must return dx");
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

  // After a failure: drop every micro-batch. Buffers of transfers in flight stay
  // alive (the failed communicator may still hold them) until the pipeline is destroyed.
  void abandon() {
    caches_.clear();
    abandoned_.insert(abandoned_.end(), sends_.begin(), sends_.end());
    for (auto& in : incoming_) abandoned_.push_back({std::move(in.work), std::move(in.buffer)});
    incoming_.clear();
    sends_.clear();
    sends_int_.clear();
    dp_work_.clear();
    syncing_grads_ = false;
  }

  // Averages the stage's gradients over its replicas: the whole flat buffer over the dp
  // group, or with expert parallelism each run of dense (or expert) entries over the dp
  // group (or the expert-data group; its 1/ep follows when the step waits). Every
  // replica has the same runs, so each group sees its all-reduces in one order.
  void start_gradient_sync() {
    syncing_grads_ = true;
    if (!experts_) {
      dp_work_.push_back(opt_.data_parallel->all_reduce_async(flat_->grads(), dist::ReduceOp::Avg));
      return;
    }
    for_each_run([&](Tensor<T>, Tensor<T> grads, bool expert) {
      dist::Communicator& g = group_of(expert);
      if (g.size() == 1) return;
      dist::CollectiveLabel label(expert ? "pipeline.expert_grads" : "pipeline.grads");
      dp_work_.push_back(g.all_reduce_async(grads, dist::ReduceOp::Avg));
    });
  }
  dist::Communicator& group_of(bool expert) {
    return expert ? experts_->expert_data_group() : *opt_.data_parallel;
  }
  // Calls fn(values, grads, expert) for each run of consecutive trainable entries that are
  // all experts or all dense (the whole buffer as one dense run without expert parallelism).
  template <class Fn>
  void for_each_run(Fn&& fn) {
    const auto& entries = flat_->entries();
    for (std::size_t i = 0; i < entries.size();) {
      std::size_t j = i + 1;
      while (j < entries.size() && is_expert(j) == is_expert(i)) ++j;
      const std::int64_t begin = entries[i].offset, end = entries[j - 1].offset + entries[j - 1].numel();
      fn(flat_->values().narrow(begin, end - begin), flat_->grads().narrow(begin, end - begin), is_expert(i));
      i = j;
    }
  }

  // Note [Pipeline expert parallelism]: checks the options and keeps this replica's experts.
  void shard_experts_over_replicas() {
    const int ep = opt_.expert_parallel;
    dist::Communicator* dp = opt_.data_parallel;
    PTRAIN_CHECK(ep >= 1, Error, "[ptrain.ep.pipeline] expert_parallel = ", ep, " must be >= 1");
    PTRAIN_CHECK(dp != nullptr, Error, "[ptrain.ep.pipeline] expert_parallel = ", ep, " splits the experts over the "
                 "replicas of a stage, but the pipeline has no data_parallel group; build it on a dp x pp Mesh "
                 "(or make_engine's PipelinePlan on dp * pp ranks) with ep dividing dp");
    PTRAIN_CHECK(dp->size() % ep == 0, Error, "[ptrain.ep.pipeline] expert_parallel = ", ep, " does not divide the ",
                 dp->size(), " replicas of stage ", stage_, " (data_parallel); choose an ep that divides dp");
    PTRAIN_CHECK(opt_.virtual_stages == 1, Error, "[ptrain.ep.pipeline] expert_parallel = ", ep, " with ",
                 opt_.virtual_stages, " virtual stages is not supported (the experts' all-to-alls between the "
                 "chunks' transfers are not verified); use Schedule::OneFOneB or GPipe with virtual_stages = 1");
    // Counted over the stages, so that every rank refuses alike: MoE layers, layers whose
    // experts ep does not divide, layers with a capacity factor.
    std::int64_t counts[3] = {0, 0, 0};
    for (nn::MoE<T>* moe : moe_layers<T>(module_)) {
      ++counts[0];
      counts[1] += moe->config().num_experts % ep != 0;
      counts[2] += moe->config().capacity_factor > 0;
    }
    if (comm_.size() > 1) comm_.all_reduce(counts, 3, DType::I64, dist::ReduceOp::Sum);
    PTRAIN_CHECK(counts[0] > 0, Error, "[ptrain.ep.model] expert_parallel = ", ep, " but no stage of the pipeline "
                 "holds an nn::MoE layer; use expert_parallel = 1");
    PTRAIN_CHECK(counts[1] == 0, Error, "[ptrain.ep.experts] expert_parallel = ", ep, " does not divide the experts "
                 "of ", counts[1], " MoE layers of the pipeline; choose an ep degree that divides num_experts");
    PTRAIN_CHECK(counts[2] == 0, Error, "[ptrain.ep.pipeline] ", counts[2], " MoE layers of the pipeline have a "
                 "capacity factor; a pipeline with expert_parallel > 1 runs dropless MoE layers only "
                 "(capacity_factor = 0), or use DDPOptions{.expert_parallel}");
    experts_ = std::make_unique<ExpertMesh>(*dp, ep);  // collective over the dp group
    shard_experts(module_, *experts_);
  }
  // Which trainable and frozen entries of flat_ are this replica's experts.
  void mark_experts() {
    expert_ = expert_flags(module_, flat_->entries());
    frozen_expert_ = expert_flags(module_, flat_->frozen_entries());
  }

  dist::Communicator& comm_;
  dist::Communicator* world_ = nullptr;  // the dp x pp mesh's world, when built on one
  StagePartition part_;
  PipelineOptions<T> opt_;
  int stage_ = 0;
  detail::StageModule<T> module_;  // every unit of the stage (parameters, names, train())
  std::vector<std::unique_ptr<detail::StageModule<T>>> chunks_;  // the same units by chunk (forward, backward)
  std::unique_ptr<ExpertMesh> experts_;  // options.expert_parallel > 1
  std::vector<char> expert_, frozen_expert_;  // per trainable and frozen entry of flat_, with experts_
  std::unique_ptr<nn::FlatParameters<T>> flat_;
  std::map<std::pair<int, int>, MicroBatch> caches_;  // by (chunk, micro-batch)
  Device device_ = Device::cpu();  // of the parameters, where activations are received
  int peak_live_ = 0, backwards_done_ = 0;
  double loss_sum_ = 0;
  double grad_scale_ = 1.0;  // of the forward_backward() in progress
  bool shapes_agreed_ = false, agreeing_ = false, training_ = true;
  std::vector<Shape> in_shape_, out_shape_;  // by chunk
  std::deque<Incoming> incoming_;            // in posting order, which is the order of use
  std::vector<Pending> sends_, abandoned_;
  std::vector<std::shared_ptr<dist::Work>> sends_int_;
  std::deque<std::array<std::int64_t, detail::kMaxShapeDims + 1>> shape_msgs_;
  std::array<std::int64_t, detail::kMaxShapeDims + 1> shape_in_{};
  std::vector<std::shared_ptr<dist::Work>> dp_work_;
  bool syncing_grads_ = false;  // start_gradient_sync() ran in this step (the experts' 1/ep is still due)
  std::vector<PipelineEvent> events_;
  double step_start_ = 0;
  // The communication in progress, for error messages (doing(); a literal, so nothing is allocated per action).
  const char* doing_ = "";
  static constexpr const char* kReceiving = "receiving";
};

}  // namespace ptrain::parallel
