// StagedCommunicator (dist/staged_communicator.hpp) without a GPU: a stand-in
// cuda:0 backend whose "device memory" is host memory holding the bitwise
// complement of every byte (copy() complements across the host/device line,
// memset_zero writes 0xff). A communicator that handed a device pointer to MPI or
// Gloo unstaged would reduce, gather or send complemented bytes, so every
// collective below, run on device buffers through the staged communicator, is
// compared bitwise with the same collective on host buffers through the plain
// world communicator. Run by every ptrain_comm job (mpirun np 1-4, ptrun np 1-4,
// the world of one).

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>

#include "comm_util.hpp"
#include "dist/host_blocks.hpp"
#include "ptrain/dist/staged_communicator.hpp"

namespace test_staged {

using namespace comm_test;

namespace {

const Device kGpu = Device::cuda(0);

// cuda:0 as complemented host memory (see the file comment).
class ComplementGpu final : public ptrain::detail::DeviceBackend {
 public:


  Allocator& allocator(int) override { return blocks; }
  void copy(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t bytes) override {
    if (dst_dev.is_cuda() == src_dev.is_cuda()) {
      std::memmove(dst, src, bytes);
      return;
    }
    ++(dst_dev.is_cuda() ? to_device : to_host);
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    for (std::size_t i = 0; i < bytes; ++i) d[i] = static_cast<unsigned char>(~s[i]);
  }
  void memset_zero(void* dst, Device, std::size_t bytes) override { std::memset(dst, 0xff, bytes); }
  int device_count() override { return 1; }
  bool is_host_pointer(const void* p) override { return !blocks.holds(p); }
  void* allocate_pinned_host(std::size_t bytes) override {
    ++pinned;
    return std::aligned_alloc(64, bytes);
  }
  void free_pinned_host(void* p) override { std::free(p); }

  ptrain_test::HostBlocks blocks;
  std::atomic<int> to_host{0}, to_device{0}, pinned{0};
};

// Never destroyed: staging pools keep a reference to the backend.
ComplementGpu& gpu() {
  static ComplementGpu* g = new ComplementGpu;
  return *g;
}

// Installs the stand-in for a scope, with the verification gate open
// (PTRAIN_UNVERIFIED_CUDA=1), and restores both afterwards.
struct FakeCuda {
  std::optional<std::string> gate;
  FakeCuda() {
    if (const char* v = std::getenv("PTRAIN_UNVERIFIED_CUDA")) gate = v;
    ::setenv("PTRAIN_UNVERIFIED_CUDA", "1", 1);
    ptrain::detail::cuda_backend_slot() = &gpu();
  }
  ~FakeCuda() {
    ptrain::detail::cuda_backend_slot() = nullptr;
    if (gate) ::setenv("PTRAIN_UNVERIFIED_CUDA", gate->c_str(), 1);
    else ::unsetenv("PTRAIN_UNVERIFIED_CUDA");
  }
};

// A buffer on the stand-in device.
struct DevBuf {
  std::size_t bytes;
  void* p;
  explicit DevBuf(std::size_t b) : bytes(b), p(gpu().blocks.allocate(b)) {}
  ~DevBuf() { gpu().blocks.deallocate(p, bytes); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void upload(const Buf& b) { gpu().copy(p, kGpu, b.bytes.data(), Device::cpu(), bytes); }
  char* at(std::size_t offset) { return static_cast<char*>(p) + offset; }
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> out(bytes);
    gpu().copy(out.data(), Device::cpu(), p, kGpu, bytes);
    return out;
  }
};

std::vector<unsigned char> head(const Buf& b, std::size_t bytes) {
  return std::vector<unsigned char>(b.bytes.begin(), b.bytes.begin() + static_cast<std::ptrdiff_t>(bytes));
}

// The world split into one group of everyone, staged on the stand-in cuda:0.
std::unique_ptr<StagedCommunicator> staged_world() {
  auto child = world().split(0, world().rank());
  REQUIRE(child != nullptr);
  return std::make_unique<StagedCommunicator>(std::move(child), kGpu);
}

}  // namespace

TEST_CASE("staged: the verification gate refuses a staged communicator until it is open", "[dist][comm][staged]") {
  FakeCuda fake;
  if (kernels::cuda_unverified("staged_communicator")) {
    ::unsetenv("PTRAIN_UNVERIFIED_CUDA");
    auto child = world().split(0, world().rank());
    CHECK_THROWS_WITH(StagedCommunicator(std::move(child), kGpu),
                      Catch::Contains("[ptrain.cuda.unverified]") && Catch::Contains("staged_communicator"));
    ::setenv("PTRAIN_UNVERIFIED_CUDA", "1", 1);
  }
  auto c = staged_world();
  CHECK(c->serves(kGpu));
  CHECK(c->serves(Device::cpu()));
  CHECK_FALSE(c->serves(Device::cuda(1)));
  CHECK(c->backend() == world().backend());
  CHECK_THROWS_WITH(StagedCommunicator(world().split(0, world().rank()), Device::cpu()),
                    Catch::Contains("[ptrain.comm.staged]"));
}

TEST_CASE("staged: collectives on device buffers equal the host collectives bitwise", "[dist][comm][staged]") {
  FakeCuda fake;
  auto c = staged_world();
  Communicator& host = world();
  const int P = host.size(), r = host.rank();
  const int to_host0 = gpu().to_host, to_device0 = gpu().to_device;
  for (DType dt : {DType::F32, DType::BF16, DType::I64})
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{1031}})
      for (bool in_place : {true, false}) {
        const std::size_t es = dtype_size(dt), b = n * es;
        INFO(dtype_name(dt) << " n=" << n << " in_place=" << in_place);
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
          INFO("all_reduce " << reduce_op_name(op));
          Buf hs(dt, n), hr(dt, n);
          for (std::size_t i = 0; i < n; ++i) hs.set(i, input(r, i));
          DevBuf ds(b), dr(b);
          ds.upload(hs);
          if (in_place) {
            host.all_reduce(hs.data(), hs.data(), n, dt, op);
            c->all_reduce(ds.p, ds.p, n, dt, op);
            CHECK(ds.download() == head(hs, b));
          } else {
            host.all_reduce(hs.data(), hr.data(), n, dt, op);
            c->all_reduce(ds.p, dr.p, n, dt, op);
            CHECK(dr.download() == head(hr, b));
            CHECK(ds.download() == head(hs, b));  // input untouched
          }
        }
        {
          INFO("reduce_scatter");
          Buf hs(dt, n * P), hr(dt, n);
          for (std::size_t i = 0; i < n * P; ++i) hs.set(i, input(r, i, 1));
          DevBuf ds(b * P), dr(b);
          ds.upload(hs);
          if (in_place) {
            host.reduce_scatter(hs.data(), hs.data(), n, dt, ReduceOp::Sum);
            c->reduce_scatter(ds.p, ds.p, n, dt, ReduceOp::Sum);
            auto got = ds.download();
            got.resize(b);
            CHECK(got == head(hs, b));
          } else {
            host.reduce_scatter(hs.data(), hr.data(), n, dt, ReduceOp::Sum);
            c->reduce_scatter(ds.p, dr.p, n, dt, ReduceOp::Sum);
            CHECK(dr.download() == head(hr, b));
          }
        }
        {
          INFO("all_gather");
          Buf hs(dt, n), hr(dt, n * P);
          for (std::size_t i = 0; i < n; ++i) hs.set(i, input(r, i, 2));
          for (std::size_t i = 0; i < n * P; ++i) hr.set(i, -99);
          DevBuf ds(b), dr(b * P);
          ds.upload(hs);
          if (in_place) {
            for (std::size_t i = 0; i < n; ++i) hr.set(r * n + i, input(r, i, 2));
            dr.upload(hr);
            host.all_gather(hr.bytes.data() + r * b, hr.data(), n, dt);
            c->all_gather(dr.at(r * b), dr.p, n, dt);
          } else {
            dr.upload(hr);
            host.all_gather(hs.data(), hr.data(), n, dt);
            c->all_gather(ds.p, dr.p, n, dt);
          }
          CHECK(dr.download() == head(hr, b * P));
        }
      }
  // Broadcast from every root, device buffers on every rank.
  for (int root = 0; root < P; ++root) {
    Buf h(DType::F32, 777);
    for (std::size_t i = 0; i < 777; ++i) h.set(i, input(r, i, 3));
    DevBuf d(777 * 4);
    d.upload(h);
    host.broadcast(h.data(), 777, DType::F32, root);
    c->broadcast(d.p, 777, DType::F32, root);
    INFO("broadcast root " << root);
    CHECK(d.download() == head(h, 777 * 4));
  }
  // Device memory crossed the host line both ways (the stand-in counts complemented copies).
  CHECK(gpu().to_host > to_host0);
  CHECK(gpu().to_device > to_device0);
}

TEST_CASE("staged: all_to_all and all_to_all_v on device buffers equal the host calls bitwise",
          "[dist][comm][staged]") {
  FakeCuda fake;
  auto c = staged_world();
  Communicator& host = world();
  const int P = c->size(), r = c->rank();
  const auto up = static_cast<std::size_t>(P);
  for (DType dt : {DType::F32, DType::BF16, DType::I64}) {
    INFO(dtype_name(dt));
    const std::size_t es = dtype_size(dt), n = 257;
    Buf hs(dt, n * up), hr(dt, n * up);
    for (std::size_t i = 0; i < n * up; ++i) hs.set(i, input(r, i, 7));
    DevBuf ds(n * up * es), dr(n * up * es);
    ds.upload(hs);
    host.all_to_all(hs.data(), hr.data(), n, dt);
    c->all_to_all(ds.p, dr.p, n, dt);
    CHECK(dr.download() == head(hr, n * up * es));
    CHECK(ds.download() == head(hs, n * up * es));  // input untouched
    // Blocks of 0, 5 or 10 elements; the last rank of a group of 2+ sends nothing.
    auto count = [&](int src, int dst) -> std::size_t { return P > 1 && src == P - 1 ? 0 : (src + 2 * dst) % 3 * 5; };
    std::vector<std::size_t> sc, rc;
    for (int q = 0; q < P; ++q) {
      sc.push_back(count(r, q));
      rc.push_back(count(q, r));
    }
    const std::size_t st = std::accumulate(sc.begin(), sc.end(), std::size_t{0});
    const std::size_t rt = std::accumulate(rc.begin(), rc.end(), std::size_t{0});
    Buf vs(dt, st), vr(dt, rt);
    for (std::size_t i = 0; i < st; ++i) vs.set(i, input(r, i, 8));
    DevBuf dvs(st * es), dvr(rt * es);
    dvs.upload(vs);
    host.all_to_all_v(vs.data(), sc.data(), vr.data(), rc.data(), dt);
    auto w = c->all_to_all_v_async(dvs.p, sc.data(), dvr.p, rc.data(), dt);
    w->wait();
    CHECK(dvr.download() == head(vr, rt * es));
  }
}

TEST_CASE("staged: host buffers pass through; mixed host and device buffers", "[dist][comm][staged]") {
  FakeCuda fake;
  auto c = staged_world();
  const int P = c->size(), r = c->rank();
  constexpr std::size_t n = 513;
  Buf hs(DType::F64, n), ref(DType::F64, n), hr(DType::F64, n);
  for (std::size_t i = 0; i < n; ++i) hs.set(i, input(r, i, 4));
  world().all_reduce(hs.data(), ref.data(), n, DType::F64, ReduceOp::Sum);
  const auto blocks0 = c->staging_stats().staged_calls;
  c->all_reduce(hs.data(), hr.data(), n, DType::F64, ReduceOp::Sum);  // host to host: not staged
  CHECK(head(hr, n * 8) == head(ref, n * 8));
  CHECK(c->staging_stats().staged_calls == blocks0);
  DevBuf d(n * 8);
  c->all_reduce(hs.data(), d.p, n, DType::F64, ReduceOp::Sum);  // host in, device out
  CHECK(d.download() == head(ref, n * 8));
  d.upload(hs);
  Buf out(DType::F64, n);
  c->all_reduce(d.p, out.data(), n, DType::F64, ReduceOp::Sum);  // device in, host out
  CHECK(head(out, n * 8) == head(ref, n * 8));
  CHECK(c->staging_stats().staged_calls == blocks0 + 2);
  (void)P;
}

TEST_CASE("staged: send and recv around a ring on device buffers", "[dist][comm][staged]") {
  FakeCuda fake;
  auto c = staged_world();
  const int P = c->size(), r = c->rank();
  if (P < 2) return;
  constexpr std::size_t n = 2049;
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  Buf mine(DType::I32, n), want(DType::I32, n);
  for (std::size_t i = 0; i < n; ++i) mine.set(i, input(r, i, 5));
  for (std::size_t i = 0; i < n; ++i) want.set(i, input(prev, i, 5));
  DevBuf ds(n * 4), dr(n * 4);
  ds.upload(mine);
  // Every rank sends first, then receives: the sends only start, so the ring does not deadlock.
  auto s = c->send_async(ds.p, n, DType::I32, next, 3);
  auto rv = c->recv_async(dr.p, n, DType::I32, prev, 3);
  rv->wait();
  s->wait();
  CHECK(dr.download() == head(want, n * 4));
  CHECK(s->peer() == next);
  CHECK(rv->peer() == prev);
}

TEST_CASE("staged: async calls keep their buffers; a dropped Work still lands; buffers are reused",
          "[dist][comm][staged]") {
  FakeCuda fake;
  auto c = staged_world();
  const int P = c->size(), r = c->rank();
  constexpr std::size_t n = 4099;
  std::vector<std::unique_ptr<DevBuf>> dev;
  std::vector<Buf> host;
  for (int k = 0; k < 5; ++k) {
    host.emplace_back(DType::F32, n);
    for (std::size_t i = 0; i < n; ++i) host.back().set(i, input(r, i, 10 + k));
    dev.push_back(std::make_unique<DevBuf>(n * 4));
    dev.back()->upload(host.back());
  }
  std::vector<std::shared_ptr<Work>> works;
  for (int k = 0; k < 5; ++k) {
    auto w = c->all_reduce_async(dev[k]->p, dev[k]->p, n, DType::F32, ReduceOp::Sum);
    if (k != 1) works.push_back(w);  // buffer 1's Work is dropped at once
  }
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
  for (int k = 0; k < 5; ++k) {
    world().all_reduce(host[k].data(), host[k].data(), n, DType::F32, ReduceOp::Sum);
    INFO("buffer " << k);
    CHECK(dev[k]->download() == head(host[k], n * 4));
  }
  // At most one host buffer per call in flight, all pinned (the stand-in has pinned memory).
  const StagingStats s = c->staging_stats();
  CHECK(s.blocks >= 1);
  CHECK(s.blocks <= 5);
  CHECK(s.pinned_blocks == s.blocks);
  CHECK(s.bytes == s.blocks * 32768);  // 4099 floats, 16396 bytes: the 32 KiB size class
  // Blocking calls of the same size class reuse them.
  for (int k = 0; k < 4; ++k) c->all_reduce(dev[0]->p, dev[0]->p, n, DType::F32, ReduceOp::Max);
  CHECK(c->staging_stats().blocks == s.blocks);
  CHECK(c->staging_stats().staged_calls == s.staged_calls + 4);
  (void)P;
}

TEST_CASE("staged: a split of a staged communicator is staged too", "[dist][comm][staged]") {
  FakeCuda fake;
  auto c = staged_world();
  const int r = c->rank();
  auto half = c->split(r % 2, r);
  REQUIRE(half != nullptr);
  CHECK(half->serves(kGpu));
  Buf h(DType::I64, 10), ref(DType::I64, 10);
  for (std::size_t i = 0; i < 10; ++i) h.set(i, input(r, i, 6));
  auto host_half = world().split(r % 2, r);
  host_half->all_reduce(h.data(), ref.data(), 10, DType::I64, ReduceOp::Min);
  DevBuf d(80);
  d.upload(h);
  half->all_reduce(d.p, d.p, 10, DType::I64, ReduceOp::Min);
  CHECK(d.download() == head(ref, 80));
}

TEST_CASE("staged: backend choice for a cuda device", "[dist][comm][staged]") {
  FakeCuda fake;  // one visible device
  LaunchEnv env;
  env.world_size = 2;
  env.local_world_size = 2;
  ProcessGroupOptions o;
  o.device = kGpu;
  o.backend = "auto";
  const std::string host_backend = select_backend(ProcessGroupOptions{.backend = "auto"}, env);
  // Two local ranks, one GPU: NCCL would refuse, so the host backend stages.
  CHECK(dist::detail::local_ranks_share_gpus(env));
  CHECK(select_backend(o, env) == host_backend);
  // One rank per GPU: NCCL where the build has it.
  env.local_world_size = 1;
  CHECK_FALSE(dist::detail::local_ranks_share_gpus(env));
  CHECK(select_backend(o, env) == (compiled_backends().find("nccl") != std::string::npos ? "nccl" : host_backend));
  // Forced: the host backend, staged by init_process_group.
  o.backend = host_backend;
  CHECK(select_backend(o, env) == host_backend);
#ifdef PTRAIN_MPI
  // init_process_group wraps a forced MPI world on cuda:0 (a second MPI world is one MPI_Comm_dup).
  if (world().backend() == "mpi" && world().size() > 1) {
    ProcessGroupOptions m;
    m.backend = "mpi";
    m.device = kGpu;
    m.check_collectives = false;
    m.flight_recorder = false;
    auto pg = init_process_group(m);
    CHECK(dynamic_cast<StagedCommunicator*>(pg.get()) != nullptr);
    CHECK(pg->serves(kGpu));
  }
#endif
}

}  // namespace test_staged
