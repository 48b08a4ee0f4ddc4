// DDP against one process. Every rank runs every test case in the same order,
// so collectives line up; value checks use CHECK (never REQUIRE) so a wrong
// value cannot make one rank skip collectives the others still call.
//
// Reference: the same model, trained in this process without communication on
// the global batch (all ranks' rows), which DDP must reproduce.
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <ptrain/dist/process_group.hpp>

#include "dist/frozen_model.hpp"
#include "dist/world.hpp"
#include <ptrain/nn/loss.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/optim/sgd.hpp>
#include <ptrain/parallel/ddp.hpp>

namespace test_ddp {

using namespace ptrain;
using ptrain::testing::world;

namespace {

// A deterministic global batch: features in [-1, 1), labels in [0, classes).
template <class T>
struct Batch {
  Tensor<T> x;
  Tensor<std::int32_t> y;
};
template <class T>
Batch<T> make_batch(std::int64_t rows, std::int64_t features, std::int32_t classes, std::uint64_t seed) {
  Generator g(seed);
  Batch<T> b{Tensor<T>::empty({rows, features}), Tensor<std::int32_t>::empty({rows})};
  ops::uniform_(b.x, -1.0, 1.0, g);
  for (std::int64_t i = 0; i < rows; ++i) b.y.data()[i] = static_cast<std::int32_t>(g.below(classes));
  return b;
}

enum class Opt { SGD, AdamW };

template <class T>
std::unique_ptr<optim::Optimizer<T>> make_opt(Opt kind, nn::FlatParameters<T>& p) {
  if (kind == Opt::SGD) return std::make_unique<optim::SGD<T>>(p, optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  // eps 1e-6 rather than 1e-8: AdamW's step is lr * g / (|g| + eps), so for a
  // coordinate whose exact gradient is ~0, float rounding noise of ~1e-10 in g
  // (present in any summation order) would move it by up to lr / 100.
  return std::make_unique<optim::AdamW<T>>(p, optim::AdamWOptions{.lr = 0.01, .eps = 1e-6});
}

// One training step on (x, y) for a plain module; the loss gradient is scaled by dloss.
template <class T>
void local_step(nn::Module<T>& m, nn::FlatParameters<T>& p, optim::Optimizer<T>& opt, const Batch<T>& b) {
  nn::CrossEntropyLoss<T> ce;
  nn::Cache<T> c, lc;
  p.zero_grad();
  ce.forward(m.forward(b.x, c), b.y, lc);
  m.backward(ce.backward(lc), c);
  opt.step();
}

// Relative error of a parameter buffer: max |a - b| / max |b|. Not per element:
// AdamW divides each coordinate's step by that coordinate's gradient magnitude,
// so a coordinate whose gradient nearly cancels over the batch turns float
// rounding into a large relative change of a tiny parameter, in any summation order.
template <class T>
double rel_error(const Tensor<T>& a, const Tensor<T>& b) {
  double diff = 0, scale = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a.data()[i]) - static_cast<double>(b.data()[i])));
    scale = std::max(scale, std::abs(static_cast<double>(b.data()[i])));
  }
  return diff / scale;
}

template <class T>
void check_matches_single_process(Opt kind, parallel::DDPOptions ddp_opt, double tol) {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  const std::int64_t B = 6, features = 10, steps = 3;
  Generator ga(5), gb(5);
  nn::MLP<T> ref(features, {16, 12}, 4, nn::Activation::GELU, ga);
  nn::MLP<T> model(features, {16, 12}, 4, nn::Activation::GELU, gb);
  nn::FlatParameters<T> ref_p(ref), p(model);
  auto ref_opt = make_opt(kind, ref_p);
  auto opt = make_opt(kind, p);
  parallel::DDP<T> ddp(model, p, comm, ddp_opt);
  CHECK(ddp.num_buckets() >= 1);
  nn::CrossEntropyLoss<T> ce;
  for (std::int64_t s = 0; s < steps; ++s) {
    auto global = make_batch<T>(n * B, features, 4, 100 + static_cast<std::uint64_t>(s));
    local_step(ref, ref_p, *ref_opt, global);
    Batch<T> mine{global.x.narrow(r * B, B), global.y.narrow(r * B, B)};
    nn::Cache<T> c, lc;
    p.zero_grad();
    ce.forward(ddp.forward(mine.x, c), mine.y, lc);
    ddp.backward(ce.backward(lc), c);
    ddp.finish_gradient_sync();
    opt->step();
  }
  const double diff = rel_error(p.values(), ref_p.values());
  INFO("rank " << r << " of " << n << ": relative error " << diff);
  CHECK(diff <= tol);
}

}  // namespace

TEST_CASE("DDP equals one process on the global batch", "[ddp]") {
  parallel::DDPOptions small{.bucket_cap_bytes = 512, .first_bucket_bytes = 128};  // several buckets
  check_matches_single_process<double>(Opt::SGD, {}, 1e-12);
  check_matches_single_process<double>(Opt::AdamW, small, 1e-12);
  // Float through DDP's buckets with SGD only (lr 0.1, momentum 0.9, 3 steps; linear in the
  // gradient): the all-reduce sums <= 4 ranks' partial sums of <= 6 rows, one process all rows
  // at once: |dg| <= (24 + 16) u sum|terms| ~ 2.4e-6 of gradients of at most ~1, moved by
  // lr (1 + 1.9 + 2.71) = 0.56 into ~1.3e-6 against weights of ~0.3: <= 5e-6, so 1e-5 holds on
  // any vector width; a missing or unaveraged all-reduce moves a weight by ~1e-2. AdamW in float
  // is left out: it multiplies the rounding of near-zero gradients by up to lr / eps = 1e4,
  // and DDP leaves the optimizer alone, so AdamW is covered by the double case above.
  check_matches_single_process<float>(Opt::SGD, small, 1e-5);
  check_matches_single_process<float>(Opt::SGD, {}, 1e-5);
}

// bf16 parameters and gradients: each rank's gradient is rounded to bf16
// before the all-reduce, which averages in float and rounds once, while the
// reference rounds the gradient of the global batch once. Both are within a
// few bf16 roundings (2^-9 relative each) of the same value: bound 2e-2 of the
// largest gradient.
TEST_CASE("DDP on bf16 parameters averages gradients like one process", "[ddp][bf16]") {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  const std::int64_t B = 6, features = 10;
  Generator ga(5), gb(5);
  nn::MLP<bf16> ref(features, {16, 12}, 4, nn::Activation::GELU, ga);
  nn::MLP<bf16> model(features, {16, 12}, 4, nn::Activation::GELU, gb);
  nn::FlatParameters<bf16> ref_p(ref), p(model);
  parallel::DDP<bf16> ddp(model, p, comm, {.bucket_cap_bytes = 256, .first_bucket_bytes = 64});
  nn::CrossEntropyLoss<bf16> ce;
  auto global = make_batch<bf16>(n * B, features, 4, 100);
  nn::Cache<bf16> c, lc;
  ref_p.zero_grad();
  ce.forward(ref.forward(global.x, c), global.y, lc);
  ref.backward(ce.backward(lc), c);
  p.zero_grad();
  ce.forward(ddp.forward(global.x.narrow(r * B, B), c), global.y.narrow(r * B, B), lc);
  ddp.backward(ce.backward(lc), c);
  ddp.finish_gradient_sync();
  const auto got = p.grads().to_vector(), want = ref_p.grads().to_vector();
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double a = static_cast<float>(got[i]), b = static_cast<float>(want[i]);
    diff = std::max(diff, std::abs(a - b));
    scale = std::max(scale, std::abs(b));
  }
  INFO("rank " << r << " of " << n << ": gradient relative error " << diff / scale);
  CHECK(scale > 0);
  CHECK(diff <= 2e-2 * scale);
}

TEST_CASE("DDP buckets cover the gradient buffer in reverse order", "[ddp]") {
  Generator g(1);
  nn::MLP<float> model(10, {16, 12}, 4, nn::Activation::ReLU, g);
  nn::FlatParameters<float> p(model);
  parallel::DDP<float> ddp(model, p, world(), {.bucket_cap_bytes = 512, .first_bucket_bytes = 128});
  CHECK(ddp.num_buckets() > 2);
  std::int64_t end = p.numel();
  for (std::size_t b = 0; b < ddp.num_buckets(); ++b) {
    auto [lo, hi] = ddp.bucket_range(b);
    CHECK(hi == end);
    CHECK(lo < hi);
    end = lo;
  }
  CHECK(end == 0);
}

TEST_CASE("no_sync accumulation over micro-batches equals one large batch", "[ddp]") {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  const std::int64_t B = 4, k = 3, features = 8;
  Generator ga(9), gb(9);
  nn::MLP<double> ref(features, {10}, 3, nn::Activation::ReLU, ga);
  nn::MLP<double> model(features, {10}, 3, nn::Activation::ReLU, gb);
  nn::FlatParameters<double> ref_p(ref), p(model);
  optim::SGD<double> ref_opt(ref_p, {.lr = 0.5}), opt(p, {.lr = 0.5});
  parallel::DDP<double> ddp(model, p, comm, {.bucket_cap_bytes = 256, .first_bucket_bytes = 64});

  // Global batch: k micro-batches of n*B rows; micro-batch j, rank r takes rows [j*n*B + r*B, +B).
  auto global = make_batch<double>(k * n * B, features, 3, 77);
  local_step(ref, ref_p, ref_opt, global);

  nn::CrossEntropyLoss<double> ce;
  p.zero_grad();
  for (std::int64_t j = 0; j < k; ++j) {
    nn::Cache<double> c, lc;
    const std::int64_t start = j * n * B + r * B;
    ce.forward(ddp.forward(global.x.narrow(start, B), c), global.y.narrow(start, B), lc);
    auto d = ce.backward(lc, 1.0 / static_cast<double>(k));
    if (j + 1 < k) {
      auto guard = ddp.no_sync();
      ddp.backward(d, c);
      ddp.finish_gradient_sync();  // a no-op under no_sync
    } else {
      ddp.backward(d, c);
      ddp.finish_gradient_sync();
    }
  }
  opt.step();
  const double diff = rel_error(p.values(), ref_p.values());
  INFO("relative error " << diff);
  CHECK(diff <= 1e-12);
}

TEST_CASE("the first bucket's all-reduce starts before backward ends", "[ddp]") {
  Generator g(3);
  nn::MLP<float> model(64, {256, 256, 256}, 10, nn::Activation::ReLU, g);
  nn::FlatParameters<float> p(model);
  parallel::DDP<float> ddp(model, p, world(), {.bucket_cap_bytes = 64 << 10, .first_bucket_bytes = 16 << 10});
  auto b = make_batch<float>(32, 64, 10, 4);
  nn::CrossEntropyLoss<float> ce;
  nn::Cache<float> c, lc;
  ce.forward(ddp.forward(b.x, c), b.y, lc);
  ddp.backward(ce.backward(lc), c);
  const double backward_end =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  ddp.finish_gradient_sync();
  const auto& ev = ddp.bucket_events();
  REQUIRE(ev.size() == ddp.num_buckets());
  CHECK(ev.size() >= 3);
  CHECK(ev.front().bucket == 0);
  CHECK(ev.front().launched < backward_end);
  // More than one bucket went out while backward still ran.
  std::size_t during = 0;
  for (auto& e : ev) during += e.launched < backward_end;
  CHECK(during >= 2);
}

namespace {
// Two heads; forward uses head A on even ranks and head B on odd ranks, so
// each rank leaves some parameters without a gradient.
class TwoHeads : public nn::Module<double> {
 public:
  TwoHeads(bool use_a, Generator& g) : use_a_(use_a) {
    a_ = register_module("a", std::make_shared<nn::Linear<double>>(4, 2, true, g));
    b_ = register_module("b", std::make_shared<nn::Linear<double>>(4, 2, true, g));
  }
  Tensor<double> forward(const Tensor<double>& x, nn::Cache<double>& c) override {
    return (use_a_ ? a_ : b_)->forward(x, c);
  }
  Tensor<double> backward(const Tensor<double>& dy, nn::Cache<double>& c) override {
    return (use_a_ ? a_ : b_)->backward(dy, c);
  }
  std::string describe() const override { return "TwoHeads"; }
  std::shared_ptr<nn::Linear<double>> a_, b_;
  bool use_a_;
};
}  // namespace

TEST_CASE("parameters unused on some ranks do not deadlock and are averaged", "[ddp]") {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  Generator g(8);
  TwoHeads model(r % 2 == 0, g);
  nn::FlatParameters<double> p(model);
  parallel::DDP<double> ddp(model, p, comm, {.bucket_cap_bytes = 64, .first_bucket_bytes = 64});
  auto x = Tensor<double>::full({1, 4}, 1.0 + r);
  nn::Cache<double> c;
  p.zero_grad();
  ddp.forward(x, c);
  ddp.backward(Tensor<double>::full({1, 2}, 1.0), c);
  ddp.finish_gradient_sync();
  // Reference: head A's weight gradient on rank q is (1 + q) for even q, 0 for odd q; averaged over n.
  double expect_a = 0, expect_b = 0;
  for (int q = 0; q < n; ++q) (q % 2 == 0 ? expect_a : expect_b) += (1.0 + q) / n;
  CHECK(model.a_->weight().grad.data()[0] == Approx(expect_a).epsilon(1e-14));
  CHECK(model.b_->weight().grad.data()[0] == Approx(expect_b).epsilon(1e-14));
}

TEST_CASE("DDP runs are bitwise reproducible", "[ddp]") {
  auto run = [] {
    Generator g(21);
    nn::MLP<float> model(12, {32, 32}, 5, nn::Activation::GELU, g);
    nn::FlatParameters<float> p(model);
    optim::AdamW<float> opt(p, {.lr = 0.01});
    parallel::DDP<float> ddp(model, p, world(), {.bucket_cap_bytes = 1024, .first_bucket_bytes = 256});
    nn::CrossEntropyLoss<float> ce;
    for (int s = 0; s < 3; ++s) {
      auto b = make_batch<float>(8, 12, 5, 1000 + static_cast<std::uint64_t>(s * 10 + world().rank()));
      nn::Cache<float> c, lc;
      p.zero_grad();
      ce.forward(ddp.forward(b.x, c), b.y, lc);
      ddp.backward(ce.backward(lc), c);
      ddp.finish_gradient_sync();
      opt.step();
    }
    return p.values().to_vector();
  };
  CHECK(run() == run());
}

TEST_CASE("bf16 gradient compression stays within bf16 precision", "[ddp]") {
  auto& comm = world();
  auto grads = [&](DType comp) {
    Generator g(31);
    nn::MLP<float> model(12, {24}, 5, nn::Activation::ReLU, g);
    nn::FlatParameters<float> p(model);
    parallel::DDP<float> ddp(model, p, comm, {.bucket_cap_bytes = 512, .first_bucket_bytes = 128,
                                              .reduce_dtype = comp});
    auto b = make_batch<float>(8, 12, 5, 2000 + static_cast<std::uint64_t>(comm.rank()));
    nn::CrossEntropyLoss<float> ce;
    nn::Cache<float> c, lc;
    p.zero_grad();
    ce.forward(ddp.forward(b.x, c), b.y, lc);
    ddp.backward(ce.backward(lc), c);
    ddp.finish_gradient_sync();
    return p.grads().clone();
  };
  auto exact = grads(DType::F32);
  auto bf = grads(DType::BF16);
  double worst = 0, scale = 0;
  for (std::int64_t i = 0; i < exact.numel(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(exact.data()[i] - bf.data()[i])));
    scale = std::max(scale, static_cast<double>(std::abs(exact.data()[i])));
  }
  INFO("max abs difference " << worst << " of max gradient " << scale);
  CHECK(worst <= 1e-2 * scale);
  CHECK(worst > 0.0);  // the compressed path was really taken
}

TEST_CASE("averaging metrics across ranks", "[ddp]") {
  auto& comm = world();
  Generator g(2);
  nn::Linear<double> lin(2, 2, true, g);
  nn::FlatParameters<double> p(lin);
  parallel::DDP<double> ddp(lin, p, comm);
  CHECK(ddp.average(static_cast<double>(comm.rank())) == Approx((comm.size() - 1) / 2.0));
}

TEST_CASE("ranks with different models get a clear error on every rank", "[ddp]") {
  auto& comm = world();
  Generator g(4);
  // Rank 1 builds a wider hidden layer.
  nn::MLP<float> model(6, {comm.rank() == 1 ? 9 : 8}, 3, nn::Activation::ReLU, g);
  nn::FlatParameters<float> p(model);
  bool threw = false;
  try {
    parallel::DDP<float> ddp(model, p, comm);
  } catch (const Error& e) {
    threw = true;
    const std::string msg = e.what();
    CHECK(msg.find("[ptrain.parallel.mismatch]") != std::string::npos);
    CHECK(msg.find("parameter #0") != std::string::npos);
    CHECK(msg.find("rank 1: 0.weight [9, 6] F32") != std::string::npos);
    CHECK(msg.find("rank 0: 0.weight [8, 6] F32") != std::string::npos);
  }
  CHECK(threw == (comm.size() > 1));
}

namespace {
// Note [Frozen parameters under DDP]: testing::frozen_mlp (two of its four layers
// frozen) under DDP against one process on the global batch, AdamW with weight
// decay. Ranks other than 0 build the model from another seed, so only the initial
// broadcast of the frozen values (as of the trainable ones) makes the replicas equal.
template <class T>
void check_frozen_matches_single_process(double tol) {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  const std::int64_t B = 6, features = 10, steps = 4;
  Generator ga(7), gb(7 + static_cast<std::uint64_t>(r));
  auto ref = testing::frozen_mlp<T>(ga);
  auto model = testing::frozen_mlp<T>(gb);
  nn::FlatParameters<T> ref_p(*ref);
  const auto frozen_before = ref_p.frozen_values().to_vector();
  parallel::DDP<T> ddp(*model, comm, {.bucket_cap_bytes = 256, .first_bucket_bytes = 64});
  auto& p = ddp.parameters();
  const optim::AdamWOptions adam{.lr = 0.01, .eps = 1e-6, .weight_decay = 0.1};
  optim::AdamW<T> ref_opt(ref_p, adam), opt(p, adam);
  // Buckets cover exactly the trainable gradients; frozen parameters have none and no hook.
  CHECK(p.entries().size() == 4);
  CHECK(p.frozen_entries().size() == 4);
  std::int64_t covered = 0;
  for (std::size_t b = 0; b < ddp.num_buckets(); ++b) covered += ddp.bucket_range(b).second - ddp.bucket_range(b).first;
  CHECK(covered == p.numel());
  for (const auto& e : p.frozen_entries()) {
    CHECK(!e.param->grad.defined());
    CHECK(!e.param->on_grad_ready);
  }
  nn::CrossEntropyLoss<T> ce;
  for (std::int64_t s = 0; s < steps; ++s) {
    auto global = make_batch<T>(n * B, features, 4, 300 + static_cast<std::uint64_t>(s));
    nn::Cache<T> rc, rlc;
    ref_p.zero_grad();
    ce.forward(ref->forward(global.x, rc), global.y, rlc);
    ref->backward(ce.backward(rlc), rc);
    const double ref_norm = optim::clip_grad_norm_(ref_p.grads(), 1.0);
    ref_opt.step();
    nn::Cache<T> c, lc;
    ddp.zero_grad();
    ce.forward(ddp.forward(global.x.narrow(r * B, B), c), global.y.narrow(r * B, B), lc);
    ddp.backward(ce.backward(lc), c);
    const double norm = ddp.clip_grad_norm_(1.0);  // over the trainable gradients only
    CHECK(std::abs(norm - ref_norm) <= tol * ref_norm);
    ddp.step(opt);
  }
  const double diff = rel_error(p.values(), ref_p.values());
  INFO("frozen MLP, rank " << r << " of " << n << ": relative error " << diff);
  CHECK(diff <= tol);
  CHECK(p.frozen_values().to_vector() == frozen_before);  // bit for bit
}
}  // namespace

TEST_CASE("DDP with frozen parameters equals one process; frozen values stay bit for bit", "[ddp][frozen]") {
  check_frozen_matches_single_process<double>(1e-9);
  check_frozen_matches_single_process<float>(2e-4);
}

// docs/finetuning.md, "Frozen parameters under DDP, FSDP, pipeline and TP": per rank,
// 4 (P + P + 2P) + 4F bytes for float AdamW (values, gradients, two moments; frozen values
// alone), P and F the trainable and frozen elements as FlatParameters pads them.
TEST_CASE("DDP with frozen parameters holds the bytes of the formula", "[ddp][frozen][memory]") {
  const auto before = memory_stats().live_bytes;
  Generator g(3);
  auto model = testing::frozen_mlp<float>(g);
  parallel::DDP<float> ddp(*model, world());
  optim::AdamW<float> opt(ddp.parameters(), {});
  const auto bytes = memory_stats().live_bytes - before;
  const std::int64_t P = ddp.parameters().numel(), F = ddp.parameters().frozen_values().numel();
  INFO("P " << P << ", F " << F << ": " << bytes << " bytes");
  CHECK(F > 0);
  CHECK(bytes == 16 * P + 4 * F);
}

}  // namespace test_ddp
