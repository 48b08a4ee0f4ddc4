#pragma once
// DataLoader: the batches of a DistributedSampler's epoch, prepared ahead by
// worker threads, so that the training step does not wait for Dataset::get.
//
//   DistributedSampler sampler(data.size(), rank, world, seed);
//   DataLoader<float> loader(data, sampler, {.batch = 64, .workers = 2, .prefetch = 4});
//   for (int epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);       // or ckpt::restore_sampler(...) when resuming
//     loader.start();                 // the workers begin at the sampler's position
//     while (auto b = loader.next()) step(*b);
//   }
//
// Note [Prefetching loader]
// Batch k of an epoch is always the sampler's k-th step: start() copies this
// rank's order of the epoch (sampler.indices()) and its position, and batch k is
// get() of positions [position + k batch, position + (k + 1) batch). Workers
// claim k = 0, 1, 2, ... in turn, at most `prefetch` ahead of the batch the
// training thread takes, and put batch k in slot k % prefetch; next() waits for
// slot k, whatever order the workers finish in. When no worker has claimed
// batch k yet (they had no CPU: the step kept every core busy), next() claims it
// and calls get() itself instead of waiting for a worker to be scheduled, so the
// loader never waits longer than the synchronous loop for want of a free core.
// next() also advances the sampler by exactly what it hands out
// (sampler.next(batch)), on the training thread, so the sampler's position is
// what the training consumed, never what was prefetched: a checkpoint saves it
// (ckpt::sampler_state) as before, and a run resumed at the same or another
// world size (Note [Sampler reshape]) calls start() after restore_sampler and
// continues with the same batches as a loop that calls sampler.next() and
// get() itself.
//
// An exception thrown by get() (in a worker or in next()) is kept in the
// batch's slot and rethrown (the same exception object, std::rethrow_exception)
// by the next() that needed that batch; every later next() rethrows it too, until start().
// stop(), start() and the destructor wake the workers and join them; a worker
// inside get() finishes that call first (get() is not interrupted), so they
// return after at most one get() per worker. With workers = 0, next() calls
// get() itself: the synchronous loop.
//
// What a Dataset must guarantee (workers >= 1): get() may be called from the
// workers and the training thread, several at the same time, while the step
// runs; so it must be safe to call concurrently (read shared state only, or
// lock), and its result must depend only on the indices (a draw from a shared
// random generator, for augmentation, would follow the threads' timing: seed a
// Generator from the indices instead). TensorDataset and InstructDataset
// qualify (they read what they built at construction and allocate the batch;
// the allocators are thread-safe). The data set must outlive the loader and not
// change while the workers run.
//
// On a GPU (`device` = cuda:N; gated as prefetch_copy_stream, see docs/cuda.md),
// next() returns the batch on the device: it copies the batch into page-locked
// host buffers, queues the copies on a side stream (kernels/cuda/copy_stream.hpp)
// into tensors allocated on that stream, records an event, and makes the
// compute stream wait for it (record_stream keeps the blocks until the compute
// stream is done with them). The host does not wait for the copy; two handles
// alternate, so a buffer is refilled only after the copy from it two batches
// ago is done. Elsewhere `device` must be the CPU and next() returns get()'s
// batch as it is.
//
// Limits: the workers stop at the end of an epoch and start() starts them again,
// so the first batch of an epoch is not prepared ahead; the copy into pinned
// memory runs on the training thread (a memcpy of the batch).

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ptrain/core/allocator.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/data/batches.hpp"
#include "ptrain/data/dataset.hpp"
#include "ptrain/data/sampler.hpp"
#include "ptrain/kernels/cuda_table.hpp"

namespace ptrain {

struct LoaderOptions {
  std::int64_t batch = 32;  ///< samples per step (sampler.next(batch))
  bool drop_last = false;   ///< next() ends the epoch instead of returning its last partial batch
  int workers = 1;          ///< threads calling get(); 0: next() calls it (synchronous)
  int prefetch = 2;         ///< batches prepared ahead of the one next() returns (workers >= 1)
  /// Where next() puts the batch: the CPU leaves it where get() made it; cuda:N copies it on a
  /// side stream (gated: prefetch_copy_stream).
  Device device = Device::cpu();
};

template <class T>
class DataLoader {
 public:
  /// `data` and `sampler` must outlive the loader. Call start() before next().
  DataLoader(Dataset<T>& data, DistributedSampler& sampler, LoaderOptions options)
      : data_(data), sampler_(sampler), o_(options) {
    PTRAIN_CHECK(o_.batch >= 1 && o_.workers >= 0 && o_.prefetch >= 1, Error,
                 "[ptrain.data.loader.options] need batch >= 1, workers >= 0 and prefetch >= 1 (got ", o_.batch, ", ",
                 o_.workers, ", ", o_.prefetch, ")");
    if (o_.device.is_cuda()) {
      kernels::check_cuda_verified("prefetch_copy_stream");
      for (auto& s : copy_) s = CopyStream(o_.device.index);
    }
  }
  ~DataLoader() { stop(); }
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// (Re)starts the workers at the sampler's epoch and position; stops running ones first.
  void start() {
    stop();
    order_ = sampler_.indices();
    first_ = sampler_.position();
    const std::int64_t left = static_cast<std::int64_t>(order_.size()) - first_;
    count_ = left == 0 ? 0 : num_batches(left, o_.batch, o_.drop_last);
    taken_ = claimed_ = 0;
    failed_ = nullptr;
    slots_.assign(static_cast<std::size_t>(o_.prefetch), Slot{});
    stopping_ = false;
    started_ = true;
    for (int w = 0; w < o_.workers; ++w) threads_.emplace_back([this] { work(); });
  }

  /// The next batch of the epoch, or none when the epoch is over (or only a partial batch
  /// is left and drop_last). Advances the sampler by what it returns (Note [Prefetching loader]);
  /// rethrows a worker's exception.
  std::optional<Batch<T>> next() {
    PTRAIN_CHECK(started_, Error, "[ptrain.data.loader.start] call start() before next() (and after each "
                 "sampler.set_epoch or restore_sampler)");
    if (failed_) std::rethrow_exception(failed_);
    if (sampler_.epoch_done()) return std::nullopt;
    const std::int64_t k = taken_;
    PTRAIN_CHECK(sampler_.position() == first_ + k * o_.batch && sampler_.indices().size() == order_.size(), Error,
                 "[ptrain.data.loader.sampler] the sampler moved (position ", sampler_.position(), ", expected ",
                 first_ + k * o_.batch, ") since start(); call start() again after set_epoch or restore_sampler");
    const std::vector<std::int64_t> idx = sampler_.next(o_.batch);
    if (o_.drop_last && static_cast<std::int64_t>(idx.size()) < o_.batch) return std::nullopt;
    Batch<T> b;
    if (o_.workers == 0) {
      try {
        b = data_.get(idx);
      } catch (...) {
        failed_ = std::current_exception();
        throw;
      }
      ++taken_;
    } else {
      std::unique_lock<std::mutex> lk(m_);
      Slot& s = slots_[static_cast<std::size_t>(k % o_.prefetch)];
      if (!s.ready && claimed_ == k) {  // no worker has started it: make it here rather than wait for one
        ++claimed_;
        lk.unlock();
        Slot mine = make(idx);
        lk.lock();
        s = std::move(mine);
      }
      ready_.wait(lk, [&] { return s.ready; });
      if (s.error) {
        failed_ = s.error;
        std::rethrow_exception(failed_);
      }
      b = std::move(s.batch);
      s = Slot{};
      ++taken_;
      lk.unlock();
      space_.notify_all();
    }
    if (o_.device.is_cuda()) b = to_device(std::move(b), copy_[static_cast<std::size_t>(k % 2)]);
    return b;
  }

  /// Wakes the workers and joins them (each finishes the get() it is in). Idempotent.
  void stop() noexcept {
    {
      std::lock_guard<std::mutex> lk(m_);
      stopping_ = true;
    }
    space_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
    started_ = false;
  }

  const LoaderOptions& options() const { return o_; }

 private:
  struct Slot {
    Batch<T> batch;
    std::exception_ptr error;
    bool ready = false;
  };

  // A worker: claims the next batch while it is at most `prefetch` ahead of the one taken.
  void work() {
    std::unique_lock<std::mutex> lk(m_);
    for (;;) {
      space_.wait(lk, [&] { return stopping_ || (claimed_ < count_ && claimed_ < taken_ + o_.prefetch); });
      if (stopping_) return;
      const std::int64_t k = claimed_++;
      const auto begin = order_.begin() + first_ + k * o_.batch;
      const std::vector<std::int64_t> idx(begin, begin + std::min<std::int64_t>(o_.batch, order_.end() - begin));
      lk.unlock();
      Slot s = make(idx);
      lk.lock();
      slots_[static_cast<std::size_t>(k % o_.prefetch)] = std::move(s);
      ready_.notify_all();
    }
  }

  // get() of one batch, or the exception it threw.
  Slot make(const std::vector<std::int64_t>& idx) {
    Slot s;
    try {
      s.batch = data_.get(idx);
    } catch (...) {
      s.error = std::current_exception();
    }
    s.ready = true;
    return s;
  }

  // A side stream and its pinned buffers (Note [Prefetching loader]; kernels/cuda/copy_stream.hpp).
  struct PinnedBuffer {
    void* p = nullptr;
    std::size_t bytes = 0;
    bool pinned = false;
    PinnedBuffer() = default;
    PinnedBuffer(PinnedBuffer&& o) noexcept
        : p(std::exchange(o.p, nullptr)), bytes(std::exchange(o.bytes, 0)), pinned(o.pinned) {}
    PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
      std::swap(p, o.p);
      std::swap(bytes, o.bytes);
      std::swap(pinned, o.pinned);
      return *this;
    }
    ~PinnedBuffer() { release(); }
    void release() noexcept {
      if (!p) return;
      if (pinned) detail::cuda_backend().free_pinned_host(p);
      else std::free(p);
      p = nullptr;
      bytes = 0;
    }
    void* fit(std::size_t n) {
      if (n <= bytes) return p;
      release();
      p = detail::cuda_backend().allocate_pinned_host(n);
      pinned = p != nullptr;
      if (!p) p = std::malloc(n);  // no pinned memory left: pageable (the runtime stages the copy)
      PTRAIN_CHECK(p != nullptr, Error, "[ptrain.data.loader.memory] out of host memory for a ", n, "-byte batch");
      bytes = n;
      return p;
    }
  };
  struct CopyStream {
    void* handle = nullptr;
    std::array<PinnedBuffer, 3> buffers;  // x, ids, targets
    CopyStream() = default;
    explicit CopyStream(int device) : handle(kernels::cuda_copy_stream_calls().create(device)) {}
    CopyStream(CopyStream&& o) noexcept : handle(std::exchange(o.handle, nullptr)), buffers(std::move(o.buffers)) {}
    CopyStream& operator=(CopyStream&& o) noexcept {
      std::swap(handle, o.handle);
      std::swap(buffers, o.buffers);
      return *this;
    }
    ~CopyStream() {
      // The stream's copies end before its buffers are freed (destroy waits for them).
      if (handle) kernels::cuda_copy_stream_calls().destroy(handle);
      handle = nullptr;
    }
  };

  Batch<T> to_device(Batch<T> b, CopyStream& cs) const {
    const kernels::CudaCopyStreamCalls& calls = kernels::cuda_copy_stream_calls();
    const Device d = o_.device;
    Batch<T> out;
    calls.begin(cs.handle);  // the copies from these buffers two batches ago are done
    try {
      auto copy = [&](const auto& src, PinnedBuffer& buf) {
        using U = typename std::decay_t<decltype(src)>::value_type;
        if (!src.defined()) return Tensor<U>();
        PTRAIN_CHECK(src.device().is_cpu(), Error, "[ptrain.data.loader.device] get() returned a batch on ",
                     src.device(), "; a Dataset returns host tensors and the loader copies them to ", d);
        const std::size_t bytes = static_cast<std::size_t>(src.numel()) * sizeof(U);
        void* staged = buf.fit(bytes);
        std::memcpy(staged, src.data(), bytes);
        auto dst = Tensor<U>::empty(src.shape(), d);  // keyed by the side stream
        kernels::cuda_graph_calls().upload(dst.data(), staged, bytes, d.index);
        return dst;
      };
      out.x = copy(b.x, cs.buffers[0]);
      out.ids = copy(b.ids, cs.buffers[1]);
      if (b.targets.is_ids()) out.targets = copy(b.targets.ids(), cs.buffers[2]);
      else out.targets = copy(b.targets.values(), cs.buffers[2]);
    } catch (...) {
      calls.end(cs.handle);
      throw;
    }
    calls.end(cs.handle);
    const std::uintptr_t compute = calls.wait(cs.handle);
    if (out.x.defined()) out.x.record_stream(compute);
    if (out.ids.defined()) out.ids.record_stream(compute);
    if (out.targets.is_ids()) out.targets.ids().record_stream(compute);
    else out.targets.values().record_stream(compute);
    return out;
  }

  Dataset<T>& data_;
  DistributedSampler& sampler_;
  LoaderOptions o_;
  std::vector<std::int64_t> order_;  // this rank's indices of the epoch (a copy: the workers read it)
  std::int64_t first_ = 0;           // the sampler's position at start()
  std::int64_t count_ = 0;           // batches from first_ to the end of the epoch
  std::int64_t taken_ = 0;           // batches next() returned
  std::int64_t claimed_ = 0;         // batches a worker started
  std::vector<Slot> slots_;          // batch k in slot k % prefetch
  std::exception_ptr failed_;
  bool stopping_ = false, started_ = false;
  std::mutex m_;
  std::condition_variable ready_, space_;
  std::vector<std::thread> threads_;
  std::array<CopyStream, 2> copy_;  // alternate: batch k uses copy_[k % 2]
};

}  // namespace ptrain
