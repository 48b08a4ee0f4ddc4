#pragma once
// A 2-D mesh of dp x pp ranks for pipeline and data parallelism together: dp
// replicas of the model, each a pipeline of pp stages. Two communicators come
// out of world.split():
//
//   world rank r = replica * pp + stage       (a replica's stages are consecutive ranks,
//                                              so with ranks packed per node the
//                                              activation traffic stays inside a node)
//   pipeline_group(): the pp ranks of my replica, ordered by stage
//   data_group():     the dp ranks that hold my stage, ordered by replica
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
// the global batch.

#include <memory>

#include "ptrain/dist/communicator.hpp"
#include "ptrain/nn/flat_parameters.hpp"

namespace ptrain::parallel {

class Mesh {
 public:
  /// Collective over `world` (size must be dp * pp); `world` must outlive the mesh.
  Mesh(dist::Communicator& world, int dp, int pp) : world_(world), dp_(dp), pp_(pp) {
    PTRAIN_CHECK(dp >= 1 && pp >= 1 && dp * pp == world.size(), Error, "[ptrain.mesh.size] a ", dp, " x ", pp,
                 " mesh needs ", dp * pp, " ranks but the world has ", world.size(),
                 "; launch dp * pp processes or change the mesh");
    replica_ = world.rank() / pp;
    stage_ = world.rank() % pp;
    // Both splits are collective over the world, in this order on every rank.
    pipeline_ = world.split(replica_, stage_);
    data_ = world.split(stage_, replica_);
    PTRAIN_CHECK(pipeline_ && data_ && pipeline_->rank() == stage_ && data_->rank() == replica_, CommError,
                 "[ptrain.mesh.split] the communicator split gave unexpected groups on world rank ", world.rank());
  }
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  int dp_size() const { return dp_; }
  int pp_size() const { return pp_; }
  /// Which replica (data-parallel index) this rank belongs to.
  int replica() const { return replica_; }
  /// Which pipeline stage this rank runs.
  int stage() const { return stage_; }
  /// World rank of (replica, stage).
  int world_rank(int replica, int stage) const { return replica * pp_ + stage; }

  dist::Communicator& world() { return world_; }
  /// The stages of this replica; rank = stage.
  dist::Communicator& pipeline_group() { return *pipeline_; }
  /// The replicas of this stage; rank = replica.
  dist::Communicator& data_group() { return *data_; }

  /// Copies replica 0's parameter values to the other replicas of this stage.
  template <class T>
  void broadcast_parameters(nn::FlatParameters<T>& params) {
    if (dp_ > 1) data_->broadcast(params.values(), 0);
  }
  /// Averages gradients over the replicas of this stage (what Pipeline does itself with data_parallel set).
  template <class T>
  void all_reduce_gradients(nn::FlatParameters<T>& params) {
    if (dp_ > 1) data_->all_reduce(params.grads(), dist::ReduceOp::Avg);
  }

 private:
  dist::Communicator& world_;
  int dp_, pp_, replica_ = 0, stage_ = 0;
  std::unique_ptr<dist::Communicator> pipeline_, data_;
};

}  // namespace ptrain::parallel
