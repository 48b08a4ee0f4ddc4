// The caching allocator's stream rules (Note [Streams and cached blocks] in
// core/allocator.hpp), driven by a host-only subclass whose "streams" are
// numbers and whose markers complete when the test says so: the same logic
// the CUDA allocator runs with real streams and events.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <set>

#include <ptrain/core/allocator.hpp>

namespace test_allocator {

using namespace ptrain;

namespace {

class FakeStreamAllocator final : public detail::CachingAllocator {
 public:
  std::uintptr_t stream = 0;               // the "current stream" of the calling thread
  std::set<std::uintptr_t> busy;           // streams whose queued work has not finished
  std::set<std::uintptr_t> marked;         // streams a marker was recorded on
  int raw_allocations = 0, raw_frees = 0;

  ~FakeStreamAllocator() override { empty_cache(); }

 protected:
  void* raw_allocate(std::size_t bytes) override {
    ++raw_allocations;
    return std::aligned_alloc(kAlignment, bytes);
  }
  void raw_free(void* p) override {
    ++raw_frees;
    std::free(p);
  }
  std::uintptr_t current_stream_key() const override { return stream; }
  // A marker is the stream it was recorded on; it is done once that stream is idle.
  void* record_marker(std::uintptr_t s) noexcept override {
    marked.insert(s);
    return busy.count(s) ? reinterpret_cast<void*>(s) : nullptr;
  }
  bool marker_done(void* m) noexcept override { return !busy.count(reinterpret_cast<std::uintptr_t>(m)); }
};

}  // namespace

TEST_CASE("caching allocator: a freed block is reused only on the stream that allocated it", "[core][alloc]") {
  FakeStreamAllocator a;
  a.stream = 1;
  void* p = a.allocate(1000);
  a.deallocate(p, 1000);
  a.stream = 2;
  void* q = a.allocate(1000);  // another stream: fresh memory, although a block of the size is cached
  CHECK(q != p);
  CHECK(a.raw_allocations == 2);
  a.stream = 1;
  void* r = a.allocate(1000);  // the same stream: the cached block
  CHECK(r == p);
  CHECK(a.raw_allocations == 2);
  a.deallocate(q, 1000);
  a.deallocate(r, 1000);
  const auto s = a.stats();
  CHECK(s.live_bytes == 0);
  CHECK(s.peak_bytes == 2000);
  CHECK(s.reserved_bytes == 2 * 1024);  // rounded to 64 bytes
  a.empty_cache();
  CHECK(a.raw_frees == 2);
  CHECK(a.stats().reserved_bytes == 0);
}

TEST_CASE("caching allocator: record_stream holds a block until the other stream's work is done", "[core][alloc]") {
  FakeStreamAllocator a;
  a.stream = 1;
  void* p = a.allocate(256);
  a.record_stream(p, 7);  // say, a collective on stream 7 reads it
  a.record_stream(p, 1);  // its own stream: nothing to wait for
  a.busy = {7};
  a.deallocate(p, 256);
  CHECK(a.marked == std::set<std::uintptr_t>{7});
  CHECK(a.pending_blocks() == 1);
  CHECK(a.stats().live_bytes == 0);  // freed by the program, held back by the allocator
  void* q = a.allocate(256);         // stream 7 still busy: not handed out
  CHECK(q != p);
  a.deallocate(q, 256);
  a.busy.clear();  // stream 7 finished its work
  CHECK(a.pending_blocks() == 0);
  void* r = a.allocate(256);
  void* t = a.allocate(256);
  CHECK(std::set<void*>{r, t} == std::set<void*>{p, q});  // both blocks are free again, on stream 1
  a.deallocate(r, 256);
  a.deallocate(t, 256);

  // Used on another stream that is idle when the block is freed: free at once.
  void* u = a.allocate(256);
  a.record_stream(u, 9);
  a.deallocate(u, 256);
  CHECK(a.pending_blocks() == 0);
  CHECK(a.allocate(256) == u);
  a.deallocate(u, 256);

  CHECK_THROWS_WITH(a.record_stream(&a, 3), Catch::Contains("[ptrain.alloc]"));
}

TEST_CASE("caching allocator: empty_cache keeps blocks that other streams still use", "[core][alloc]") {
  FakeStreamAllocator a;
  void* p = a.allocate(128);
  void* q = a.allocate(128);
  a.record_stream(q, 5);
  a.busy = {5};
  a.deallocate(p, 128);
  a.deallocate(q, 128);
  a.empty_cache();
  CHECK(a.raw_frees == 1);  // p only; q waits for stream 5
  CHECK(a.stats().reserved_bytes == 128);
  a.busy.clear();
  a.empty_cache();
  CHECK(a.raw_frees == 2);
  CHECK(a.stats().reserved_bytes == 0);
}

}  // namespace test_allocator
