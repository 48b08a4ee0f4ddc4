// The data loader's copies to the GPU (Note [Prefetching loader] in data/loader.hpp,
// kernels/cuda/copy_stream.hpp), gated as "prefetch_copy_stream":
//   * batches copied through pinned buffers on a side stream equal the host batches
//     bit for bit, for 0 and 2 workers, over many batches (the two buffers alternate
//     and are refilled after their copies are done), and a kernel on the compute stream
//     right after next() reads the copied values (the event orders it after the copy);
//   * the Trainer with the side-stream copy trains exactly as with the synchronous copy
//     (the gate closed for the reference run: PTRAIN_UNVERIFIED_CUDA=0), on an MLP with
//     MSE and SGD, whose kernels are verified either way.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>

#include "gpu_util.hpp"
#include "ptrain/data/loader.hpp"
#include "ptrain/dist/self_communicator.hpp"
#include "ptrain/nn/loss.hpp"
#include "ptrain/nn/models/mlp.hpp"
#include "ptrain/ops/vector.hpp"
#include "ptrain/optim/sgd.hpp"
#include "ptrain/parallel/make_engine.hpp"
#include "ptrain/train/trainer.hpp"

namespace test_loader_gpu {

using namespace ptrain;
using namespace ptrain::testing;

namespace {

// Row i: inputs 17 values of i, ids 5 values of i, targets (i % 3) as floats [n, 1].
class Rows : public Dataset<float> {
 public:
  explicit Rows(std::int64_t n) : n_(n) {}
  std::int64_t size() const override { return n_; }
  Batch<float> get(const std::vector<std::int64_t>& idx) override {
    const auto b = static_cast<std::int64_t>(idx.size());
    auto x = Tensor<float>::empty({b, 17});
    auto ids = Tensor<std::int32_t>::empty({b, 5});
    auto y = Tensor<float>::empty({b, 1});
    for (std::int64_t r = 0; r < b; ++r) {
      for (int c = 0; c < 17; ++c) x.data()[r * 17 + c] = 0.01f * static_cast<float>(idx[r] * 17 + c);
      for (int c = 0; c < 5; ++c) ids.data()[r * 5 + c] = static_cast<std::int32_t>(idx[r] * 5 + c);
      y.data()[r] = static_cast<float>(idx[r] % 3);
    }
    return {x, ids, y};
  }

 private:
  std::int64_t n_;
};

template <class U>
std::vector<U> host(const Tensor<U>& t) {
  const Tensor<U> h = t.to(Device::cpu());
  return std::vector<U>(h.data(), h.data() + h.numel());
}

// Sets PTRAIN_UNVERIFIED_CUDA for a scope.
struct GateEnv {
  std::string before;
  bool had;
  explicit GateEnv(const char* value) : had(std::getenv("PTRAIN_UNVERIFIED_CUDA") != nullptr) {
    if (had) before = std::getenv("PTRAIN_UNVERIFIED_CUDA");
    ::setenv("PTRAIN_UNVERIFIED_CUDA", value, 1);
  }
  ~GateEnv() {
    if (had) ::setenv("PTRAIN_UNVERIFIED_CUDA", before.c_str(), 1);
    else ::unsetenv("PTRAIN_UNVERIFIED_CUDA");
  }
};

}  // namespace

TEST_CASE("DataLoader on cuda:0: side-stream copies equal the host batches", "[cuda:prefetch_copy_stream]") {
  Rows data(301);
  for (int workers : {0, 2}) {
    CAPTURE(workers);
    DistributedSampler sampler(data.size(), 0, 1, 3), ref(data.size(), 0, 1, 3);
    DataLoader<float> loader(data, sampler, {.batch = 8, .workers = workers, .prefetch = 3, .device = kGpu});
    loader.start();
    int batches = 0;
    while (auto b = loader.next()) {
      const Batch<float> want = data.get(ref.next(8));
      REQUIRE(b->x.device() == kGpu);
      REQUIRE(b->ids.device() == kGpu);
      REQUIRE(b->targets.values().device() == kGpu);
      // A kernel on the compute stream, queued at once: it must see the copied values.
      Tensor<float> doubled = Tensor<float>::zeros(b->x.shape(), kGpu);
      ops::axpy_(2.0f, b->x, doubled);
      std::vector<float> twice(want.x.data(), want.x.data() + want.x.numel());
      for (float& v : twice) v *= 2.0f;
      REQUIRE(host(doubled) == twice);
      REQUIRE(host(b->ids) == std::vector<std::int32_t>(want.ids.data(), want.ids.data() + want.ids.numel()));
      REQUIRE(host(b->targets.values()) == std::vector<float>(want.targets.values().data(),
                                                             want.targets.values().data() + want.targets.values().numel()));
      ++batches;
    }
    REQUIRE(batches == 38);
  }
}

TEST_CASE("Trainer on cuda:0: the side-stream copy trains as the synchronous copy", "[cuda:prefetch_copy_stream]") {
  Rows data(96);
  auto train = [&](int workers) {
    dist::SelfCommunicator self;
    Generator g(5);
    auto model = std::make_shared<nn::MLP<float>>(17, std::vector<std::int64_t>{16}, 1, nn::Activation::ReLU, g);
    model->to(kGpu);
    auto engine = parallel::make_engine<float>(model, self, parallel::LocalOptions{});
    engine->set_loss(parallel::loss_fn<float>(nn::MSELoss<float>()));
    optim::SGD<float> opt(engine->parameters(), {.lr = 0.01});
    train::Trainer<float> trainer(*engine, opt, data,
                                  {.epochs = 2, .batch = 8, .log_every = 0, .cuda_graphs = false,
                                   .loader_workers = workers});
    trainer.run();
    return host(engine->parameters().values());
  };
  std::vector<float> sync;
  {
    GateEnv closed("0");  // the gate closed: host batches, copied by the training thread
    sync = train(0);
  }
  GateEnv open("1");
  REQUIRE(kernels::cuda_kernel_enabled("prefetch_copy_stream"));
  REQUIRE(train(0) == sync);
  REQUIRE(train(2) == sync);
}

}  // namespace test_loader_gpu
