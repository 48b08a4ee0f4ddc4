#pragma once
// Checkpoint manager: atomic, verified, rotating checkpoints of a training run.
// Defines CheckpointManager (save, save_sharded, latest, load, rotation), its
// options, and the save job it writes; the files it writes are laid out as in
// Note [Checkpoint layout] (ckpt/files.hpp).
//
//   ckpt::CheckpointManager mgr("ckpt", comm.get(), {.keep_last = 3});
//   if (auto last = mgr.latest(); last.found()) {
//     auto state = mgr.load(last.path, params, &opt);          // model + AdamW state
//     ckpt::restore_sampler(sampler, *state.sampler, comm->size());
//   }
//   ...
//   ckpt::TrainerState ts{.step = step};
//   ts.sampler = ckpt::sampler_state(sampler, comm->size());
//   mgr.save(step, params, &opt, ts);                          // every rank calls it
//
//
// Note [Commit protocol]
// 1. prepare (collective): rank 0 removes an uncommitted directory of this
//    step and creates it (a committed one is renamed .replaced-step-N until
//    the new one commits, and moved back by the next prepare if it never does);
//    one all-reduce makes every rank agree that this worked and that no earlier
//    asynchronous save failed.
// 2. write: each writing rank writes its files (fsync) and a manifest
//    rank-RRRRR.json with their sizes, CRC-32 and tensor names (temporary
//    name, fsync, rename).
// 3. commit (rank 0): waits for the manifests of all writers, writes
//    index.json and trainer.json (temporary name, fsync, rename), fsyncs the
//    directory, then writes COMMITTED the same way and fsyncs the directory
//    and its parent. Only then is the checkpoint visible to latest().
// 4. rotate (rank 0): deletes checkpoints without a marker, committed ones
//    beyond the newest keep_last, and any with a larger step (an abandoned
//    timeline: the run resumed from an older checkpoint, or on more ranks,
//    which renumbers the steps).
// A synchronous save() adds an all-reduce after step 2 and a broadcast after
// step 3, so every rank returns (or throws) together once the marker is on disk.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "ptrain/ckpt/files.hpp"
#include "ptrain/ckpt/pieces.hpp"
#include "ptrain/ckpt/reader.hpp"
#include "ptrain/core/writable_dir.hpp"
#include "ptrain/core/safetensors.hpp"
#include "ptrain/ckpt/trainer_state.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/optim/optimizer.hpp"

namespace ptrain::ckpt {

namespace fs = std::filesystem;

/// Options of CheckpointManager.
struct CheckpointOptions {
  /// Committed checkpoints kept (older ones are deleted after each commit); 0 keeps all.
  int keep_last = 3;
  /// How long rank 0 waits for the other ranks' files before failing the commit.
  std::chrono::milliseconds commit_timeout{600'000};
};

/// A checkpoint directory that latest() passed over, and why.
struct SkippedCheckpoint {
  fs::path path;
  std::string reason;
};

/// Result of latest(): the newest verified checkpoint (if any) and the newer ones skipped.
struct LatestCheckpoint {
  fs::path path;  ///< empty when none was found
  std::int64_t step = -1;
  std::vector<SkippedCheckpoint> skipped;
  bool found() const { return !path.empty(); }
};

/// Options of CheckpointManager::load().
struct LoadOptions {
  /// Read only the given parameters' tensors and ignore others in the checkpoint
  /// (a pipeline stage loading its part); missing ones are still an error.
  bool partial = false;
};

namespace detail {

/// Local result of writing one rank's files.
struct FileRecord {
  std::string file;
  FileDigest digest;
  std::vector<std::string> tensors;
};

/// What one rank saves at one step: files of host tensors, and (rank 0) trainer.json.
struct SaveJob {
  std::int64_t step = 0;
  struct File {
    std::string name;
    std::vector<TensorRef> tensors;
    nlohmann::json pieces = nlohmann::json::object();  // key -> {tensor, shape, offset, numel} of partial pieces
  };
  std::vector<File> files;     // this rank's files
  std::vector<int> writers;    // ranks whose manifests rank 0 waits for
  std::string trainer_json;    // used by rank 0
  std::vector<std::shared_ptr<void>> keep_alive;  // host copies for asynchronous saves
};

}  // namespace detail

class AsyncCheckpointer;

/// Saves, finds and loads checkpoints under one directory (Note [Checkpoint layout]).
/// `comm` may be null for a single process; with one, save() is collective.
class CheckpointManager {
 public:
  explicit CheckpointManager(fs::path dir, dist::Communicator* comm = nullptr, CheckpointOptions opt = {})
      : dir_(std::move(dir)), comm_(comm), opt_(opt) {
    std::error_code ec;
    PTRAIN_CHECK(!fs::exists(dir_, ec) || fs::is_directory(dir_, ec), CheckpointError, "[ptrain.ckpt.path] ",
                 dir_.string(), " is not a directory; choose another checkpoint directory");
  }
  ~CheckpointManager() { join_cleaner(); }
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  /// Creates the directory and proves on every rank that a file can be written there
  /// (collective with a communicator; every rank then throws the same error): a
  /// directory that cannot take a checkpoint is found before training, not at the first
  /// save after hours of it. The Trainer and the examples call it before the first step.
  void check_writable() {
    std::string err = make_writable_dir(dir_, rank());
    if (!err.empty())
      err = "rank " + std::to_string(rank()) + " cannot write to the checkpoint directory " + dir_.string() + " (" +
            err + "); choose a writable directory (--checkpoint-dir, --run-dir) that every rank can reach";
    agree(err, "[ptrain.ckpt.unwritable] ", "cannot write to the checkpoint directory (its log has the reason)");
  }

  const fs::path& dir() const { return dir_; }
  int rank() const { return comm_ ? comm_->rank() : 0; }
  int world_size() const { return comm_ ? comm_->size() : 1; }
  dist::Communicator* communicator() const { return comm_; }
  const CheckpointOptions& options() const { return opt_; }
  /// DIR/step-00001234.
  fs::path step_path(std::int64_t step) const { return dir_ / detail::step_dir_name(step); }

  /// Data-parallel save (collective): rank 0 writes parameters, optimizer state
  /// (when `opt` is given) and `state`; returns when the checkpoint is committed.
  /// Fills in state.step, world_size, optimizer steps and lr, and rng["default"]
  /// (rank 0's default_generator()) unless given.
  template <class T>
  void save(std::int64_t step, nn::FlatParameters<T>& params, std::type_identity_t<optim::Optimizer<T>>* opt,
            TrainerState state) {
    auto job = replicated_job(step, params, opt, std::move(state), false);
    run_sync(job);
  }

  /// Sharded save (collective; Note [Sharded checkpoints]): every rank writes
  /// its own part, possibly empty; over all ranks the pieces must cover each
  /// tensor exactly once. Fills in state.step, world_size and rng["default"].
  void save_sharded(std::int64_t step, const ShardedState& mine, TrainerState state) {
    auto job = sharded_job(step, mine, std::move(state), false);
    run_sync(job);
  }

  /// The newest checkpoint whose marker, index and checksums verify; newer
  /// ones that fail are listed in `skipped` with the reason. Local (no collective).
  LatestCheckpoint latest(bool verify_data = true) const {
    LatestCheckpoint out;
    for (const auto& [step, path] : list_steps()) {
      try {
        Checkpoint c(path, verify_data);
        out.path = path;
        out.step = step;
        return out;
      } catch (const std::exception& e) {  // CheckpointError, or a file system error
        out.skipped.push_back({path, e.what()});
      }
    }
    return out;
  }

  /// latest() for a run that is about to resume. When the directory holds
  /// committed checkpoints but none verifies, training from step 0 would end at
  /// its first save ([ptrain.ckpt.newer]) after wasted work, so this refuses at
  /// once ([ptrain.ckpt.corrupt], naming each and why it failed), unless
  /// `start_over`: then rank 0 renames them to corrupt-step-N (kept for a look,
  /// invisible to latest() and rotation) and the run starts from step 0.
  /// Directories without a marker (a first save that never committed) are no
  /// checkpoints: the next save removes them. Every rank calls it (it is local:
  /// they all see the same directory).
  LatestCheckpoint latest_to_resume(bool start_over) {
    LatestCheckpoint last = latest();
    if (last.found()) return last;
    std::vector<SkippedCheckpoint> corrupt;
    for (const auto& s : last.skipped)
      if (fs::exists(s.path / detail::kMarker)) corrupt.push_back(s);
    if (corrupt.empty()) return last;
    std::string list;
    for (const auto& s : corrupt) list += "\n  " + s.path.string() + ": " + s.reason;
    PTRAIN_CHECK(start_over, CheckpointError, "[ptrain.ckpt.corrupt] every checkpoint in ", dir_.string(),
                 " fails verification, so there is nothing to resume from:", list,
                 "\nRepair or restore one of them, or start over on purpose (--start-over, "
                 "TrainerOptions::start_over), which sets them aside as corrupt-step-N");
    if (rank() == 0) {
      for (const auto& s : corrupt) {
        const fs::path to = dir_ / ("corrupt-" + s.path.filename().string());
        std::error_code ec;
        fs::remove_all(to, ec);
        fs::rename(s.path, to, ec);
        PTRAIN_CHECK(!ec, CheckpointError, "[ptrain.ckpt.io] cannot move ", s.path.string(), " to ", to.string(),
                     ": ", ec.message(), "; check that the checkpoint directory is writable");
      }
      detail::fsync_dir(dir_);
    }
    return last;
  }

  /// Records that this run continues from `path` (ckpt::load calls it): its saves
  /// may then take smaller step numbers than the directory's checkpoints (a resume
  /// on more ranks renumbers the steps, Note [Trainer steps]) and replace them.
  void resumed_from(const fs::path& path) {
    std::error_code ec;
    if (fs::equivalent(path.parent_path(), dir_, ec)) resumed_ = true;
  }

  /// Opens a committed checkpoint (verifies it first).
  Checkpoint open(const fs::path& path) const { return Checkpoint(path); }

  /// Loads parameters (and optimizer state, steps and lr when `opt` is given)
  /// from a checkpoint written by save() or save_sharded() at any world size,
  /// restores default_generator() from rng["default"], and returns the trainer
  /// state. Every model tensor must be present with the same dtype and shape,
  /// and (unless lo.partial) the checkpoint may hold no other model tensors (as
  /// PyTorch's strict load_state_dict).
  template <class T>
  TrainerState load(const fs::path& path, nn::FlatParameters<T>& params,
                    std::type_identity_t<optim::Optimizer<T>>* opt = nullptr, LoadOptions lo = {}) const {
    Checkpoint c(path);
    // Check every tensor first, so a mismatch leaves the model untouched. The
    // optimizer's state is acc_t<T> (float for a bf16 model), so a list of its own.
    std::vector<std::pair<std::string, Tensor<T>>> targets;
    std::vector<std::pair<std::string, Tensor<acc_t<T>>>> state;
    std::map<std::string, int> known;
    for (const auto& e : params.all_entries()) {  // frozen parameters too (Note [Frozen parameters])
      targets.emplace_back(e.name, e.param->value);
      known[e.name] = 1;
    }
    for (const auto& b : params.buffers()) {
      targets.emplace_back(b.name, *b.buffer);
      known[b.name] = 1;
    }
    if (!lo.partial)
      for (const auto& n : c.tensor_names("model"))
        PTRAIN_CHECK(known.count(n), CheckpointError, "[ptrain.ckpt.unexpected] ", path.string(), ": tensor '", n,
                     "' is not a parameter or buffer of the model; the checkpoint is from a different model");
    if (opt) state = opt->state_tensors();
    for (const auto& [name, t] : targets) c.check_matches(name, t);
    for (const auto& [name, t] : state) c.check_matches(name, t);
    for (auto& [name, t] : targets) c.read_into(name, t);
    for (auto& [name, t] : state) c.read_into(name, t);
    return restore_trainer_state(c, opt);
  }

 private:
  friend class AsyncCheckpointer;

  static std::int64_t checked_step(std::int64_t step) {
    PTRAIN_CHECK(step >= 0, CheckpointError, "[ptrain.ckpt.step] step ", step,
                 " is negative; checkpoints are saved at steps 0, 1, 2, ...");
    return step;
  }

  // Step directories, newest first; a set-aside copy (.replaced-step-N) right
  // after step-N, which it stands in for when that rewrite never committed.
  std::vector<std::pair<std::int64_t, fs::path>> list_steps() const {
    std::vector<std::pair<std::int64_t, fs::path>> v;
    std::error_code ec;
    if (!fs::is_directory(dir_, ec)) return v;
    for (const auto& d : fs::directory_iterator(dir_, ec)) {
      std::string name = d.path().filename().string();
      if (name.rfind(detail::kReplaced, 0) == 0) name.erase(0, std::strlen(detail::kReplaced));
      const std::int64_t s = detail::parse_step_dir(name);
      if (s >= 0 && d.is_directory()) v.emplace_back(s, d.path());
    }
    std::sort(v.begin(), v.end(), [](auto& a, auto& b) {
      return a.first != b.first ? a.first > b.first : a.second.filename() > b.second.filename();  // 's' > '.'
    });
    return v;
  }
  static bool set_aside(const fs::path& p) { return p.filename().string().rfind(detail::kReplaced, 0) == 0; }

  // Tensors for save(): views of the parameters and optimizer state. With
  // `copy` (asynchronous saves, or tensors on a GPU) they are first copied into
  // one host buffer per file, so training may change the originals meanwhile.
  template <class T>
  detail::SaveJob replicated_job(std::int64_t step, nn::FlatParameters<T>& params, optim::Optimizer<T>* opt,
                                 TrainerState state, bool copy, std::vector<std::uint8_t>* reuse = nullptr) {
    detail::SaveJob job;
    job.step = checked_step(step);
    job.writers = {0};
    state.step = step;
    state.world_size = world_size();
    if (!state.rng.count("default")) state.rng["default"] = GeneratorState::of(default_generator());
    if (opt) {
      state.optimizer_steps = opt->steps();
      state.lr = opt->lr();
    }
    job.trainer_json = to_json(state).dump(2);
    if (rank() != 0) return job;
    std::vector<std::pair<std::string, Tensor<T>>> model;
    for (const auto& e : params.all_entries()) model.emplace_back(e.name, e.param->value);
    for (const auto& b : params.buffers()) model.emplace_back(b.name, *b.buffer);
    add_file(job, "model.safetensors", model, copy || !params.values().device().is_cpu(), reuse);
    if (opt) add_file(job, "optimizer.safetensors", opt->state_tensors(), copy || !params.values().device().is_cpu(),
                      reuse ? reuse + 1 : nullptr);
    return job;
  }

  detail::SaveJob sharded_job(std::int64_t step, const ShardedState& mine, TrainerState state, bool copy,
                              std::vector<std::uint8_t>* reuse = nullptr) {
    detail::SaveJob job;
    job.step = checked_step(step);
    for (int r = 0; r < world_size(); ++r) job.writers.push_back(r);
    state.step = step;
    state.world_size = world_size();
    if (!state.rng.count("default")) state.rng["default"] = GeneratorState::of(default_generator());
    if (mine.optimizer_steps >= 0) {
      state.optimizer_steps = mine.optimizer_steps;
      state.lr = mine.lr;
    }
    job.trainer_json = to_json(state).dump(2);
    int k = 0;
    for (const auto& [role, pieces] : {std::pair{"model", &mine.model}, std::pair{"optimizer", &mine.optimizer}}) {
      if (pieces->empty()) continue;
      detail::SaveJob::File f{detail::shard_file(role, rank(), world_size()), {}};
      std::vector<Device> devices;
      for (const auto& p : *pieces) {
        TensorRef t = p.data;
        t.name = p.key();
        f.tensors.push_back(t);
        devices.push_back(p.device);
        if (!p.whole())
          f.pieces[t.name] = {{"tensor", p.name}, {"shape", p.shape.vec()}, {"offset", p.offset},
                              {"numel", t.shape.numel()}};
      }
      const bool on_device = std::any_of(devices.begin(), devices.end(), [](Device d) { return !d.is_cpu(); });
      if (copy || on_device) copy_to_host(job, f, reuse ? reuse + k : nullptr, &devices);
      job.files.push_back(std::move(f));
      ++k;
    }
    return job;
  }

  template <class T>
  void add_file(detail::SaveJob& job, const std::string& name, const std::vector<std::pair<std::string, Tensor<T>>>& ts,
                bool copy, std::vector<std::uint8_t>* reuse) {
    detail::SaveJob::File f{name, {}};
    std::vector<Device> devices;
    for (const auto& [n, t] : ts) {
      f.tensors.push_back({n, dtype_of<T>(), t.shape(), t.data()});
      devices.push_back(t.device());
    }
    if (copy) copy_to_host(job, f, reuse, &devices);
    job.files.push_back(std::move(f));
  }

  // Packs the file's tensors into one host buffer (reused across saves when
  // given, so a steady-state asynchronous save costs one memcpy, no page faults).
  static void copy_to_host(detail::SaveJob& job, detail::SaveJob::File& f, std::vector<std::uint8_t>* reuse,
                           const std::vector<Device>* devices = nullptr) {
    std::size_t total = 0;
    for (const auto& t : f.tensors) total += t.nbytes();
    std::shared_ptr<std::vector<std::uint8_t>> owned;
    std::vector<std::uint8_t>* buf = reuse;
    if (!buf) {
      owned = std::make_shared<std::vector<std::uint8_t>>();
      buf = owned.get();
      job.keep_alive.push_back(owned);
    }
    if (buf->size() != total) buf->resize(total);
    // Host-to-host copies of large files are split over two threads: the
    // copy is the whole stall of an asynchronous save.
    struct Piece {
      std::uint8_t* dst;
      const std::uint8_t* src;
      std::size_t n;
    };
    std::vector<Piece> host;
    std::size_t off = 0;
    for (std::size_t i = 0; i < f.tensors.size(); ++i) {
      auto& t = f.tensors[i];
      const Device d = devices ? (*devices)[i] : Device::cpu();
      if (d.is_cpu()) host.push_back({buf->data() + off, static_cast<const std::uint8_t*>(t.data), t.nbytes()});
      else ptrain::detail::copy_bytes(buf->data() + off, Device::cpu(), t.data, d, t.nbytes());
      t.data = buf->data() + off;
      off += t.nbytes();
    }
    parallel_copy(host);
  }

  template <class Piece>
  static void parallel_copy(const std::vector<Piece>& pieces) {
    std::size_t total = 0;
    for (const auto& p : pieces) total += p.n;
    const unsigned threads = std::min(4u, std::max(1u, std::thread::hardware_concurrency()));
    if (threads == 1 || total < (std::size_t{32} << 20)) {
      for (const auto& p : pieces) std::memcpy(p.dst, p.src, p.n);
      return;
    }
    // Thread k copies bytes [k * total / threads, (k + 1) * total / threads) of the concatenation.
    auto copy_range = [&](std::size_t lo, std::size_t hi) {
      std::size_t base = 0;
      for (const auto& p : pieces) {
        const std::size_t a = std::max(lo, base), b = std::min(hi, base + p.n);
        if (a < b) std::memcpy(p.dst + (a - base), p.src + (a - base), b - a);
        base += p.n;
      }
    };
    std::vector<std::thread> pool;
    for (unsigned k = 1; k < threads; ++k) pool.emplace_back(copy_range, total * k / threads, total * (k + 1) / threads);
    copy_range(0, total / threads);
    for (auto& t : pool) t.join();
  }

  // Note [Commit protocol], step 1. `failed_before` is this rank's pending
  // asynchronous failure, if any; every rank throws when any rank failed.
  void prepare(const detail::SaveJob& job, const std::string& failed_before) {
    std::string err = failed_before;
    if (rank() == 0 && err.empty()) {
      try {
        const fs::path p = step_path(job.step);
        restore_set_aside();
        check_resumed(job.step);
        std::error_code ec;
        if (fs::exists(p / detail::kMarker)) {  // kept until the new one is committed
          const fs::path aside = dir_ / (detail::kReplaced + p.filename().string());
          fs::rename(p, aside, ec);
          PTRAIN_CHECK(!ec, CheckpointError, "[ptrain.ckpt.io] cannot move ", p.string(), " aside to save step ",
                       job.step, " again: ", ec.message(), "; check that the checkpoint directory is writable");
          detail::fsync_dir(dir_);
        }
        fs::remove_all(p, ec);
        fs::create_directories(p, ec);
        PTRAIN_CHECK(!ec && fs::is_directory(p), CheckpointError, "[ptrain.ckpt.io] cannot create ", p.string(), ": ",
                     ec.message(), "; check that the checkpoint directory is writable");
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    agree(err, "[ptrain.ckpt.prepare] ");
  }

  // A set-aside checkpoint whose rewrite was not committed (the save failed, or
  // the process died) goes back in place; one whose rewrite was committed goes.
  // Runs only between saves (one is in flight at a time). Rank 0.
  void restore_set_aside() {
    std::error_code ec;
    for (const auto& [step, path] : list_steps()) {
      if (!set_aside(path)) continue;
      const fs::path original = step_path(step);
      if (fs::exists(original / detail::kMarker)) {
        fs::remove_all(path, ec);
        continue;
      }
      fs::remove_all(original, ec);
      fs::rename(path, original, ec);
      PTRAIN_CHECK(!ec, CheckpointError, "[ptrain.ckpt.io] cannot move ", path.string(), " back to ",
                   original.string(), ": ", ec.message(), "; rename it by hand");
    }
  }

  // Committed checkpoints of larger steps are deleted once this step commits
  // (rotate), which is right after resuming from an older one, or from one of
  // fewer ranks (whose steps were smaller). Without a resume from this directory
  // and without any committed checkpoint at or before `step`, this run did not
  // continue them: deleting them would throw away another run's work. Rank 0.
  void check_resumed(std::int64_t step) const {
    if (resumed_) return;
    std::int64_t newest = -1;
    for (const auto& [s, path] : list_steps()) {
      if (!fs::exists(path / detail::kMarker)) continue;
      if (s <= step) return;
      newest = std::max(newest, s);
    }
    PTRAIN_CHECK(newest < 0, CheckpointError, "[ptrain.ckpt.newer] ", dir_.string(),
                 " holds committed checkpoints up to step ", newest, " but none at or before step ", step,
                 ", so this run did not resume from it, and saving would delete them. Resume from latest() "
                 "(e.g. --resume), use another checkpoint directory, or delete those checkpoints to start over");
  }

  // Throws on every rank when any rank has a non-empty error (one all-reduce).
  // The failing rank writes its reason to stderr first: the other ranks' error
  // sends the reader to its log, and they exit at once, so a launcher (ptrun,
  // torchrun) sends this rank SIGTERM while its exception unwinds; by then the
  // PreemptionHandler's destructor has restored the default action, and the
  // signal would end the process before the program could print the reason.
  // Every rank learns whether one failed (`err` non-empty there) and throws: its own
  // error, or "rank R <others>".
  void agree(const std::string& err, const char* id,
             const char* others = "failed to save its part of the checkpoint (its log has the reason); this "
                                  "checkpoint is not committed and the previous one stays valid") {
    if (!err.empty() && comm_ && comm_->size() > 1)
      std::fprintf(stderr, "ptrain: rank %d: %s%s\n", rank(), id, err.c_str());
    std::int32_t failed = err.empty() ? 0 : rank() + 1;
    if (comm_ && comm_->size() > 1) comm_->all_reduce(&failed, 1, DType::I32, dist::ReduceOp::Max);
    if (failed == 0) return;
    if (!err.empty()) PTRAIN_THROW(CheckpointError, id, err);
    PTRAIN_THROW(CheckpointError, id, "rank ", failed - 1, " ", others);
  }

  // Note [Commit protocol], step 2: this rank's files and its manifest.
  void write_files(const detail::SaveJob& job) {
    const fs::path dir = step_path(job.step);
    try {
      nlohmann::json man = {{"rank", rank()}, {"files", nlohmann::json::object()}};
      const std::map<std::string, std::string> meta = {{"format", "pt"}, {"ptrain.step", std::to_string(job.step)}};
      for (const auto& f : job.files) {
        const FileDigest d = write_safetensors((dir / f.name).string(), f.tensors, meta);
        nlohmann::json names = nlohmann::json::object();
        for (std::size_t i = 0; i < f.tensors.size(); ++i) names[f.tensors[i].name] = d.tensor_crc32[i];
        man["files"][f.name] = {{"bytes", d.bytes}, {"crc32", d.crc32}, {"tensors", names}, {"pieces", f.pieces}};
      }
      // Only rank 0's commit reads the manifest, so it needs an atomic rename but no fsync.
      if (std::find(job.writers.begin(), job.writers.end(), rank()) != job.writers.end())
        detail::write_file_atomic(dir / detail::rank_name("rank-", rank(), ".json"), man.dump(), false);
    } catch (const std::exception& e) {
      // Lets rank 0 fail the commit at once instead of waiting for the timeout.
      std::ofstream(dir / detail::rank_name("rank-", rank(), ".failed")) << e.what();
      throw;
    }
  }

  // Note [Commit protocol], steps 3 and 4 (rank 0).
  void commit(const detail::SaveJob& job) {
    const fs::path dir = step_path(job.step);
    nlohmann::json index = {{"format", "ptrain.index/1"}, {"step", job.step}, {"world_size", world_size()},
                            {"checksum", "crc32"}, {"files", nlohmann::json::object()},
                            {"weight_map", nlohmann::json::object()}, {"tensor_crc32", nlohmann::json::object()},
                            {"pieces", nlohmann::json::object()}};
    const auto deadline = std::chrono::steady_clock::now() + opt_.commit_timeout;
    for (int r : job.writers) {
      const fs::path man = dir / detail::rank_name("rank-", r, ".json");
      const fs::path failed = dir / detail::rank_name("rank-", r, ".failed");
      while (!fs::exists(man)) {
        PTRAIN_CHECK(!fs::exists(failed), CheckpointError, "[ptrain.ckpt.commit] rank ", r, " failed to write its "
                     "files for step ", job.step, ": ", detail::read_text(failed));
        PTRAIN_CHECK(std::chrono::steady_clock::now() < deadline, CheckpointError, "[ptrain.ckpt.commit] rank ", r,
                     " did not finish its files for step ", job.step, " within ", opt_.commit_timeout.count(),
                     " ms; check that every rank sees the same checkpoint directory (shared file system)");
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      const nlohmann::json m = detail::parse_json(detail::read_text(man), man);
      for (auto it = m.at("files").begin(); it != m.at("files").end(); ++it) {
        index["files"][it.key()] = {{"bytes", it.value().at("bytes")}, {"crc32", it.value().at("crc32")}};
        for (auto t = it.value().at("tensors").begin(); t != it.value().at("tensors").end(); ++t) {
          PTRAIN_CHECK(!index["weight_map"].contains(t.key()), CheckpointError, "[ptrain.ckpt.name] tensor '",
                       t.key(), "' is saved by two ranks (second: rank ", r,
                       "); sharded tensor names must be unique across ranks");
          index["weight_map"][t.key()] = it.key();
          index["tensor_crc32"][t.key()] = t.value();
        }
        for (auto p = it.value().at("pieces").begin(); p != it.value().at("pieces").end(); ++p)
          index["pieces"][p.key()] = p.value();
      }
    }
    // A bad sharding (a missing or doubly saved range) fails here, before anything is committed.
    detail::group_pieces(index["pieces"], index["weight_map"].get<std::map<std::string, std::string>>(), "step " +
                         std::to_string(job.step));
    const std::string index_text = index.dump(2);
    detail::write_file_atomic(dir / detail::kIndex, index_text);
    detail::write_file_atomic(dir / detail::kTrainer, job.trainer_json);
    detail::fsync_dir(dir);
    const nlohmann::json marker = {{"step", job.step}, {detail::kIndex, detail::crc_of(index_text)},
                                   {detail::kTrainer, detail::crc_of(job.trainer_json)}};
    detail::write_file_atomic(dir / detail::kMarker, marker.dump());
    detail::fsync_dir(dir);
    detail::fsync_dir(dir_);
    std::error_code ec;
    for (int r : job.writers) fs::remove(dir / detail::rank_name("rank-", r, ".json"), ec);
    rotate(job.step);
  }

  // Keeps the just-committed checkpoint and the keep_last - 1 newest older
  // committed ones; removes the rest, every newer one, and every directory
  // without a marker (one save is in flight at a time, so those can never
  // complete). Victims
  // are renamed to .deleting-* at once (invisible to latest()) and deleted by
  // a background thread: removing a large checkpoint takes a noticeable
  // fraction of writing it, and nobody needs to wait for it.
  void rotate(std::int64_t current) {
    join_cleaner();
    std::vector<fs::path> victims;
    std::error_code ec;
    for (const auto& d : fs::directory_iterator(dir_, ec))
      if (d.path().filename().string().rfind(".deleting-", 0) == 0) victims.push_back(d.path());  // from a crash
    int kept = 1;
    for (const auto& [step, path] : list_steps()) {
      // A set-aside copy goes: its step's new checkpoint is committed.
      if (step == current && !set_aside(path)) continue;
      const bool committed = fs::exists(path / detail::kMarker);
      // Newer steps belong to a timeline this run abandoned by resuming from an
      // older checkpoint; left in place, latest() would jump back to them.
      if (committed && step < current && !set_aside(path) && (opt_.keep_last <= 0 || kept < opt_.keep_last)) {
        ++kept;
        continue;
      }
      const fs::path trash = dir_ / (".deleting-" + path.filename().string());
      fs::remove_all(trash, ec);
      fs::rename(path, trash, ec);
      victims.push_back(ec ? path : trash);
    }
    if (victims.empty()) return;
    detail::fsync_dir(dir_);
    cleaner_ = std::thread([victims = std::move(victims)] {
      std::error_code e;
      for (const auto& v : victims) fs::remove_all(v, e);
    });
  }

  void join_cleaner() {
    if (cleaner_.joinable()) cleaner_.join();
  }

  void run_sync(detail::SaveJob& job) {
    prepare(job, "");
    std::string err;
    try {
      write_files(job);
    } catch (const std::exception& e) {
      err = e.what();
    }
    agree(err, "[ptrain.ckpt.write] ");
    std::int32_t ok = 1;
    std::string commit_err;
    if (rank() == 0) {
      try {
        commit(job);
      } catch (const std::exception& e) {
        ok = 0;
        commit_err = e.what();
      }
    }
    if (comm_ && comm_->size() > 1) comm_->broadcast(&ok, 1, DType::I32, 0);
    if (!commit_err.empty()) PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.commit] ", commit_err);
    PTRAIN_CHECK(ok, CheckpointError, "[ptrain.ckpt.commit] rank 0 could not commit step ", job.step,
                 " (its log has the reason); the previous checkpoint stays valid");
  }

  fs::path dir_;
  dist::Communicator* comm_;
  CheckpointOptions opt_;
  bool resumed_ = false;  // resumed_from() a checkpoint of this directory
  std::thread cleaner_;  // deletes rotated-out checkpoints
};

}  // namespace ptrain::ckpt
