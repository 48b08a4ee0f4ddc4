// Checkpoint throughput against the storage's own speed, in one run:
//   raw_write  plain write() loop + fsync of the same bytes, in the same files (the floor)
//   save       CheckpointManager::save (safetensors + CRC-32 + index + marker + fsyncs)
//   raw_read   plain read() loop of the same files, page cache dropped first
//   load       CheckpointManager::load (mmap, CRC-32 verification, copy into the model)
//   async      time the training thread is blocked by AsyncCheckpointer::save (the stall)
// Model: MLP(width, {2 width, 2 width}, width) with AdamW, so a checkpoint holds
// parameters and two state tensors per parameter (3x the parameter bytes).
//
//   build/benchmarks/ckpt_bench --width 2048 --reps 5 --dir /tmp/ckpt_bench
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <ptrain/ckpt/async_writer.hpp>
#include <ptrain/ckpt/checkpoint.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/optim/adamw.hpp>

#include "bench_util.hpp"

using namespace ptrain;
namespace fs = std::filesystem;

namespace {

// Evicts a file's clean pages, so the next read comes from the device.
void drop_cache(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void raw_write(const fs::path& p, const std::uint8_t* data, std::size_t n) {
  ckpt::detail::WriteFd f(p.string());
  f.write_all(data, n);
  f.sync_close();
}

std::size_t raw_read(const fs::path& p, std::vector<std::uint8_t>& buf) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  std::size_t total = 0;
  for (;;) {
    const ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r <= 0) break;
    total += static_cast<std::size_t>(r);
  }
  ::close(fd);
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t width = 2048;
  int reps = 5;
  int keep = 1;
  std::string dir = "/tmp/ptrain_ckpt_bench";
  CLI::App app{"checkpoint save/load throughput vs raw I/O"};
  app.add_option("--width", width, "MLP width (parameters ~ 8 width^2)");
  app.add_option("--reps", reps, "timed repetitions (medians are reported)");
  app.add_option("--dir", dir, "scratch directory (removed at the end)");
  app.add_option("--keep", keep, "keep_last of the manager (0: keep all, so no deletion inside save)");
  CLI11_PARSE(app, argc, argv);

  fs::remove_all(dir);
  fs::create_directories(dir);
  Generator gen(0);
  nn::MLP<float> model(width, {2 * width, 2 * width}, width, nn::Activation::ReLU, gen);
  nn::FlatParameters<float> params(model);
  optim::AdamW<float> opt(params, {});
  for (auto& [kind, buf] : opt.flat_state())  // non-zero state, like a real run
    for (std::int64_t i = 0; i < buf.numel(); ++i) buf.data()[i] = static_cast<float>(i % 977) * 1e-3f;

  auto mgr_owner = std::make_unique<ckpt::CheckpointManager>(fs::path(dir) / "ckpt", nullptr,
                                                             ckpt::CheckpointOptions{.keep_last = keep});
  auto& mgr = *mgr_owner;
  std::int64_t step = 0;
  mgr.save(++step, params, &opt, {});  // warm-up; also gives the file sizes
  const fs::path last = mgr.step_path(step);
  const auto model_bytes = fs::file_size(last / "model.safetensors");
  const auto opt_bytes = fs::file_size(last / "optimizer.safetensors");
  const double total = static_cast<double>(model_bytes + opt_bytes);

  // The same bytes for the raw loop: one buffer per file, same sizes.
  std::vector<std::uint8_t> raw_a(model_bytes, 1), raw_b(opt_bytes, 2);
  std::vector<double> t_raw_w, t_save, t_raw_r, t_load, t_stall, t_async_total;
  std::vector<std::uint8_t> rbuf(std::size_t{64} << 20);
  for (int r = 0; r < reps; ++r) {
    double t0 = bench::now_ms();
    raw_write(fs::path(dir) / "raw_model.bin", raw_a.data(), raw_a.size());
    raw_write(fs::path(dir) / "raw_optimizer.bin", raw_b.data(), raw_b.size());
    t_raw_w.push_back(bench::now_ms() - t0);

    t0 = bench::now_ms();
    mgr.save(++step, params, &opt, {});
    t_save.push_back(bench::now_ms() - t0);

    for (const char* f : {"raw_model.bin", "raw_optimizer.bin"}) drop_cache(fs::path(dir) / f);
    t0 = bench::now_ms();
    raw_read(fs::path(dir) / "raw_model.bin", rbuf);
    raw_read(fs::path(dir) / "raw_optimizer.bin", rbuf);
    t_raw_r.push_back(bench::now_ms() - t0);

    const fs::path p = mgr.step_path(step);
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) drop_cache(p / f);
    t0 = bench::now_ms();
    mgr.load(p, params, &opt);
    t_load.push_back(bench::now_ms() - t0);
  }
  {
    ckpt::AsyncCheckpointer saver(mgr);
    saver.save(++step, params, &opt, {});  // first call allocates the host buffers
    saver.wait();
    for (int r = 0; r < reps; ++r) {
      const double t0 = bench::now_ms();
      saver.save(++step, params, &opt, {});
      t_stall.push_back(bench::now_ms() - t0);
      saver.wait();
      t_async_total.push_back(bench::now_ms() - t0);
    }
  }
  mgr_owner.reset();  // joins the background deletion of rotated checkpoints
  fs::remove_all(dir);

  auto line = [&](const char* what, const std::vector<double>& t) {
    const double ms = bench::median(t);
    nlohmann::json j = {{"bench", "ckpt"}, {"op", what}, {"bytes", total}, {"median_ms", ms},
                        {"GBps", total / (ms * 1e-3) / 1e9}, {"reps", reps}};
    std::printf("%s\n", j.dump().c_str());
    return ms;
  };
  const double w = line("raw_write", t_raw_w), s = line("save", t_save), rr = line("raw_read", t_raw_r),
               l = line("load", t_load), st = line("async_stall", t_stall), at = line("async_total", t_async_total);
  std::printf("\ncheckpoint of %.1f MB (model %.1f MB + AdamW state %.1f MB), medians of %d\n", total / 1e6,
              model_bytes / 1e6, opt_bytes / 1e6, reps);
  std::printf("  %-12s %9s %8s\n", "op", "ms", "GB/s");
  for (auto [n, ms] : {std::pair{"raw write", w}, {"save", s}, {"raw read", rr}, {"load", l}, {"async stall", st},
                       {"async total", at}})
    std::printf("  %-12s %9.1f %8.2f\n", n, ms, total / (ms * 1e-3) / 1e9);
  std::printf("  save / raw write bandwidth: %.2f   (target >= 0.7)\n", w / s);
  std::printf("  load / raw read bandwidth:  %.2f\n", rr / l);
  std::printf("  async stall / sync save:    %.3f  (target <= 0.10)\n", st / s);
  return 0;
}
