// DataLoader (data/loader.hpp): the batches of the synchronous loop (sampler.next, then get)
// for any number of workers and prefetch depth, resume at the same and another world size,
// a worker's exception on the next() that needs its batch, and stop/destruction mid-epoch.
// No timing is asserted: get() sleeps a few random microseconds only to shuffle the workers.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>

#include <ptrain/ckpt/sampler_state.hpp>
#include <ptrain/data/loader.hpp>

namespace test_loader {

using namespace ptrain;

namespace {

// Row i is (i, 2i, 3i) + 0.5 and its target i % 7; get() sleeps 0..`max_sleep_us` microseconds first.
// Throws BadSample on index `bad` (-1: never).
struct BadSample : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Rows : public Dataset<float> {
 public:
  explicit Rows(std::int64_t n, int max_sleep_us = 50, std::int64_t bad = -1)
      : n_(n), max_sleep_us_(max_sleep_us), bad_(bad) {}
  std::int64_t size() const override { return n_; }
  Batch<float> get(const std::vector<std::int64_t>& idx) override {
    thread_local std::minstd_rand gen(std::random_device{}());
    if (max_sleep_us_ > 0)
      std::this_thread::sleep_for(std::chrono::microseconds(gen() % static_cast<unsigned>(max_sleep_us_ + 1)));
    ++calls;
    const auto rows = static_cast<std::int64_t>(idx.size());
    auto x = Tensor<float>::empty({rows, 3});
    auto y = Tensor<std::int32_t>::empty({rows});
    for (std::int64_t r = 0; r < rows; ++r) {
      if (idx[r] == bad_) throw BadSample("sample " + std::to_string(bad_) + " is unreadable");
      for (int c = 0; c < 3; ++c) x.data()[r * 3 + c] = static_cast<float>(idx[r] * (c + 1)) + 0.5f;
      y.data()[r] = static_cast<std::int32_t>(idx[r] % 7);
    }
    return {x, {}, y};
  }
  std::atomic<int> calls{0};

 private:
  std::int64_t n_;
  int max_sleep_us_;
  std::int64_t bad_;
};

// A batch flattened: its inputs, then its targets.
std::vector<float> flat(const Batch<float>& b) {
  std::vector<float> v(b.x.data(), b.x.data() + b.x.numel());
  for (std::int64_t i = 0; i < b.targets.ids().numel(); ++i) v.push_back(static_cast<float>(b.targets.ids().data()[i]));
  return v;
}

struct Step {
  std::vector<float> batch;
  std::int64_t position;  // the sampler's position after it
};

// The synchronous loop: sampler.next, get, until the epoch ends (or a partial batch with drop_last).
std::vector<Step> reference(Dataset<float>& data, DistributedSampler& s, std::int64_t batch, bool drop_last) {
  std::vector<Step> out;
  while (!s.epoch_done()) {
    const auto idx = s.next(batch);
    if (drop_last && static_cast<std::int64_t>(idx.size()) < batch) break;
    out.push_back({flat(data.get(idx)), s.position()});
  }
  return out;
}

std::vector<Step> drain(DataLoader<float>& loader, const DistributedSampler& s) {
  std::vector<Step> out;
  while (auto b = loader.next()) out.push_back({flat(*b), s.position()});
  return out;
}

bool same(const std::vector<Step>& a, const std::vector<Step>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].batch != b[i].batch || a[i].position != b[i].position) return false;
  return true;
}

}  // namespace

TEST_CASE("DataLoader yields the batches of the synchronous loop, in order, for any workers and prefetch",
          "[data][loader]") {
  Rows data(53);
  for (bool drop_last : {false, true})
    for (int workers : {0, 1, 2, 4})
      for (int prefetch : {1, 2, 5}) {
        CAPTURE(drop_last, workers, prefetch);
        DistributedSampler ref_sampler(data.size(), 1, 2, 11), sampler(data.size(), 1, 2, 11);
        DataLoader<float> loader(data, sampler, {.batch = 5, .drop_last = drop_last, .workers = workers,
                                                 .prefetch = prefetch});
        for (std::uint64_t epoch : {0, 1}) {
          ref_sampler.set_epoch(epoch);
          sampler.set_epoch(epoch);
          loader.start();
          const auto want = reference(data, ref_sampler, 5, drop_last);
          REQUIRE(want.size() == (drop_last ? 5u : 6u));  // 27 samples on rank 1 of 2
          REQUIRE(same(drain(loader, sampler), want));
          REQUIRE_FALSE(loader.next());  // stays over
        }
      }
}

TEST_CASE("DataLoader resumes mid-epoch at the same and at another world size", "[data][loader]") {
  Rows data(48);
  const std::int64_t batch = 4;
  // Two ranks take 3 batches each of epoch 1: 24 samples of the epoch's order are done.
  std::vector<ckpt::SamplerState> saved;
  std::vector<std::vector<Step>> rest_uninterrupted;
  for (int r = 0; r < 2; ++r) {
    DistributedSampler s(data.size(), r, 2, 5);
    s.set_epoch(1);
    DataLoader<float> loader(data, s, {.batch = batch, .workers = 2, .prefetch = 3});
    loader.start();
    for (int k = 0; k < 3; ++k) REQUIRE(loader.next());
    saved.push_back(ckpt::sampler_state(s, 2));
    rest_uninterrupted.push_back(drain(loader, s));
  }
  REQUIRE(saved[0].consumed == 24);

  SECTION("same world size: the batches the uninterrupted run went on with") {
    for (int r = 0; r < 2; ++r) {
      DistributedSampler s(data.size(), r, 2, 5);
      ckpt::restore_sampler(s, saved[static_cast<std::size_t>(r)], 2);
      DataLoader<float> loader(data, s, {.batch = batch, .workers = 3, .prefetch = 2});
      loader.start();
      REQUIRE(same(drain(loader, s), rest_uninterrupted[static_cast<std::size_t>(r)]));
    }
  }
  SECTION("other world sizes: the synchronous loop's batches, and together the rest of the epoch's order") {
    const auto order = shuffled_indices(data.size(), 5, 1);
    for (int world : {1, 3, 4}) {
      CAPTURE(world);
      std::multiset<std::int64_t> got_ids, want_ids;
      for (int r = 0; r < world; ++r) {
        DistributedSampler s(data.size(), r, world, 5), ref(data.size(), r, world, 5);
        ckpt::restore_sampler(s, saved[0], world);
        ckpt::restore_sampler(ref, saved[0], world);
        DataLoader<float> loader(data, s, {.batch = batch, .workers = 2, .prefetch = 2});
        loader.start();
        const auto got = drain(loader, s);
        REQUIRE(same(got, reference(data, ref, batch, false)));
        for (const Step& st : got)  // a batch is rows x 3 inputs, then rows targets; input 0 is index + 0.5
          for (std::size_t i = 0; i < st.batch.size() / 4; ++i)
            got_ids.insert(static_cast<std::int64_t>(st.batch[3 * i] - 0.5f));
      }
      for (std::size_t p = 24; p < order.size(); ++p) want_ids.insert(order[p]);
      REQUIRE(got_ids == want_ids);  // 48 - 24 = 24 samples: every world here divides it, no padding
    }
  }
}

TEST_CASE("DataLoader rethrows a worker's exception on the next() that needs its batch", "[data][loader]") {
  for (int workers : {0, 1, 3}) {
    CAPTURE(workers);
    Rows data(40, 20, /*bad=*/-1);
    DistributedSampler probe(data.size(), 0, 1, 9, true);
    const std::int64_t bad = probe.indices()[17];  // in batch 3 of 5 samples (positions 15..19)
    Rows failing(40, 20, bad);
    DistributedSampler s(failing.size(), 0, 1, 9);
    DataLoader<float> loader(failing, s, {.batch = 5, .workers = workers, .prefetch = 4});
    loader.start();
    for (int k = 0; k < 3; ++k) REQUIRE(loader.next());  // the batches before it arrive
    try {
      (void)loader.next();
      FAIL("no exception");
    } catch (const BadSample& e) {
      REQUIRE(std::string(e.what()) == "sample " + std::to_string(bad) + " is unreadable");
    }
    REQUIRE_THROWS_AS(loader.next(), BadSample);  // and again, until start()
    s.set_epoch(0, 0);
    loader.start();
    REQUIRE(loader.next());
  }
}

TEST_CASE("DataLoader stops and joins its workers mid-epoch: destruction, a new epoch, stop()", "[data][loader]") {
  Rows data(400, 300);
  DistributedSampler s(data.size(), 0, 1, 2);
  {
    DataLoader<float> loader(data, s, {.batch = 3, .workers = 4, .prefetch = 8});
    loader.start();
    REQUIRE(loader.next());
    REQUIRE(loader.next());
  }  // destroyed with workers busy: returns once each finished its get()
  const int calls = data.calls.load();
  REQUIRE(calls <= 2 + 8);  // the 2 taken and at most prefetch = 8 claimed ahead of them

  DataLoader<float> loader(data, s, {.batch = 3, .workers = 3, .prefetch = 4});
  s.set_epoch(0, 6);
  loader.start();
  REQUIRE(loader.next());
  s.set_epoch(3);  // a new epoch mid-epoch
  loader.start();
  DistributedSampler ref(data.size(), 0, 1, 2);
  ref.set_epoch(3);
  Rows quiet(400, 0);
  REQUIRE(flat(*loader.next()) == flat(quiet.get(ref.next(3))));
  loader.stop();
  loader.stop();  // idempotent
  REQUIRE_THROWS_WITH(loader.next(), Catch::Contains("[ptrain.data.loader.start]"));

  loader.start();
  (void)s.next(3);  // the sampler moved behind the loader's back
  REQUIRE_THROWS_WITH(loader.next(), Catch::Contains("[ptrain.data.loader.sampler]"));
  REQUIRE_THROWS_WITH(DataLoader<float>(data, s, {.workers = -1}), Catch::Contains("[ptrain.data.loader.options]"));
}

}  // namespace test_loader
