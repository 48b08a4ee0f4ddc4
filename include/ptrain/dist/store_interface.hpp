#pragma once
// The key-value rendezvous store's interface: Store (set, get, wait, add,
// compare_set, check, delete_key, and a reusable barrier built on them) and the
// limits every implementation enforces. TCPStore (dist/tcp_store.hpp) is the
// implementation ranks use.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ptrain/core/error.hpp"

namespace ptrain::dist {

/// Largest key the store accepts, in bytes.
inline constexpr std::size_t kMaxKeyBytes = 4096;
/// Largest value the store accepts, in bytes.
inline constexpr std::size_t kMaxValueBytes = std::size_t{64} << 20;
/// Most keys one wait() or check() may name.
inline constexpr std::size_t kMaxKeysPerRequest = 4096;
/// Most client connections the server keeps open at once.
inline constexpr std::size_t kMaxStoreConnections = 4096;

/// A wait the store failed at once: it refused a client of this job for its
/// token (Note [Refused clients] in dist/store_server.hpp), so the keys may never come.
class StoreRefusedError : public CommError {
  using CommError::CommError;
};

/// Key-value store for rendezvous. All blocking calls honour timeout(); failures throw CommError.
class Store {
 public:
  virtual ~Store() = default;
  /// Sets key to value (binary-safe), waking every waiter on key.
  virtual void set(const std::string& key, const std::string& value) = 0;
  /// Value of key; blocks until key exists or timeout() passes.
  virtual std::string get(const std::string& key) = 0;
  /// Blocks until every key exists; CommError naming the missing keys after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  /// Adds delta to the decimal integer stored at key (0 when absent); returns the new value.
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
  /// Sets key to desired if it holds expected (or is absent and expected is empty); returns the value now stored
  /// (expected when the key is absent and expected is not empty).
  virtual std::string compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) = 0;
  /// True when every key exists; does not block.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  /// Removes key; true when it existed.
  virtual bool delete_key(const std::string& key) = 0;

  /// Blocks until world_size callers passed barrier `name`; reusable. The timeout error names missing ranks
  /// when set_rank() was called.
  void barrier(const std::string& name, int world_size);

  /// Timeout of get(), barrier() and every request.
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  /// This process's rank, so that barrier() can say which ranks are missing; -1 when unknown.
  int rank() const { return rank_; }
  void set_rank(int r) { rank_ = r; }

 protected:
  std::chrono::milliseconds timeout_{std::chrono::seconds(300)};
  int rank_ = -1;
};

inline void Store::barrier(const std::string& name, int world_size) {
  PTRAIN_CHECK(world_size >= 1, CommError, "[ptrain.store.barrier] barrier('", name, "') with world size ",
               world_size, "; it must be >= 1");
  // Arrivals are counted forever; the count's generation separates reuses of one name.
  const std::string base = "ptrain/barrier/" + name;
  std::int64_t n = add(base + "/count", 1);
  std::int64_t gen = (n - 1) / world_size;
  const std::string g = base + "/" + std::to_string(gen);
  if (rank_ >= 0) set(g + "/arrived/" + std::to_string(rank_), "");
  if (n % world_size == 0) {
    // The last arrival releases the others and has nothing to wait for.
    set(g + "/done", "");
    return;
  }
  try {
    wait({g + "/done"}, timeout_);
  } catch (const StoreRefusedError&) {
    throw;  // says why no rank can arrive; not a timeout
  } catch (const CommError&) {
    std::int64_t arrived = std::min<std::int64_t>(add(base + "/count", 0) - gen * world_size, world_size);
    std::string missing;
    if (rank_ >= 0) {
      int listed = 0;
      for (int r = 0; r < world_size && listed < 32; ++r)
        if (!check({g + "/arrived/" + std::to_string(r)})) missing += (listed++ ? ", " : "") + std::to_string(r);
      if (listed == 32) missing += ", ...";
    }
    PTRAIN_THROW(CommError, "[ptrain.store.barrier_timeout] barrier('", name, "') timed out after ", timeout_.count(),
                 " ms: ", arrived, " of ", world_size, " ranks arrived",
                 missing.empty() ? std::string() : "; missing ranks: " + missing,
                 ". Those ranks are stuck, crashed or were never started; check their logs");
  }
}

}  // namespace ptrain::dist
