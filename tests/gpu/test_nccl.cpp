// The NCCL communicator on one GPU (world size 1: the GPU machine has one
// device, and NCCL refuses two ranks on the same GPU). At world size 1 every
// collective is the identity, so each check compares the result with the input
// written into a separate, NaN-poisoned buffer: an operation that does not run,
// runs on the wrong bytes or never completes fails. Host buffers go through
// Note [Host buffers] in dist/nccl_communicator.hpp. Compiled by g++ like a
// user's .cpp: the DDP, FSDP and pipeline steps at the end run ptrain's kernels
// through ops:: (the kernel table that ptrain::cuda's CUDA source fills).
#include <catch2/catch.hpp>

#ifdef PTRAIN_NCCL

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "ptrain/core/tensor.hpp"
#include "ptrain/dist/nccl.hpp"
#include "ptrain/dist/process_group.hpp"
#include "ptrain/dist/store.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/nn/loss.hpp"
#include "ptrain/nn/models/mlp.hpp"
#include "ptrain/optim/adamw.hpp"
#include "ptrain/parallel/ddp.hpp"
#include "ptrain/parallel/fsdp.hpp"
#include "ptrain/parallel/pipeline.hpp"
#include "gpu/gpu_util.hpp"
#include "gpu/nccl_world.hpp"

namespace test_nccl {

using namespace ptrain;
using namespace ptrain::testing;

namespace {

std::vector<float> iota(std::size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

Tensor<float> device_nan(std::int64_t n) {
  return Tensor<float>::from(std::vector<float>(static_cast<std::size_t>(n), std::numeric_limits<float>::quiet_NaN()),
                             {n})
      .to(Device::cuda(0));
}

}  // namespace

TEST_CASE("nccl: world-size-1 collectives on device buffers", "[gpu][nccl]") {
  auto comm = nccl_world();
  REQUIRE(comm->backend() == "nccl");
  REQUIRE(comm->size() == 1);
  REQUIRE(comm->rank() == 0);
  const std::int64_t n = 1000;
  const auto values = iota(static_cast<std::size_t>(n), 1.0f);
  auto in = Tensor<float>::from(values, {n}).to(Device::cuda(0));

  SECTION("all_reduce, out of place and in place, sum and avg") {
    auto out = device_nan(n);
    comm->all_reduce(in.data(), out.data(), static_cast<std::size_t>(n), DType::F32, dist::ReduceOp::Sum);
    CHECK(out.to_vector() == values);
    auto buf = in.clone();
    comm->all_reduce(buf, dist::ReduceOp::Avg);
    CHECK(buf.to_vector() == values);
  }
  SECTION("reduce_scatter and all_gather") {
    auto out = device_nan(n);
    comm->reduce_scatter(in, out, dist::ReduceOp::Sum);
    CHECK(out.to_vector() == values);
    auto gathered = device_nan(n);
    comm->all_gather(in, gathered);
    CHECK(gathered.to_vector() == values);
  }
  SECTION("broadcast, barrier, async completion") {
    auto buf = in.clone();
    comm->broadcast(buf, 0);
    CHECK(buf.to_vector() == values);
    comm->barrier();
    auto out = device_nan(n);
    auto work = comm->all_reduce_async(in.data(), out.data(), static_cast<std::size_t>(n), DType::F32,
                                       dist::ReduceOp::Max);
    work->wait();
    CHECK(work->is_completed());
    CHECK(out.to_vector() == values);
  }
  SECTION("split") {
    auto sub = comm->split(0, 0);
    REQUIRE(sub);
    CHECK(sub->size() == 1);
    auto out = device_nan(n);
    sub->all_reduce(in.data(), out.data(), static_cast<std::size_t>(n), DType::F32, dist::ReduceOp::Sum);
    CHECK(out.to_vector() == values);
    CHECK(comm->split(-1, 0) == nullptr);
  }
}

// all_to_all(_v) is grouped ncclSend/ncclRecv per peer, here the rank itself: gated as
// nccl_all_to_all until this case passed on a GPU (Note [The verification gate]).
TEST_CASE("nccl: all_to_all and all_to_all_v as grouped send/recv", "[gpu][nccl][cuda:nccl_all_to_all]") {
  INFO("nccl_all_to_all is gated: run with PTRAIN_UNVERIFIED_CUDA=1 (tools/gpu/run.sh does)");
  REQUIRE(kernels::cuda_kernel_enabled("nccl_all_to_all"));
  auto comm = nccl_world();
  const std::int64_t n = 1000;
  const auto values = iota(static_cast<std::size_t>(n), 1.0f);
  auto in = Tensor<float>::from(values, {n}).to(Device::cuda(0));

  SECTION("equal blocks, blocking, async and inside a user's group") {
    auto out = device_nan(n);
    comm->all_to_all(in, out);
    CHECK(out.to_vector() == values);
    auto out2 = device_nan(n);
    auto w = comm->all_to_all_async(in.data(), out2.data(), static_cast<std::size_t>(n), DType::F32);
    w->wait();
    CHECK(w->is_completed());
    CHECK(out2.to_vector() == values);
    auto out3 = device_nan(n);
    comm->group_start();  // nested groups: NCCL launches at the outer group_end()
    auto g = comm->all_to_all_async(in.data(), out3.data(), static_cast<std::size_t>(n), DType::F32);
    comm->group_end();
    g->wait();
    CHECK(out3.to_vector() == values);
  }
  SECTION("variable blocks, an empty exchange, other dtypes") {
    const std::size_t c = 999;
    CHECK(comm->exchange_counts({c}) == std::vector<std::size_t>{c});
    auto out = device_nan(n);
    comm->all_to_all_v(in.data(), &c, out.data(), &c, DType::F32);
    auto got = out.to_vector();
    CHECK(std::vector<float>(got.begin(), got.begin() + 999) == std::vector<float>(values.begin(), values.begin() + 999));
    CHECK(std::isnan(got[999]));  // past the block: untouched
    const std::size_t zero = 0;
    auto untouched = device_nan(n);
    comm->all_to_all_v(in.data(), &zero, untouched.data(), &zero, DType::F32);
    for (float v : untouched.to_vector()) CHECK(std::isnan(v));
    const std::vector<std::int64_t> ids{5, -1, 1LL << 40};
    auto dids = Tensor<std::int64_t>::from(ids, {3}).to(Device::cuda(0));
    auto dout = Tensor<std::int64_t>::zeros({3}, Device::cuda(0));
    comm->all_to_all_v(dids, {3}, dout, {3});
    CHECK(dout.to_vector() == ids);
    std::vector<bf16> halves;
    for (float v : values) halves.push_back(bf16(v));
    auto b = Tensor<bf16>::from(halves, {n}).to(Device::cuda(0));
    auto bout = Tensor<bf16>::zeros({n}, Device::cuda(0));
    comm->all_to_all(b, bout);
    std::size_t wrong = 0;
    const auto back = bout.to_vector();
    for (std::size_t i = 0; i < halves.size(); ++i) wrong += static_cast<float>(back[i]) != static_cast<float>(halves[i]);
    CHECK(wrong == 0);
  }
  SECTION("host buffers are staged; overlapping buffers are refused") {
    const std::vector<std::int64_t> mine{7, -3, 1LL << 40};
    std::vector<std::int64_t> got(3, 0);
    comm->all_to_all(mine.data(), got.data(), 3, DType::I64);
    CHECK(got == mine);
    CHECK_THROWS_WITH(comm->all_to_all(in.data(), in.data(), static_cast<std::size_t>(n), DType::F32),
                      Catch::Contains("[ptrain.comm.all_to_all]") && Catch::Contains("overlap"));
    const std::size_t one = 1, two = 2;
    CHECK_THROWS_WITH(comm->all_to_all_v(in.data(), &one, got.data(), &two, DType::F32),
                      Catch::Contains("send_counts[0] = 1 but recv_counts[0] = 2"));
    comm->all_to_all(mine.data(), got.data(), 3, DType::I64);  // still usable
    CHECK(got == mine);
  }
}

TEST_CASE("nccl: host buffers are staged through the device", "[gpu][nccl]") {
  auto comm = nccl_world();
  // A scalar, as DDP::average passes it.
  double loss = 2.5;
  comm->all_reduce(&loss, 1, DType::F64, dist::ReduceOp::Avg);
  CHECK(loss == 2.5);
  // Out of place, and a gather into a larger host buffer (the model check's pattern).
  const std::vector<std::int64_t> mine{7, -3, 1LL << 40};
  std::vector<std::int64_t> all(3, 0);
  comm->all_gather(mine.data(), all.data(), mine.size(), DType::I64);
  CHECK(all == mine);
  std::int64_t mx = 0;
  const std::int64_t five = 5;
  comm->all_reduce(&five, &mx, 1, DType::I64, dist::ReduceOp::Max);
  CHECK(mx == 5);
  // In place reduce_scatter keeps the result at the front.
  std::vector<float> buf = iota(4, 1.0f);
  comm->reduce_scatter(buf.data(), buf.data(), 4, DType::F32, dist::ReduceOp::Sum);
  CHECK(buf == iota(4, 1.0f));
  // Mixed: a host source into a device destination.
  auto dev = device_nan(4);
  comm->all_reduce(buf.data(), dev.data(), 4, DType::F32, dist::ReduceOp::Sum);
  CHECK(dev.to_vector() == iota(4, 1.0f));
  // A larger host buffer after small ones grows the staging buffer.
  std::vector<float> big = iota(1 << 20, 0.0f), big_out(1 << 20, -1.0f);
  comm->all_reduce(big.data(), big_out.data(), big.size(), DType::F32, dist::ReduceOp::Sum);
  CHECK(big_out == big);
}

TEST_CASE("nccl: PTRAIN_DISTRIBUTED_DEBUG=DETAIL checks calls through NCCL's host staging", "[gpu][nccl]") {
  dist::ProcessGroupOptions o;
  o.backend = "nccl";
  o.device = Device::cuda(0);
  o.env = dist::LaunchEnv{};
  o.timeout = std::chrono::seconds(60);
  o.check_collectives = true;
  auto comm = dist::init_process_group(o);
  auto* checked = dynamic_cast<dist::CheckedCommunicator*>(comm.get());
  REQUIRE(checked != nullptr);
  CHECK(comm->backend() == "nccl");
  auto in = Tensor<float>::from(iota(1000, 1.0f), {1000}).to(Device::cuda(0));
  auto out = device_nan(1000);
  comm->all_reduce_async(in.data(), out.data(), 1000, DType::F32, dist::ReduceOp::Sum)->wait();
  CHECK(out.to_vector() == iota(1000, 1.0f));
  comm->barrier();
  CHECK(checked->checked() == 2);
}

TEST_CASE("nccl: bad calls throw at once", "[gpu][nccl]") {
  auto comm = nccl_world();
  std::uint8_t b = 0;
  CHECK_THROWS_WITH(comm->all_reduce(&b, 1, DType::U8, dist::ReduceOp::Sum), Catch::Contains("[ptrain.comm.dtype]"));
  float x = 0;
  CHECK_THROWS_WITH(comm->send(&x, 1, DType::F32, 0), Catch::Contains("[ptrain.comm.peer]"));
  CHECK_THROWS_WITH(comm->broadcast(&x, 1, DType::F32, 1), Catch::Contains("[ptrain.comm.root]"));
  // The communicator still works after refused calls.
  double v = 1.0;
  comm->all_reduce(&v, 1, DType::F64, dist::ReduceOp::Sum);
  CHECK(v == 1.0);
}

TEST_CASE("nccl: a call on another communicator, or from another thread, while a group is open is refused", "[gpu][nccl]") {
  auto a = nccl_world(), b = nccl_world();
  auto& na = dynamic_cast<dist::NcclCommunicator&>(*a);
  auto in = Tensor<float>::from(iota(8, 1.0f), {8}).to(Device::cuda(0));
  auto out = device_nan(8);
  na.group_start();
  auto w = a->all_reduce_async(in.data(), out.data(), 8, DType::F32, dist::ReduceOp::Sum);
  CHECK_THROWS_WITH(b->all_reduce(in.data(), 8, DType::F32, dist::ReduceOp::Sum),
                    Catch::Contains("[ptrain.nccl.group]") && Catch::Contains("group_end()"));
  // NCCL's group is per thread: another thread's call on `a` would run outside it.
  std::string other_thread;
  std::thread([&] {
    try {
      a->all_reduce(in.data(), 8, DType::F32, dist::ReduceOp::Sum);
    } catch (const CommError& e) {
      other_thread = e.what();
    }
  }).join();
  CHECK_THAT(other_thread, Catch::Contains("[ptrain.nccl.group]") && Catch::Contains("from a thread other than"));
  na.group_end();
  w->wait();
  CHECK(out.to_vector() == iota(8, 1.0f));
  // Both work once the group is closed.
  b->all_reduce(out.data(), 8, DType::F32, dist::ReduceOp::Sum);
  CHECK(out.to_vector() == iota(8, 1.0f));
}

TEST_CASE("nccl: a rank that never joins ends init with an error, not a hang", "[gpu][nccl]") {
  // Rank 0 of 2 alone: NCCL's bootstrap waits for rank 1, which never comes
  // (Note [NCCL nonblocking] in dist/nccl_communicator.hpp).
  dist::TCPStore store("127.0.0.1", 0, true, std::chrono::seconds(10), std::string());
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(dist::NcclCommunicator(store, 0, 2, 0, std::chrono::seconds(3)),
                    Catch::Contains("[ptrain.nccl.init]") && Catch::Contains("not every rank joined"));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s >= 2.5);  // it waited for its 3 s timeout
  // The device and NCCL still work for a communicator that does complete.
  auto comm = nccl_world();
  double v = 2.0;
  comm->all_reduce(&v, 1, DType::F64, dist::ReduceOp::Sum);
  CHECK(v == 2.0);
}

// DDP, FSDP (full shard) and a one-stage pipeline over NCCL on cuda:0, world
// size 1: three AdamW steps of an MLP, against the same model stepped without a
// wrapper on the same device (world-size-1 averages are exact, so only the
// wrappers' own bookkeeping can differ: bucket and shard offsets, gathers, hooks,
// host-staged scalars, the pipeline's device buffers). The plain model's
// agreement with the CPU is the GPT test above. A CPU model is refused.
TEST_CASE("cuda: a DDP, an FSDP and a pipeline step through NCCL equal the plain step", "[gpu][nccl]") {
  auto comm = nccl_world();
  const std::uint64_t init_seed = rng().below(1ull << 62);
  Generator g_plain(init_seed), g_ddp(init_seed), g_fsdp(init_seed), g_pipe(init_seed);
  nn::MLP<float> plain(12, {16}, 5, nn::Activation::GELU, g_plain), ddp_model(12, {16}, 5, nn::Activation::GELU, g_ddp),
      fsdp_model(12, {16}, 5, nn::Activation::GELU, g_fsdp), pipe_model(12, {16}, 5, nn::Activation::GELU, g_pipe);
  plain.to(kGpu);
  ddp_model.to(kGpu);
  pipe_model.to(kGpu);  // fsdp_model stays on the CPU: FSDP places its shards on the GPU
  nn::FlatParameters<float> plain_p(plain), ddp_p(ddp_model);
  const optim::AdamWOptions adam{.lr = 0.01, .weight_decay = 0.1};
  optim::AdamW<float> plain_opt(plain_p, adam), ddp_opt(ddp_p, adam);
  parallel::DDP<float> ddp(ddp_model, ddp_p, *comm, {.bucket_cap_bytes = 256, .first_bucket_bytes = 128});
  REQUIRE(ddp.num_buckets() > 1);
  parallel::FSDP<float> fsdp(fsdp_model.units(), *comm, {.device = kGpu});
  CHECK(fsdp.parameters().values().device() == kGpu);
  optim::AdamW<float> fsdp_opt(fsdp.parameters(), adam);
  const auto pipe_units = pipe_model.units();
  parallel::Pipeline<float> pipe(*comm, pipe_units.size(), [&](std::size_t u) { return pipe_units[u]; },
                                 parallel::partition_by_cuts(pipe_units.size(), {}));
  optim::AdamW<float> pipe_opt(pipe.parameters(), adam);
  nn::CrossEntropyLoss<float> ce;
  INFO("seed " << test_seed());
  for (int step = 0; step < 3; ++step) {
    const auto x = Tensor<float>::from(uniform<float>(8 * 12, -1, 1), {8, 12}).to(kGpu);
    std::vector<std::int32_t> t(8);
    for (auto& v : t) v = static_cast<std::int32_t>(rng().below(5));
    const auto y = Tensor<std::int32_t>::from(t, {8}).to(kGpu);
    double losses[4];
    {
      nn::Cache<float> c, lc;
      plain_p.zero_grad();
      losses[0] = ce.forward(plain.forward(x, c), y, lc);
      plain.backward(ce.backward(lc), c);
      plain_opt.step();
    }
    {
      nn::Cache<float> c, lc;
      ddp_p.zero_grad();
      losses[1] = ce.forward(ddp.forward(x, c), y, lc);
      ddp.backward(ce.backward(lc), c);
      ddp.finish_gradient_sync();
      losses[1] = ddp.average(losses[1]);  // a host scalar through NCCL
      ddp_opt.step();
    }
    {
      nn::Cache<float> c, lc;
      fsdp.zero_grad();
      losses[2] = ce.forward(fsdp.forward(x, c), y, lc);
      fsdp.backward(ce.backward(lc), c);
      fsdp.step(fsdp_opt);
    }
    losses[3] = pipe.train_step(x, y);
    pipe_opt.step();
    INFO("step " << step << " losses " << losses[0] << " " << losses[1] << " " << losses[2] << " " << losses[3]);
    CHECK(std::abs(losses[1] - losses[0]) <= 1e-6 * std::abs(losses[0]));
    CHECK(std::abs(losses[2] - losses[0]) <= 1e-6 * std::abs(losses[0]));
    CHECK(std::abs(losses[3] - losses[0]) <= 1e-6 * std::abs(losses[0]));
  }
  std::map<std::string, std::vector<float>> fsdp_full;
  for (auto& [name, t] : fsdp.full_parameters()) fsdp_full[name] = t.to_vector();
  auto ddp_params = ddp_model.named_parameters();
  auto plain_params = plain.named_parameters();
  for (std::size_t i = 0; i < plain_params.size(); ++i) {
    const auto& name = plain_params[i].name;
    INFO("parameter " << name);
    const auto ref = to_double(plain_params[i].param->value.to_vector());
    CHECK(rel_err(ddp_params[i].param->value.to_vector(), ref) <= 1e-6);
    REQUIRE(fsdp_full.count(name) == 1);
    CHECK(rel_err(fsdp_full[name], ref) <= 1e-6);
  }
  CHECK(rel_err(pipe.parameters().values().to_vector(), to_double(plain_p.values().to_vector())) <= 1e-6);
  // NCCL moves GPU memory only: a CPU model is refused before any collective.
  nn::MLP<float> cpu_model(12, {16}, 5, nn::Activation::GELU, g_plain);
  nn::FlatParameters<float> cpu_p(cpu_model);
  CHECK_THROWS_WITH(parallel::DDP<float>(cpu_model, cpu_p, *comm),
                    Catch::Contains("[ptrain.comm.device]") && Catch::Contains("cpu"));
  CHECK_THROWS_WITH(parallel::FSDP<float>(cpu_model.units(), *comm),
                    Catch::Contains("[ptrain.comm.device]") && Catch::Contains("cpu"));
}

// DDP's bf16 gradient compression packs and unpacks on the device (ops::cast_into).
// With one rank the average is the identity, so after the sync every gradient
// must be exactly the plain model's gradient rounded to bf16.
TEST_CASE("cuda: DDP's bf16 gradient compression rounds on the device", "[gpu][nccl]") {
  auto comm = nccl_world();
  const std::uint64_t init_seed = rng().below(1ull << 62);
  Generator g_plain(init_seed), g_ddp(init_seed);
  nn::MLP<float> plain(12, {16}, 5, nn::Activation::GELU, g_plain), model(12, {16}, 5, nn::Activation::GELU, g_ddp);
  plain.to(kGpu);
  model.to(kGpu);
  nn::FlatParameters<float> plain_p(plain), p(model);
  parallel::DDP<float> ddp(model, p, *comm,
                           {.bucket_cap_bytes = 256, .first_bucket_bytes = 128,
                            .reduce_dtype = DType::BF16});
  const auto x = Tensor<float>::from(uniform<float>(8 * 12, -1, 1), {8, 12}).to(kGpu);
  std::vector<std::int32_t> t(8);
  for (auto& v : t) v = static_cast<std::int32_t>(rng().below(5));
  const auto y = Tensor<std::int32_t>::from(t, {8}).to(kGpu);
  nn::CrossEntropyLoss<float> ce;
  nn::Cache<float> c, lc, dc, dlc;
  plain_p.zero_grad();
  ce.forward(plain.forward(x, c), y, lc);
  plain.backward(ce.backward(lc), c);
  p.zero_grad();
  ce.forward(ddp.forward(x, dc), y, dlc);
  ddp.backward(ce.backward(dlc), dc);
  ddp.finish_gradient_sync();
  auto want = plain_p.grads().to_vector();
  for (auto& v : want) v = static_cast<float>(bf16(v));
  INFO("seed " << test_seed());
  CHECK(p.grads().to_vector() == want);
}

}  // namespace test_nccl

#else

#include "skip.hpp"

namespace test_nccl {

// CTest runs the [nccl] test cases as a test of their own (gpu_nccl), where this
// is the only test case selected: it may end the process as skipped.
TEST_CASE("nccl: not built", "[gpu][nccl]") {
  ptrain::testing::skip_test("ptrain was configured without NCCL (nccl.h and libnccl not found): "
                             "the NCCL tests were not built");
}

}  // namespace test_nccl

#endif
