// Multi-process checkpoint tests. This driver is a single process that
// launches ckpt_trainer ranks (through ptrun, or directly with torchrun-style
// variables when each rank's exit status matters) and checks, against
// uninterrupted runs of the same program:
//   - SIGKILL of both ranks after a checkpoint, resume -> bitwise equal parameters
//   - SIGTERM to one rank -> every rank saves the same step and exits 0; resume is bitwise
//   - save on 2 ranks, load on 1, 2, 3: loaded tensors equal the files; the
//     sampler continues with every sample of the epoch exactly once
//   - sharded checkpoints (one file per rank): a missing shard makes latest()
//     fall back, resume is bitwise, and 2-rank shards load on 3 ranks
//   - an independent Python reader (json + struct + zlib + numpy, and torch,
//     which tools/install-deps.sh --test installs) reads the same values.
// Paths come from the environment (set by CTest): PTRAIN_CKPT_TRAINER, PTRUN,
// PTRAIN_CKPT_PY, and PTRAIN_CKPT_MPIEXEC to launch through mpirun instead of ptrun.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <ptrain/ckpt/checkpoint.hpp>
#include <ptrain/nn/models/mlp.hpp>

#include "dist/runtime/process_util.hpp"

namespace test_ckpt_dist {

using namespace ptrain;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
using ptrain_test::Process;

namespace {

std::string env_or_skip(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) FAIL(name << " is not set; run this test through CTest");
  return v;
}

// The launcher command for n ranks: ptrun (Gloo), or mpirun (MPI backend)
// when PTRAIN_CKPT_MPIEXEC is set.
std::vector<std::string> launcher(int n) {
  if (const char* mpi = std::getenv("PTRAIN_CKPT_MPIEXEC"); mpi && *mpi)
    return {mpi, "--oversubscribe", "-np", std::to_string(n), env_or_skip("PTRAIN_CKPT_TRAINER")};
  return {env_or_skip("PTRUN"), "--nproc-per-node", std::to_string(n), "--master-port", "0",
          env_or_skip("PTRAIN_CKPT_TRAINER")};
}

// Runs the trainer on n ranks; returns the launcher's exit code.
int run_ptrun(int n, const std::vector<std::string>& args, std::chrono::seconds timeout = 120s) {
  std::vector<std::string> argv = launcher(n);
  argv.insert(argv.end(), args.begin(), args.end());
  Process p(argv);
  auto st = p.wait(timeout);
  REQUIRE(st.has_value());
  return ptrain_test::exit_code(*st);
}

// Tensor name -> raw bytes of a safetensors file.
std::map<std::string, std::string> tensors_of(const std::string& path) {
  ckpt::SafetensorsReader r(path);
  std::map<std::string, std::string> out;
  for (const auto& e : r.tensors()) out[e.name] = std::string(reinterpret_cast<const char*>(r.data(e)), e.nbytes());
  return out;
}

// Tensor name -> values as double (F32 or F64 files).
std::map<std::string, std::vector<double>> values_of(const std::string& path) {
  ckpt::SafetensorsReader r(path);
  std::map<std::string, std::vector<double>> out;
  for (const auto& e : r.tensors()) {
    REQUIRE((e.dtype == DType::F32 || e.dtype == DType::F64));
    auto& v = out[e.name];
    if (e.dtype == DType::F64) {
      v.resize(e.nbytes() / 8);
      std::memcpy(v.data(), r.data(e), e.nbytes());
    } else {
      std::vector<float> f(e.nbytes() / 4);
      std::memcpy(f.data(), r.data(e), e.nbytes());
      v.assign(f.begin(), f.end());
    }
  }
  return out;
}

// Largest |a - b| over the largest |b|, over all tensors of two safetensors files.
double max_rel_diff(const std::string& a_path, const std::string& b_path) {
  auto a = values_of(a_path), b = values_of(b_path);
  REQUIRE(a.size() == b.size());
  double diff = 0, scale = 0;
  for (auto& [name, y] : b) {
    const auto& x = a[name];
    REQUIRE(x.size() == y.size());
    for (std::size_t i = 0; i < y.size(); ++i) {
      diff = std::max(diff, std::abs(x[i] - y[i]));
      scale = std::max(scale, std::abs(y[i]));
    }
  }
  return diff / scale;
}

// Runs on different numbers of ranks (a checkpoint reshaped on resume) are compared in
// double (ckpt_trainer --dtype f64). They see the same global batches, but the gradient
// average is summed in another order (1, 2, 3 or 4 ranks' partial sums; FSDP's shards cut
// the reduce-scatter elsewhere). In float, AdamW (lr 1e-2, eps 1e-8, 8 or 12 steps) is
// scale-free, m / (sqrt(v) + eps): a gradient within rounding of zero (|g| ~ 1e-7 of its
// terms) gets an update anywhere in [-lr, lr] depending on its last bits, so no float bound
// holds on every vector width (AVX2 and AVX-512 sum in other orders). In double the
// rounding is 2^-29 of float's: only gradients below ~1e-14 of their terms could be flipped
// so, and the runs agree to ~1e-13 relative (the model of test_pipeline.cpp's kDoubleTol).
// 1e-9 leaves four orders of margin; a shard from the wrong rank, a lost or misplaced
// optimizer state or a batch skipped or seen twice moves a weight by >= 1e-3 of the largest.
// Resumes on the same number of ranks stay in float and bitwise (SIGKILL, SIGTERM, sharded).
constexpr double kReshapeTol = 1e-9;

// run_ptrun of the trainer in double.
int run_f64(int n, std::vector<std::string> args) {
  args.insert(args.begin(), {"--dtype", "f64"});
  return run_ptrun(n, args);
}

std::int64_t committed_step(const fs::path& dir) {
  ckpt::CheckpointManager mgr(dir);
  auto last = mgr.latest();
  return last.found() ? last.step : -1;
}

// Waits until file has at least n lines; false after timeout.
bool wait_for_lines(const std::string& file, int n, std::chrono::seconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::ifstream f(file);
    int lines = 0;
    for (std::string line; std::getline(f, line);) ++lines;
    if (lines >= n) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(10ms);
  }
}

pid_t read_pid(const fs::path& file) {
  REQUIRE(ptrain_test::wait_for_file(file.string(), 30s));
  pid_t pid = 0;
  for (int i = 0; i < 200 && pid == 0; ++i) {
    std::ifstream(file) >> pid;
    if (pid == 0) std::this_thread::sleep_for(10ms);
  }
  REQUIRE(pid > 0);
  return pid;
}

}  // namespace

TEST_CASE("SIGKILL of both ranks after a checkpoint, resume gives bitwise equal parameters", "[ckpt][dist][kill]") {
  ptrain_test::TempDir tmp;
  const std::string ref = tmp.file("ref.safetensors"), out = tmp.file("out.safetensors"), dir = tmp.file("ckpt");
  REQUIRE(run_ptrun(2, {"--steps", "12", "--out", ref}) == 0);

  // Asynchronous checkpoints every 3 steps; kill both ranks once step 6 is committed.
  {
    std::vector<std::string> argv = launcher(2);
    for (const char* a : {"--dir", dir.c_str(), "--steps", "12", "--every", "3", "--async", "--sleep-ms", "60",
                          "--out", out.c_str()})
      argv.push_back(a);
    Process run(argv);
    const pid_t r0 = read_pid(fs::path(dir) / "pid-rank0"), r1 = read_pid(fs::path(dir) / "pid-rank1");
    REQUIRE(ptrain_test::wait_for_file(dir + "/step-00000006/COMMITTED", 60s));
    ::kill(r0, SIGKILL);
    ::kill(r1, SIGKILL);
    auto st = run.wait(30s);
    REQUIRE(st.has_value());
    CHECK(ptrain_test::exit_code(*st) != 0);
  }
  REQUIRE_FALSE(fs::exists(out));
  const std::int64_t j = committed_step(dir);
  CHECK(j >= 6);
  CHECK(j < 12);
  REQUIRE(run_ptrun(2, {"--dir", dir, "--steps", "12", "--every", "3", "--async", "--resume", "--out", out}) == 0);
  CHECK(tensors_of(out) == tensors_of(ref));
  // keep_last = 2: only the two newest checkpoints remain.
  int dirs = 0;
  for (auto& e : fs::directory_iterator(dir)) dirs += e.path().filename().string().rfind("step-", 0) == 0;
  CHECK(dirs == 2);
}

TEST_CASE("SIGTERM to one rank: all ranks save the same step and exit 0; resume is bitwise", "[ckpt][dist]") {
  ptrain_test::TempDir tmp;
  const std::string dir = tmp.file("ckpt"), samples = tmp.file("samples");
  const int port = ptrain_test::free_port();
  std::map<std::string, std::string> base;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) base[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  base["WORLD_SIZE"] = "2";
  base["LOCAL_WORLD_SIZE"] = "2";
  base["MASTER_ADDR"] = "127.0.0.1";
  base["MASTER_PORT"] = std::to_string(port);
  std::vector<Process> ranks;
  for (int r = 0; r < 2; ++r) {
    auto env = base;
    env["RANK"] = env["LOCAL_RANK"] = std::to_string(r);
    ranks.emplace_back(std::vector<std::string>{env_or_skip("PTRAIN_CKPT_TRAINER"), "--dir", dir, "--steps", "100000",
                                                "--sleep-ms", "20", "--samples-log", samples},
                       env);
  }
  read_pid(fs::path(dir) / "pid-rank0");
  read_pid(fs::path(dir) / "pid-rank1");
  // A few steps done: each rank logs a step's samples as it begins it, so a third line means
  // steps 1 and 2 are done on that rank (the handlers are installed already).
  for (int r = 0; r < 2; ++r)
    REQUIRE(wait_for_lines(samples + ".rank" + std::to_string(r), 3, 60s));
  ::kill(ranks[1].pid(), SIGTERM);  // as Kubernetes evicting one pod
  for (int r = 0; r < 2; ++r) {
    auto st = ranks[static_cast<std::size_t>(r)].wait(60s);
    REQUIRE(st.has_value());
    INFO("rank " << r);
    CHECK(ptrain_test::exit_code(*st) == 0);
  }
  const std::int64_t s = committed_step(dir);
  REQUIRE(s >= 1);
  const std::string k = std::to_string(s + 5);
  const std::string ref = tmp.file("ref.safetensors"), out = tmp.file("out.safetensors");
  REQUIRE(run_ptrun(2, {"--steps", k, "--out", ref}) == 0);
  REQUIRE(run_ptrun(2, {"--dir", dir, "--steps", k, "--resume", "--out", out}) == 0);
  CHECK(tensors_of(out) == tensors_of(ref));
}

TEST_CASE("save on 2 ranks, load on 1, 2 and 3 ranks", "[ckpt][dist][reshape]") {
  ptrain_test::TempDir tmp;
  // 96 samples, global batch 12: 8 steps per epoch. The checkpoint after 3
  // steps has consumed 36 samples, which 1, 2 and 3 ranks continue exactly.
  const std::string ref = tmp.file("ref.safetensors");
  REQUIRE(run_f64(2, {"--steps", "8", "--out", ref}) == 0);
  for (int m : {1, 2, 3}) {
    DYNAMIC_SECTION("load on " << m << " ranks") {
      const std::string dir = tmp.file("ckpt" + std::to_string(m)), log = tmp.file("samples" + std::to_string(m));
      const std::string out = tmp.file("out" + std::to_string(m) + ".safetensors");
      const std::string dump = tmp.file("loaded" + std::to_string(m));
      REQUIRE(run_f64(2, {"--dir", dir, "--steps", "3", "--every", "3", "--samples-log", log}) == 0);
      REQUIRE(run_f64(m, {"--dir", dir, "--steps", "8", "--resume", "--samples-log", log, "--dump-loaded", dump,
                          "--out", out}) == 0);
      // Every rank loaded exactly the parameters in the checkpoint file.
      ckpt::SafetensorsReader model(dir + "/step-00000003/model.safetensors");
      std::string expect;
      for (const char* name : {"0.weight", "0.bias", "2.weight", "2.bias"}) {
        const auto& e = model.entry(name);
        expect.append(reinterpret_cast<const char*>(model.data(e)), e.nbytes());
      }
      for (int r = 0; r < m; ++r) CHECK(ptrain_test::read_text(dump + ".rank" + std::to_string(r)) == expect);
      // Samples of epoch 0 over both runs: each of the 96 exactly once.
      std::vector<int> seen(96, 0);
      int lines = 0;
      for (int r = 0; r < std::max(m, 2); ++r) {
        std::ifstream f(log + ".rank" + std::to_string(r));
        std::string line;
        while (std::getline(f, line)) {
          std::istringstream ss(line);
          std::int64_t step, i;
          ss >> step;
          ++lines;
          while (ss >> i) ++seen[static_cast<std::size_t>(i)];
        }
      }
      CHECK(lines == 3 * 2 + 5 * m);
      for (int i = 0; i < 96; ++i) CHECK(seen[static_cast<std::size_t>(i)] == 1);
      // Same global batches, so the same training up to the rounding of the gradient
      // average over a different number of ranks (kReshapeTol).
      CHECK(max_rel_diff(out, ref) <= kReshapeTol);
      if (m == 2) CHECK(tensors_of(out) == tensors_of(ref));  // same world size: bitwise
    }
  }
}

TEST_CASE("sharded checkpoints: missing shard falls back, resume is bitwise, 2 shards load on 3 ranks",
          "[ckpt][dist][sharded]") {
  ptrain_test::TempDir tmp;
  const std::string ref = tmp.file("ref.safetensors"), out = tmp.file("out.safetensors"), dir = tmp.file("ckpt");
  REQUIRE(run_ptrun(2, {"--steps", "12", "--out", ref}) == 0);
  REQUIRE(run_ptrun(2, {"--sharded", "--dir", dir, "--steps", "9", "--every", "3"}) == 0);
  {
    // 176 flat elements (163 + alignment): rank 0 holds [0, 88), the first 88 of 0.weight's 96.
    ckpt::Checkpoint c(dir + "/step-00000009");
    CHECK(c.weight_map().at("0.weight@0") == "model-00000-of-00002.safetensors");
    CHECK(c.weight_map().at("0.weight@88") == "model-00001-of-00002.safetensors");
    CHECK(c.weight_map().at("0.bias") == "model-00001-of-00002.safetensors");  // whole: stored under its name
    CHECK(c.weight_map().at("0.weight.exp_avg_sq@0") == "optimizer-00000-of-00002.safetensors");
    CHECK(c.names_in("model-00001-of-00002.safetensors").size() == 4);
    CHECK(c.names_in("optimizer-00001-of-00002.safetensors").size() == 8);
    CHECK(c.tensor_names("model") == std::vector<std::string>{"0.bias", "0.weight", "2.bias", "2.weight"});
    CHECK(c.tensor_names("optimizer").size() == 8);
    CHECK(c.shape_of("0.weight") == Shape{16, 6});
    // A range across the cut reads from both ranks' files.
    auto all = Tensor<float>::empty({16, 6});
    c.read_into("0.weight", all);
    auto mid = Tensor<float>::empty({10});
    c.read_range("0.weight", 83, mid);
    for (int i = 0; i < 10; ++i) CHECK(mid.data()[i] == all.data()[83 + i]);
    CHECK_THROWS_WITH(c.read_range("0.weight", 90, mid), Catch::Contains("[ptrain.ckpt.range]"));
  }
  fs::remove(dir + "/step-00000009/model-00001-of-00002.safetensors");
  {
    ckpt::CheckpointManager mgr(dir);
    auto last = mgr.latest();
    CHECK(last.step == 6);
    REQUIRE(last.skipped.size() == 1);
    CHECK_THAT(last.skipped[0].reason, Catch::Contains("model-00001-of-00002.safetensors") &&
                                           Catch::Contains("missing"));
  }
  REQUIRE(run_ptrun(2, {"--sharded", "--dir", dir, "--steps", "12", "--every", "3", "--resume", "--out", out}) == 0);
  CHECK(tensors_of(out) == tensors_of(ref));
  // One unsharded file, as the final parameters.
  CHECK(committed_step(dir) == 12);
  const std::string exported = tmp.file("export.safetensors");
  ckpt::Checkpoint(dir + "/step-00000012").export_model(exported);
  CHECK(tensors_of(exported) == tensors_of(out));
  // Shards written by 2 ranks, read by 3: each rank assembles the whole tensors.
  const std::string dump = tmp.file("loaded");
  REQUIRE(run_ptrun(3, {"--sharded", "--dir", dir, "--steps", "14", "--resume", "--dump-loaded", dump}) == 0);
  ckpt::SafetensorsReader final_params(out);
  std::string expect;
  for (const char* name : {"0.weight", "0.bias", "2.weight", "2.bias"}) {
    const auto& e = final_params.entry(name);
    expect.append(reinterpret_cast<const char*>(final_params.data(e)), e.nbytes());
  }
  for (int r = 0; r < 3; ++r) CHECK(ptrain_test::read_text(dump + ".rank" + std::to_string(r)) == expect);
}

TEST_CASE("FSDP checkpoints: saved on 4 ranks, resumed on 2 and 3 with other strategies", "[ckpt][dist][fsdp]") {
  ptrain_test::TempDir tmp;
  const std::string ref = tmp.file("ref.safetensors"), dir = tmp.file("ckpt");
  // In double (run_f64): every comparison below is between different numbers of ranks.
  // Uninterrupted: 12 steps on 4 ranks, ZeRO-3.
  REQUIRE(run_f64(4, {"--fsdp", "full_shard", "--steps", "12", "--out", ref}) == 0);
  REQUIRE(run_f64(4, {"--fsdp", "full_shard", "--dir", dir, "--steps", "6", "--every", "6"}) == 0);
  {
    // The MLP's two groups (112 and 51 elements) cut over 4 ranks; every piece is recorded.
    ckpt::Checkpoint c(dir + "/step-00000006");
    CHECK(c.tensor_names("model") == std::vector<std::string>{"0.bias", "0.weight", "2.bias", "2.weight"});
    CHECK(c.weight_map().count("0.weight@28"));
    // Rank 3: elements [84, 112) of group 0 and [39, 52) of group 1 (51 padded to 52).
    CHECK(c.names_in("model-00003-of-00004.safetensors") ==
          std::vector<std::string>{"0.bias", "0.weight@84", "2.bias", "2.weight@39"});
  }
  fs::copy(dir, tmp.file("ckpt3"), fs::copy_options::recursive);
  fs::copy(dir, tmp.file("ckpt_hybrid"), fs::copy_options::recursive);
  const std::string on2 = tmp.file("on2.safetensors"), on3 = tmp.file("on3.safetensors");
  REQUIRE(run_f64(2, {"--fsdp", "full_shard", "--dir", dir, "--steps", "12", "--every", "6", "--resume",
                      "--out", on2}) == 0);
  REQUIRE(run_f64(3, {"--fsdp", "shard_grad_op", "--dir", tmp.file("ckpt3"), "--steps", "12", "--resume",
                      "--out", on3}) == 0);
  CHECK(max_rel_diff(on2, ref) <= kReshapeTol);
  CHECK(max_rel_diff(on3, ref) <= kReshapeTol);
  // The 2-rank run's final checkpoint, exported whole, is its final parameters.
  const std::string exported = tmp.file("export.safetensors");
  ckpt::Checkpoint(dir + "/step-00000012").export_model(exported);
  CHECK(tensors_of(exported) == tensors_of(on2));
  // Hybrid (2 shard groups of 2): only one replica writes; 3 ranks resume from it.
  const std::string hyb = tmp.file("ckpt_hybrid"), on3h = tmp.file("on3h.safetensors");
  REQUIRE(run_f64(4, {"--fsdp", "hybrid", "--dir", hyb, "--steps", "9", "--every", "9", "--resume"}) == 0);
  {
    ckpt::Checkpoint c(hyb + "/step-00000009");
    CHECK(c.names_in("model-00002-of-00004.safetensors").empty());
    CHECK(c.names_in("model-00003-of-00004.safetensors").empty());
  }
  REQUIRE(run_f64(3, {"--fsdp", "full_shard", "--dir", hyb, "--steps", "12", "--resume", "--out", on3h}) == 0);
  CHECK(max_rel_diff(on3h, ref) <= kReshapeTol);
  // A data-parallel checkpoint (save(): whole tensors from rank 0) loads into FSDP too.
  const std::string ddp = tmp.file("ddp"), from_ddp = tmp.file("from_ddp.safetensors");
  REQUIRE(run_f64(2, {"--dir", ddp, "--steps", "6", "--every", "6"}) == 0);
  REQUIRE(run_f64(3, {"--fsdp", "full_shard", "--dir", ddp, "--steps", "12", "--resume", "--out", from_ddp}) == 0);
  CHECK(max_rel_diff(from_ddp, ref) <= kReshapeTol);
  // A checkpoint of another model (hidden width 8) is refused: exit code 1, no hang.
  CHECK(run_f64(2, {"--fsdp", "full_shard", "--hidden", "8", "--dir", ddp, "--steps", "14", "--resume"}) == 1);
}

TEST_CASE("an independent Python reader sees the same values", "[ckpt][dist][python]") {
  ptrain_test::TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  REQUIRE(run_ptrun(2, {"--dir", dir, "--steps", "4", "--every", "4"}) == 0);
  const std::string json_out = tmp.file("py.json");
  const std::string cmd = "/usr/bin/python3 " + env_or_skip("PTRAIN_CKPT_PY") + " " + dir + "/step-00000004 " + json_out;
  REQUIRE(std::system(cmd.c_str()) == 0);
  auto py = nlohmann::json::parse(ptrain_test::read_text(json_out));
  ckpt::Checkpoint c(dir + "/step-00000004");
  std::size_t compared = 0;
  for (const auto& [name, file] : c.weight_map()) {
    INFO(name);
    const auto& r = c.file(file);
    const auto& e = r.entry(name);
    REQUIRE(e.dtype == DType::F32);
    std::vector<float> mine(e.nbytes() / 4);
    std::memcpy(mine.data(), r.data(e), e.nbytes());
    const auto& theirs = py["tensors"][name];
    REQUIRE(theirs.size() == mine.size());
    for (std::size_t i = 0; i < mine.size(); ++i) CHECK(theirs[i].get<double>() == static_cast<double>(mine[i]));
    ++compared;
  }
  CHECK(compared == 12);  // 4 parameters, 2 AdamW states each
  CHECK(py["tensors"].size() >= compared);
  if (py["torch"] != "ok")
    FAIL("PyTorch interop not checked: " << py["torch"].get<std::string>()
         << "; run tools/install-deps.sh --test (it installs python3-torch)");
  // PyTorch loaded model.safetensors into nn.Sequential(Linear, ReLU, Linear)
  // with strict=True and ran it; ptrain's MLP with the same file agrees.
  Generator g(0);
  nn::MLP<float> model(6, {16}, 3, nn::Activation::ReLU, g);
  nn::FlatParameters<float> params(model);
  ckpt::CheckpointManager(dir).load(dir + "/step-00000004", params);
  auto x = Tensor<float>::empty({1, 6});
  for (int i = 0; i < 6; ++i) x.data()[i] = -1.0f + 0.4f * static_cast<float>(i);
  nn::Cache<float> cache;
  auto y = model.forward(x, cache);
  const auto& ty = py["tensors"]["__torch_forward__"];
  REQUIRE(ty.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(std::abs(ty[static_cast<std::size_t>(i)].get<double>() - y.data()[i]) < 1e-5);
}

}  // namespace test_ckpt_dist
