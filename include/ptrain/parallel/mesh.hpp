#pragma once
// A mesh of dp x pp (x cp) (x tp) ranks for data, pipeline, context and tensor
// parallelism together: dp replicas of the model, each a pipeline of pp stages,
// each stage's sequence split over cp ranks (parallel/context_parallel.hpp), each
// of those split over tp ranks. Communicators come out of world.split():
//
//   world rank r = ((replica * pp + stage) * cp + c) * tp + t
//                  (tp innermost: a stage's tensor-parallel ranks are consecutive,
//                   so with ranks packed per node its per-layer all-reduces stay
//                   inside a node; then the context-parallel ranks of the stage,
//                   whose ring passes keys and values each layer; then a replica's
//                   stages, then the replicas)
//   tensor_group():   the tp ranks of my stage and context slice, ordered by t
//   context_group():  the cp ranks of my stage with my t, ordered by c (cp > 1)
//   pipeline_group(): the pp ranks of my replica with my c and t, ordered by stage
//   data_group():     the dp ranks that hold my stage, slice and shard, ordered by replica
//   data_context_group(): the dp x cp ranks of my stage with my t, which hold the same
//                     weights (ordered by replica, then c; the data group when cp = 1)
//
//   parallel::Mesh mesh(world, /*dp=*/2, /*pp=*/2);
//   parallel::Pipeline<float> pipe(mesh.pipeline_group(), n_units, make_unit, part,
//                                  {.micro_batches = 4, .data_parallel = &mesh.data_group()});
//   mesh.broadcast_parameters(pipe.parameters());     // replica 0's values everywhere
//   pipe.train_step(my_shard_x, my_shard_y);           // grads averaged over replicas
//   opt.step();
//
// Each replica trains on its own 1/dp of the global batch; the pipeline averages
// each stage's gradients over data_group() after that stage's last backward
// (Note [Loss scaling] in pipeline.hpp), so the update equals one process on
// the global batch. With cp = 1 (every mode but context parallelism) the layout and
// the three groups are those of a dp x pp x tp mesh, and no context group is made.

#include <memory>

#include "ptrain/dist/communicator.hpp"
#include "ptrain/nn/flat_parameters.hpp"

namespace ptrain::parallel {

/// The sizes of a mesh's dimensions.
struct MeshShape {
  int dp = 1, tp = 1, pp = 1;
  /// Context-parallel ranks per stage (parallel/context_parallel.hpp).
  int cp = 1;
};

class Mesh {
 public:
  /// dp x pp: collective over `world` (size must be dp * pp); `world` must outlive the mesh.
  Mesh(dist::Communicator& world, int dp, int pp) : Mesh(world, MeshShape{.dp = dp, .tp = 1, .pp = pp}) {}
  /// dp x pp x cp x tp: collective over `world` (size must be dp * pp * cp * tp); `world` must outlive the mesh.
  Mesh(dist::Communicator& world, MeshShape shape)
      : world_(world), dp_(shape.dp), pp_(shape.pp), tp_(shape.tp), cp_(shape.cp) {
    PTRAIN_CHECK(dp_ >= 1 && pp_ >= 1 && tp_ >= 1 && cp_ >= 1 && dp_ * pp_ * cp_ * tp_ == world.size(), Error,
                 "[ptrain.mesh.size] a ", dp_, " (dp) x ", cp_, " (cp) x ", tp_, " (tp) x ", pp_, " (pp) mesh needs ",
                 dp_ * cp_ * tp_ * pp_, " ranks but the world has ", world.size(),
                 "; launch dp * cp * tp * pp processes or change the mesh");
    t_ = world.rank() % tp_;
    c_ = world.rank() / tp_ % cp_;
    stage_ = world.rank() / (tp_ * cp_) % pp_;
    replica_ = world.rank() / (tp_ * cp_ * pp_);
    // The splits are collective over the world, in this order on every rank.
    pipeline_ = world.split((replica_ * cp_ + c_) * tp_ + t_, stage_);
    data_ = world.split((stage_ * cp_ + c_) * tp_ + t_, replica_);
    tensor_ = world.split((replica_ * pp_ + stage_) * cp_ + c_, t_);
    if (cp_ > 1) context_ = world.split((replica_ * pp_ + stage_) * tp_ + t_, c_);
    if (cp_ > 1) data_context_ = world.split(stage_ * tp_ + t_, replica_ * cp_ + c_);
    PTRAIN_CHECK(pipeline_ && data_ && pipeline_->rank() == stage_ && data_->rank() == replica_ &&
                 tensor_ && tensor_->rank() == t_ &&
                     (cp_ == 1 || (context_ && context_->rank() == c_ && data_context_ &&
                                   data_context_->rank() == replica_ * cp_ + c_)),
                 CommError,
                 "[ptrain.mesh.split] the communicator split gave unexpected groups on world rank ", world.rank());
  }
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  int dp_size() const { return dp_; }
  int pp_size() const { return pp_; }
  int tp_size() const { return tp_; }
  int cp_size() const { return cp_; }
  /// This rank's index in its context-parallel group (its slice of the sequence).
  int cp_rank() const { return c_; }
  /// This rank's index in its tensor-parallel group.
  int tp_rank() const { return t_; }
  /// Which replica (data-parallel index) this rank belongs to.
  int replica() const { return replica_; }
  /// Which pipeline stage this rank runs.
  int stage() const { return stage_; }
  /// World rank of (replica, stage, tensor-parallel index, context-parallel index).
  int world_rank(int replica, int stage, int t = 0, int c = 0) const {
    return ((replica * pp_ + stage) * cp_ + c) * tp_ + t;
  }

  dist::Communicator& world() { return world_; }
  /// The stages of this replica (with this rank's tensor-parallel index); rank = stage.
  dist::Communicator& pipeline_group() { return *pipeline_; }
  /// The tensor-parallel ranks of this stage; rank = t (a group of one when tp = 1).
  dist::Communicator& tensor_group() { return *tensor_; }
  /// The replicas of this stage; rank = replica.
  dist::Communicator& data_group() { return *data_; }
  /// The ranks that share this rank's sequences (rank = c), or null when cp = 1.
  dist::Communicator* context_group() { return context_.get(); }
  /// The dp x cp ranks of this stage with this rank's t: they hold the same weights (rank =
  /// replica * cp + c); the data group when cp = 1.
  dist::Communicator& data_context_group() { return data_context_ ? *data_context_ : *data_; }

  /// Copies replica 0's parameter values, trainable and frozen, to the other replicas of this stage.
  template <class T>
  void broadcast_parameters(nn::FlatParameters<T>& params) {
    if (dp_ == 1) return;
    if (params.values().numel() > 0) data_->broadcast(params.values(), 0);
    if (params.frozen_values().numel() > 0) data_->broadcast(params.frozen_values(), 0);
  }
  /// Averages gradients over the replicas of this stage (what Pipeline does itself with data_parallel set).
  template <class T>
  void all_reduce_gradients(nn::FlatParameters<T>& params) {
    if (dp_ > 1) data_->all_reduce(params.grads(), dist::ReduceOp::Avg);
  }

 private:
  dist::Communicator& world_;
  int dp_, pp_, tp_, cp_, replica_ = 0, stage_ = 0, t_ = 0, c_ = 0;
  std::unique_ptr<dist::Communicator> pipeline_, data_, tensor_, context_, data_context_;
};

}  // namespace ptrain::parallel
