// The mixture-of-experts layer (nn/moe.hpp) on the CPU, in double. The reference
// is a plain per-token loop written here from the formulas of docs/moe.md: each
// token's logits, scores, top k (ties to the lower index), weights, its experts'
// SwiGLU outputs, capacity counted in token order, the shared experts, the
// load-balancing loss and the z-loss. Its forward is compared with the layer's,
// and its central differences (of sum(y R) + the auxiliary losses with their
// coefficients) with the layer's backward, for the input and every parameter.
// The router alone, the experts alone and the whole layer are also checked by
// finite differences of their own forwards.
#include <catch2/catch.hpp>

#include "unit/host_backend.hpp"
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <numeric>
#include <type_traits>
#include <utility>
#include <ptrain/nn/flat_parameters.hpp>
#include <ptrain/nn/loss.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/nn/moe.hpp>
#include <ptrain/nn/recompute.hpp>
#include <ptrain/nn/sequential.hpp>
#include <ptrain/dist/self_communicator.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/expert_parallel.hpp>
#include <vector>

#include "unit/gradcheck.hpp"

namespace test_moe {

using namespace ptrain;
using Catch::Matchers::Contains;
using kernels::MoeScore;
using ptrain::testing::check_module_gradients;
using ptrain::testing::dot;
using ptrain::testing::random_tensor;

namespace {

void randomize(nn::Module<double>& m, std::uint64_t seed) {
  Generator g(seed);
  for (auto& p : m.named_parameters()) ops::uniform_(p.param->value, -0.6, 0.6, g);
}

double silu(double v) { return v / (1 + std::exp(-v)); }
double sigmoid(double v) { return 1 / (1 + std::exp(-v)); }

// W [out, in] times the vector v [in].
std::vector<double> matvec(const Tensor<double>& W, const std::vector<double>& v) {
  const std::int64_t out = W.size(0), in = W.size(1);
  std::vector<double> r(static_cast<std::size_t>(out), 0.0);
  for (std::int64_t o = 0; o < out; ++o)
    for (std::int64_t i = 0; i < in; ++i) r[std::size_t(o)] += W.data()[o * in + i] * v[std::size_t(i)];
  return r;
}

// down(silu(gate v) * up v).
std::vector<double> swiglu_ref(const Tensor<double>& gate, const Tensor<double>& up, const Tensor<double>& down,
                               const std::vector<double>& v) {
  auto g = matvec(gate, v), u = matvec(up, v);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = silu(g[i]) * u[i];
  return matvec(down, g);
}

struct Reference {
  std::vector<double> y;
  double aux = 0, z = 0;
  std::vector<std::int64_t> routed;
  std::int64_t dropped = 0;
};

// The layer, token by token.
Reference naive_moe(nn::MoE<double>& m, const Tensor<double>& x) {
  const nn::MoeConfig& c = m.config();
  const std::int64_t C = c.n_embd, E = c.num_experts, k = c.top_k, N = x.numel() / C;
  const double cap = c.capacity_factor > 0 ? std::ceil(c.capacity_factor * double(N * k) / double(E)) : 1e300;
  Reference r;
  r.y.assign(static_cast<std::size_t>(N * C), 0.0);
  r.routed.assign(static_cast<std::size_t>(E), 0);
  std::vector<double> P(static_cast<std::size_t>(E), 0.0);
  std::vector<std::int64_t> kept(static_cast<std::size_t>(E), 0);
  for (std::int64_t t = 0; t < N; ++t) {
    const std::vector<double> xt(x.data() + t * C, x.data() + (t + 1) * C);
    const auto l = matvec(m.router().weight().value, xt);
    double z = 0;
    for (double v : l) z += std::exp(v);
    const double lse = std::log(z);
    r.z += lse * lse / double(N);
    std::vector<double> s(l.size());
    for (std::size_t e = 0; e < l.size(); ++e)
      s[e] = c.score == MoeScore::Softmax ? std::exp(l[e]) / z : sigmoid(l[e]);
    const double ssum = std::accumulate(s.begin(), s.end(), 0.0);
    for (std::size_t e = 0; e < s.size(); ++e) P[e] += (c.score == MoeScore::Softmax ? s[e] : s[e] / ssum) / double(N);
    std::vector<std::int64_t> order(static_cast<std::size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return s[std::size_t(a)] > s[std::size_t(b)]; });
    double wsum = 0;
    for (std::int64_t j = 0; j < k; ++j) wsum += s[std::size_t(order[std::size_t(j)])];
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t e = order[std::size_t(j)];
      ++r.routed[std::size_t(e)];
      if (double(kept[std::size_t(e)]) >= cap) {
        ++r.dropped;
        continue;
      }
      ++kept[std::size_t(e)];
      const double w = s[std::size_t(e)] / (c.renormalize ? wsum : 1.0) * c.routed_scale;
      auto& ex = m.experts().expert(e);
      const auto ye = swiglu_ref(ex.w1().weight().value, ex.w3().weight().value, ex.w2().weight().value, xt);
      for (std::int64_t i = 0; i < C; ++i) r.y[std::size_t(t * C + i)] += w * ye[std::size_t(i)];
    }
    if (auto* sh = m.shared_experts()) {
      const auto ys = swiglu_ref(sh->gate_proj().weight().value, sh->up_proj().weight().value,
                                 sh->down_proj().weight().value, xt);
      const double g = m.shared_expert_gate() ? sigmoid(matvec(m.shared_expert_gate()->weight().value, xt)[0]) : 1.0;
      for (std::int64_t i = 0; i < C; ++i) r.y[std::size_t(t * C + i)] += g * ys[std::size_t(i)];
    }
  }
  for (std::int64_t e = 0; e < E; ++e) r.aux += double(E) * double(r.routed[std::size_t(e)]) / double(N) * P[std::size_t(e)];
  return r;
}

// Central differences of loss() in the coordinates of v (shares the tensor's storage), every
// `stride`-th one, against analytic; |a - n| <= tol max(1, |n|).
void require_fd(Tensor<double> v, const std::vector<double>& analytic, const std::function<double()>& loss,
                const std::string& what, std::int64_t stride = 1, double tol = 1e-7) {
  REQUIRE(static_cast<std::size_t>(v.numel()) == analytic.size());
  const double h = 1e-5;
  for (std::int64_t i = 0; i < v.numel(); i += stride) {
    const double orig = v.data()[i];
    v.data()[i] = orig + h;
    const double lp = loss();
    v.data()[i] = orig - h;
    const double lm = loss();
    v.data()[i] = orig;
    const double numeric = (lp - lm) / (2 * h), a = analytic[std::size_t(i)];
    INFO(what << " element " << i << ": analytic " << a << ", numeric " << numeric);
    REQUIRE(std::abs(a - numeric) <= tol * std::max(1.0, std::abs(numeric)));
  }
}

// Backward of m at x against central differences of `loss` for the input and every parameter.
template <class M>
void check_against(M& m, Tensor<double> x, const Tensor<double>& R, const std::function<double()>& loss,
                   std::int64_t stride = 1) {
  nn::Cache<double> cache;
  m.forward(x, cache);
  m.zero_grad();
  const auto dx = m.backward(R, cache);
  require_fd(x, dx.to_vector(), loss, "input", stride);
  for (auto& p : m.named_parameters()) require_fd(p.param->value, p.param->grad.to_vector(), loss, p.name, stride);
}

nn::MoeConfig base_config() {
  nn::MoeConfig c;
  c.n_embd = 6;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_hidden = 5;
  return c;
}

// Runs MoeExperts::forward_grouped with fixed segments, for the Module interface.
class GroupedExperts : public nn::Module<double> {
 public:
  GroupedExperts(std::shared_ptr<nn::MoeExperts<double>> e, std::vector<std::int64_t> offsets)
      : experts_(register_module("experts", e)), offsets_(std::move(offsets)) {}
  Tensor<double> forward(const Tensor<double>& x, nn::Cache<double>& cache) override {
    return experts_->forward_grouped(x, offsets_, cache.child(0));
  }
  Tensor<double> backward(const Tensor<double>& dy, nn::Cache<double>& cache) override {
    return experts_->backward(dy, cache.child(0));
  }
  std::string describe() const override { return "GroupedExperts"; }

 private:
  std::shared_ptr<nn::MoeExperts<double>> experts_;
  std::vector<std::int64_t> offsets_;
};

// cuda:N backed by host memory, and a kernel table whose float entries are the CPU
// kernels: the layer on "cuda:0" runs the table's kernels (kernels/cuda_table.hpp).
using ptrain_test::HostBackend;

struct CpuTableAsCuda {
  HostBackend backend;
  kernels::CudaKernelTable table;
  std::optional<std::string> gate;
  CpuTableAsCuda() {
    namespace kc = kernels::cpu;
    auto& k = table.f32;
    k.gemm = &kc::gemm<float>;
    k.linear_epilogue = &kc::linear_epilogue<float>;
    k.linear_weight_grad_epilogue = &kc::linear_weight_grad_epilogue<float>;
    k.bias_grad = &kc::bias_grad<float>;
    k.sum_squares = &kc::sum_squares<float>;
    k.axpy = &kc::axpy<float>;
    k.swiglu_forward = &kc::swiglu_forward<float>;
    k.swiglu_backward = &kc::swiglu_backward<float>;
    k.activation_forward = &kc::activation_forward<float>;
    k.activation_backward = &kc::activation_backward<float>;
    k.moe_route = &kc::moe_route<float>;
    k.moe_route_backward = &kc::moe_route_backward<float>;
    k.moe_permute_plan = &kc::moe_permute_plan;
    k.moe_gather = &kc::moe_gather<float>;
    k.moe_gather_backward = &kc::moe_gather_backward<float>;
    k.moe_combine = &kc::moe_combine<float>;
    k.moe_combine_backward = &kc::moe_combine_backward<float>;
    kernels::detail::cuda_kernel_table_slot() = &table;
    ptrain::detail::cuda_backend_slot() = &backend;
    if (const char* v = std::getenv("PTRAIN_UNVERIFIED_CUDA")) gate = v;
  }
  ~CpuTableAsCuda() {
    kernels::detail::cuda_kernel_table_slot() = nullptr;
    ptrain::detail::cuda_backend_slot() = nullptr;
    if (gate) ::setenv("PTRAIN_UNVERIFIED_CUDA", gate->c_str(), 1);
    else ::unsetenv("PTRAIN_UNVERIFIED_CUDA");
  }
};

}  // namespace

TEST_CASE("moe: on a cuda device the layer runs the kernel table's MoE kernels, behind the gate", "[moe]") {
  auto c = base_config();
  c.capacity_factor = 0.9;
  c.aux_loss_coef = 0.1;
  c.z_loss_coef = 0.01;
  c.shared_hidden = 4;
  c.shared_gate = true;
  Generator g1(7), g2(7);
  nn::MoE<float> cpu(c, g1), dev(c, g2);
  std::vector<float> xv(5 * 6), dyv(5 * 6);
  for (std::size_t i = 0; i < xv.size(); ++i) {
    xv[i] = std::sin(0.7f * float(i));
    dyv[i] = std::cos(0.3f * float(i));
  }
  const auto x = Tensor<float>::from(xv, {5, 6}), dy = Tensor<float>::from(dyv, {5, 6});
  nn::Cache<float> cc;
  const auto y_ref = cpu.forward(x, cc);
  const auto dx_ref = cpu.backward(dy, cc);

  CpuTableAsCuda fake;
  dev.to(Device::cuda(0));
  nn::Cache<float> gc;
  ::unsetenv("PTRAIN_UNVERIFIED_CUDA");
  CHECK_THROWS_WITH(dev.forward(x.to(Device::cuda(0)), gc),
                    Contains("[ptrain.cuda.unverified]") && Contains("moe_route"));
  ::setenv("PTRAIN_UNVERIFIED_CUDA", "1", 1);
  gc.clear();
  const auto y = dev.forward(x.to(Device::cuda(0)), gc);
  const auto dx = dev.backward(dy.to(Device::cuda(0)), gc);
  REQUIRE(y.device() == Device::cuda(0));
  // The same kernels in the same order: the same bits.
  CHECK(y.to_vector() == y_ref.to_vector());
  CHECK(dx.to_vector() == dx_ref.to_vector());
  CHECK(dev.stats().dropped == cpu.stats().dropped);
  CHECK(dev.stats().dropped > 0);
  auto pc = cpu.named_parameters();
  auto pg = dev.named_parameters();
  for (std::size_t i = 0; i < pc.size(); ++i) {
    INFO(pc[i].name);
    CHECK(pg[i].param->grad.to_vector() == pc[i].param->grad.to_vector());
  }
}

namespace {
// The grouped GEMMs' reference: a triple loop in double over each expert's rows.
// y[lo:hi] = alpha x[lo:hi] op(w[e]) + beta y[lo:hi], op(w) = w^T when trans_w.
std::vector<double> naive_grouped(const std::vector<double>& x, const std::vector<std::vector<double>>& w,
                                  const std::vector<std::int64_t>& offsets, std::vector<double> y, std::int64_t K,
                                  std::int64_t N, bool trans_w, double alpha, double beta) {
  for (std::size_t e = 0; e < w.size(); ++e)
    for (std::int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      for (std::int64_t j = 0; j < N; ++j) {
        double acc = 0;
        for (std::int64_t i = 0; i < K; ++i)
          acc += x[std::size_t(r * K + i)] * w[e][std::size_t(trans_w ? j * K + i : i * N + j)];
        y[std::size_t(r * N + j)] = alpha * acc + beta * y[std::size_t(r * N + j)];
      }
  return y;
}

// dw = alpha dy[lo:hi]^T x[lo:hi] + beta dw, dy [M, N], x [M, K], dw [N, K].
std::vector<double> naive_weight_grad(const std::vector<double>& dy, const std::vector<double>& x, std::int64_t lo,
                                      std::int64_t hi, std::vector<double> dw, std::int64_t N, std::int64_t K,
                                      double alpha, double beta) {
  for (std::int64_t j = 0; j < N; ++j)
    for (std::int64_t i = 0; i < K; ++i) {
      double acc = 0;
      for (std::int64_t r = lo; r < hi; ++r) acc += dy[std::size_t(r * N + j)] * x[std::size_t(r * K + i)];
      dw[std::size_t(j * K + i)] = alpha * acc + beta * dw[std::size_t(j * K + i)];
    }
  return dw;
}

std::vector<double> as_double(const std::vector<double>& v) { return v; }
std::vector<double> as_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// The largest |got - want| over max(1, |want|).
template <class G>
double max_rel_diff(const std::vector<G>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(double(got[i]) - want[i]) / std::max(1.0, std::abs(want[i])));
  return worst;
}

int g_grouped_calls = 0;
// The CPU's grouped_gemm, counted: which path the op took on the fake cuda:0.
void counted_grouped_gemm(bool ta, bool tb, std::int64_t groups, const std::int64_t* m, const std::int64_t* n,
                          const std::int64_t* k, float alpha, const float* const* a, std::int64_t lda,
                          const float* const* b, std::int64_t ldb, float beta, float* const* c, std::int64_t ldc) {
  ++g_grouped_calls;
  kernels::cpu::grouped_gemm<float>(ta, tb, groups, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
}  // namespace

TEMPLATE_TEST_CASE("moe: the grouped GEMM against a loop in double, segments of 0, 1 and many rows", "[moe]", float,
                   double) {
  using T = TestType;
  const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-13;
  const std::int64_t K = 7, N = 5;
  // Experts 0 and 3 without rows, expert 1 with one, the others with many.
  const std::vector<std::int64_t> offsets{0, 0, 1, 12, 12, 40};
  const std::int64_t M = offsets.back(), E = 5;
  auto values = [](std::int64_t n, std::uint64_t seed) {
    std::vector<T> v;
    for (double d : random_tensor({n}, seed).to_vector()) v.push_back(static_cast<T>(d));
    return v;
  };
  const auto xv = values(M * K, 1), dyv = values(M * N, 2), y0 = values(M * N, 3);
  for (bool trans_w : {true, false}) {
    INFO("trans_w " << trans_w);
    std::vector<Tensor<T>> w;
    std::vector<std::vector<double>> wd;
    for (std::int64_t e = 0; e < E; ++e) {
      const auto v = values(N * K, 10 + std::uint64_t(e));
      w.push_back(Tensor<T>::from(v, trans_w ? Shape{N, K} : Shape{K, N}));
      wd.push_back(as_double(v));
    }
    for (auto [alpha, beta] : std::vector<std::pair<double, double>>{{1, 0}, {0.5, 1}, {-2, 0.25}}) {
      INFO("alpha " << alpha << " beta " << beta);
      auto y = Tensor<T>::from(y0, {M, N});
      ops::grouped_matmul_into(Tensor<T>::from(xv, {M, K}), w, offsets, y, trans_w, static_cast<T>(alpha),
                               static_cast<T>(beta));
      CHECK(max_rel_diff(y.to_vector(), naive_grouped(as_double(xv), wd, offsets, as_double(y0), K, N, trans_w,
                                                      alpha, beta)) <= tol);
    }
  }
  // Weight gradients: expert 2 frozen (undefined, untouched); an expert without rows keeps
  // its gradient when beta = 1 and is scaled by beta otherwise.
  for (double beta : {1.0, 0.5}) {
    INFO("beta " << beta);
    std::vector<Tensor<T>> dw;
    std::vector<std::vector<T>> dw0;
    for (std::int64_t e = 0; e < E; ++e) {
      dw0.push_back(values(N * K, 20 + std::uint64_t(e)));
      dw.push_back(e == 2 ? Tensor<T>() : Tensor<T>::from(dw0.back(), {N, K}));
    }
    ops::grouped_matmul_weight_grad(Tensor<T>::from(dyv, {M, N}), Tensor<T>::from(xv, {M, K}), offsets, dw, T(1.5),
                                    static_cast<T>(beta));
    for (std::int64_t e = 0; e < E; ++e) {
      if (e == 2) continue;
      INFO("expert " << e);
      CHECK(max_rel_diff(dw[std::size_t(e)].to_vector(),
                         naive_weight_grad(as_double(dyv), as_double(xv), offsets[std::size_t(e)],
                                           offsets[std::size_t(e) + 1], as_double(dw0[std::size_t(e)]), N, K, 1.5,
                                           beta)) <= tol);
    }
    if (beta == 1.0) CHECK(dw[0].to_vector() == dw0[0]);  // no rows, beta 1: the same bits
  }
  // The kernel alone: a group with m = 0 is a no-op, one with k = 0 gives C = beta C.
  std::vector<T> c0{1, 2, 3, 4}, c1{5, 6, 7, 8};
  const std::int64_t m[] = {0, 2}, n[] = {2, 2}, k[] = {3, 0};
  const T* a[] = {nullptr, nullptr};
  T* c[] = {c0.data(), c1.data()};
  kernels::cpu::grouped_gemm<T>(false, false, 2, m, n, k, T(1), a, 3, a, 2, T(0.5), c, 2);
  CHECK(c0 == std::vector<T>{1, 2, 3, 4});
  CHECK(c1 == std::vector<T>{2.5, 3, 3.5, 4});
}

TEST_CASE("moe: the grouped GEMM's bad shapes and offsets", "[moe]") {
  const auto x = random_tensor({6, 4}, 1);
  auto y = Tensor<double>::zeros({6, 3});
  const std::vector<Tensor<double>> w{random_tensor({3, 4}, 2), random_tensor({3, 4}, 3)};
  CHECK_THROWS_WITH(ops::grouped_matmul_into(x, w, {0, 2, 5}, y, true), Contains("[ptrain.moe.grouped_gemm]"));
  CHECK_THROWS_WITH(ops::grouped_matmul_into(x, w, {0, 4, 2, 6}, y, true), Contains("[ptrain.moe.grouped_gemm]"));
  CHECK_THROWS_WITH(ops::grouped_matmul_into(x, w, {0, 4, 6}, y, false), Contains("grouped GEMM"));
  CHECK_THROWS_WITH(ops::grouped_matmul_into(x, {w[0], random_tensor({3, 5}, 4)}, {0, 4, 6}, y, true),
                    Contains("grouped GEMM weight"));
  std::vector<Tensor<double>> dw{Tensor<double>::zeros({3, 4}), Tensor<double>::zeros({4, 3})};
  CHECK_THROWS_WITH(ops::grouped_matmul_weight_grad(y, x, {0, 4, 6}, dw), Contains("grouped GEMM weight gradient"));
  CHECK_THROWS_WITH(ops::grouped_matmul_weight_grad(y, x, {1, 4, 6}, dw), Contains("[ptrain.moe.grouped_gemm]"));
}

TEST_CASE("moe: on a cuda device the grouped GEMM runs one gemm per expert while grouped_gemm is gated", "[moe]") {
  const std::int64_t K = 6, N = 4;
  const std::vector<std::int64_t> offsets{0, 3, 3, 4, 9};
  std::vector<Tensor<float>> w;
  for (std::uint64_t e = 0; e < 4; ++e) {
    std::vector<float> v;
    for (double d : random_tensor({N, K}, 30 + e).to_vector()) v.push_back(float(d));
    w.push_back(Tensor<float>::from(v, {N, K}));
  }
  std::vector<float> xv;
  for (double d : random_tensor({9, K}, 40).to_vector()) xv.push_back(float(d));
  const auto x = Tensor<float>::from(xv, {9, K});
  auto y_ref = Tensor<float>::empty({9, N});
  ops::grouped_matmul_into(x, w, offsets, y_ref, true);

  CpuTableAsCuda fake;
  fake.table.f32.grouped_gemm = &counted_grouped_gemm;
  const Device d = Device::cuda(0);
  std::vector<Tensor<float>> wd;
  for (auto& t : w) wd.push_back(t.to(d));
  for (bool allowed : {false, true}) {
    INFO("PTRAIN_UNVERIFIED_CUDA " << allowed);
    if (allowed) ::setenv("PTRAIN_UNVERIFIED_CUDA", "1", 1);
    else ::unsetenv("PTRAIN_UNVERIFIED_CUDA");
    g_grouped_calls = 0;
    auto y = Tensor<float>::empty({9, N}, d);
    ops::grouped_matmul_into(x.to(d), wd, offsets, y, true);
    CHECK(g_grouped_calls == (allowed ? 1 : 0));
    CHECK(y.to_vector() == y_ref.to_vector());  // the same gemm calls either way: the same bits
  }
}

TEST_CASE("moe: top-k picks the largest scores, ties to the lower expert, NaN last", "[moe]") {
  const auto logits = Tensor<double>::from({1, 3, 3, 0,  //
                                            2, 2, 2, 2,  //
                                            std::nan(""), 1, 0, -1},
                                           {3, 4});
  const auto r = ops::moe_route(logits, 3, MoeScore::Softmax, false, 1.0);
  CHECK(r.experts.to_vector() == std::vector<std::int32_t>{1, 2, 0, 0, 1, 2, 1, 2, 3});
  // Softmax weights without renormalisation are the probabilities themselves.
  const double z = std::exp(1.0) + 2 * std::exp(3.0) + 1;
  CHECK(r.weights.data()[0] == Approx(std::exp(3.0) / z).epsilon(1e-14));
  CHECK(r.weights.data()[2] == Approx(std::exp(1.0) / z).epsilon(1e-14));
  CHECK(r.weights.data()[3] == Approx(0.25).epsilon(1e-14));
  CHECK(r.lse.data()[1] == Approx(2 + std::log(4.0)).epsilon(1e-14));
  // Sigmoid with renormalisation and a scale: scale * s_i / sum of the chosen s.
  const auto s = ops::moe_route(logits.view(0, {1, 4}), 2, MoeScore::Sigmoid, true, 2.5);
  CHECK(s.weights.data()[0] == Approx(1.25).epsilon(1e-14));
  const double s3 = sigmoid(3.0), s1 = sigmoid(1.0), s0 = sigmoid(0.0);
  CHECK(s.probs.data()[0] == Approx(s1 / (s1 + 2 * s3 + s0)).epsilon(1e-14));
  CHECK_THROWS_WITH(ops::moe_route(logits, 5, MoeScore::Softmax, true, 1.0), Contains("[ptrain.moe.route]"));
}

TEST_CASE("moe: the permutation is stable by expert and drops beyond capacity in token order", "[moe]") {
  const auto experts = Tensor<std::int32_t>::from({0, 2, 2, 1, 2, 0, 1, 2}, {4, 2});
  const auto plan = ops::moe_permute_plan(experts, 3, 2);
  CHECK(plan.routed == std::vector<std::int64_t>{2, 2, 4});
  CHECK(plan.offsets == std::vector<std::int64_t>{0, 2, 4, 6});
  CHECK(plan.pos.to_vector() == std::vector<std::int32_t>{0, 4, 5, 2, -1, 1, 3, -1});
  CHECK(plan.token_of.to_vector() == std::vector<std::int32_t>{0, 2, 1, 3, 0, 1});
  const auto all = ops::moe_permute_plan(experts, 3, 0);  // dropless
  CHECK(all.offsets == std::vector<std::int64_t>{0, 2, 4, 8});
  CHECK(all.pos.to_vector() == std::vector<std::int32_t>{0, 4, 5, 2, 6, 1, 3, 7});
  CHECK_THROWS_WITH(ops::moe_permute_plan(experts, 2, 0), Contains("[ptrain.moe.experts]"));

  // Gather, combine and their backwards against loops over the plan.
  const auto x = random_tensor({4, 3}, 1), w = random_tensor({4, 2}, 2), dy = random_tensor({4, 3}, 3);
  const auto xp = ops::moe_gather(x, plan);
  for (std::int64_t r = 0; r < 6; ++r)
    for (std::int64_t i = 0; i < 3; ++i) CHECK(xp.data()[r * 3 + i] == x.data()[plan.token_of.data()[r] * 3 + i]);
  const auto y = ops::moe_combine(xp, plan.pos, w);
  Tensor<double> dyp, dw;
  ops::moe_combine_backward(xp, plan.pos, w, dy, dyp, dw);
  const auto dx = ops::moe_gather_backward(dyp, plan);
  for (std::int64_t t = 0; t < 4; ++t)
    for (std::int64_t i = 0; i < 3; ++i) {
      double want = 0, dwant = 0;
      for (std::int64_t j = 0; j < 2; ++j) {
        const std::int32_t p = plan.pos.data()[t * 2 + j];
        if (p < 0) continue;
        want += w.data()[t * 2 + j] * x.data()[t * 3 + i];  // the slot's row is token t's own
        dwant += w.data()[t * 2 + j] * dy.data()[t * 3 + i];
      }
      CHECK(y.data()[t * 3 + i] == Approx(want).epsilon(1e-14));
      CHECK(dx.data()[t * 3 + i] == Approx(dwant).epsilon(1e-14));
    }
  for (std::int64_t s = 0; s < 8; ++s) {
    const std::int32_t p = plan.pos.data()[s];
    double want = 0;
    if (p >= 0)
      for (std::int64_t i = 0; i < 3; ++i) want += dy.data()[(s / 2) * 3 + i] * x.data()[(s / 2) * 3 + i];
    CHECK(dw.data()[s] == Approx(want).epsilon(1e-14).margin(1e-15));
  }
}

TEST_CASE("moe: the router's gradients, through top-k, renormalisation and both auxiliary losses", "[moe]") {
  for (auto score : {MoeScore::Softmax, MoeScore::Sigmoid})
    for (bool renorm : {true, false}) {
      INFO("sigmoid " << (score == MoeScore::Sigmoid) << " renormalize " << renorm);
      auto c = base_config();
      c.score = score;
      c.renormalize = renorm;
      c.routed_scale = 1.7;
      c.aux_loss_coef = 0.3;
      c.z_loss_coef = 0.2;
      nn::MoeRouter<double> router(c);
      randomize(router, 11);
      const auto x = random_tensor({9, 6}, 12), R = random_tensor({9, 2}, 13);
      // Without auxiliary losses the gradcheck of the Module interface applies as it is.
      if (!renorm) {
        auto plain = c;
        plain.aux_loss_coef = plain.z_loss_coef = 0;
        nn::MoeRouter<double> r0(plain);
        randomize(r0, 11);
        check_module_gradients(r0, x);
      }
      check_against(router, x, R, [&] {
        nn::Cache<double> cache;
        return dot(router.forward(x, cache), R) + router.stats().loss;
      });
      CHECK(router.stats().aux_loss > 0);
      CHECK(router.stats().z_loss > 0);
    }
}

TEST_CASE("moe: the grouped experts' gradients, one expert without tokens", "[moe]") {
  auto experts = std::make_shared<nn::MoeExperts<double>>(4, 6, 5);
  GroupedExperts grouped(experts, {0, 3, 3, 7, 9});
  randomize(grouped, 21);
  check_module_gradients(grouped, random_tensor({9, 6}, 22), true, 1e-7, 1000);
  // Each segment is its expert's SwiGLU applied on its own.
  const auto x = random_tensor({9, 6}, 23);
  nn::Cache<double> cache, one;
  const auto y = grouped.forward(x, cache);
  const auto y2 = experts->expert(2).forward(x.narrow(3, 4), one);
  for (std::int64_t i = 0; i < 4 * 6; ++i) CHECK(y.data()[3 * 6 + i] == Approx(y2.data()[i]).epsilon(1e-13));
  CHECK_THROWS_WITH(experts->forward(x, cache), Contains("[ptrain.moe.experts]"));
  CHECK_THROWS_WITH(experts->forward_grouped(x, {0, 3, 3, 7, 8}, cache), Contains("[ptrain.moe.experts]"));
}

TEST_CASE("moe: the layer against a per-token loop, forward and gradients", "[moe]") {
  struct Case {
    const char* name;
    MoeScore score;
    bool renorm;
    double scale, capacity, aux, z;
    std::int64_t top_k, shared;
    bool gate;
  };
  const Case cases[] = {
      {"Mixtral: softmax, top-2, renormalised, dropless", MoeScore::Softmax, true, 1.0, 0, 0, 0, 2, 0, false},
      {"softmax, capacity 0.75, auxiliary losses", MoeScore::Softmax, true, 1.0, 0.75, 0.3, 0.2, 2, 0, false},
      {"DeepSeek: sigmoid, renormalised, scaled, shared experts", MoeScore::Sigmoid, true, 2.5, 0, 0.3, 0.2, 2, 4,
       false},
      {"Qwen2-MoE: softmax, not renormalised, gated shared expert, capacity 1", MoeScore::Softmax, false, 1.0, 1.0,
       0.3, 0.2, 2, 4, true},
      {"sigmoid, top-1, capacity 0.5, shared", MoeScore::Sigmoid, false, 1.0, 0.5, 0.4, 0.1, 1, 3, false},
      {"softmax, top-3, capacity 0.8, gated shared", MoeScore::Softmax, true, 1.0, 0.8, 0.3, 0.2, 3, 3, true},
  };
  for (const Case& k : cases) {
    INFO(k.name);
    auto c = base_config();
    c.score = k.score;
    c.renormalize = k.renorm;
    c.routed_scale = k.scale;
    c.capacity_factor = k.capacity;
    c.aux_loss_coef = k.aux;
    c.z_loss_coef = k.z;
    c.top_k = k.top_k;
    c.shared_hidden = k.shared;
    c.shared_gate = k.gate;
    nn::MoE<double> moe(c);
    randomize(moe, 31);
    const auto x = random_tensor({3, 3, 6}, 32), R = random_tensor({3, 3, 6}, 33);

    nn::Cache<double> cache;
    const auto y = moe.forward(x, cache);
    REQUIRE(y.shape() == x.shape());
    const Reference ref = naive_moe(moe, x);
    for (std::int64_t i = 0; i < y.numel(); ++i) REQUIRE(y.data()[i] == Approx(ref.y[std::size_t(i)]).margin(1e-13));
    const nn::MoeStats& s = moe.stats();
    CHECK(s.tokens_per_expert == ref.routed);
    CHECK(s.dropped == ref.dropped);
    if (k.capacity > 0 && k.capacity < 1) CHECK(s.dropped > 0);  // the capacity bites
    CHECK(s.aux_loss == Approx(ref.aux).epsilon(1e-13));
    CHECK(s.z_loss == Approx(ref.z).epsilon(1e-13));
    CHECK(s.loss == Approx(k.aux * ref.aux + k.z * ref.z).epsilon(1e-13));
    CHECK(s.mean_load == Approx(9.0 * double(k.top_k) / 4));
    CHECK(s.max_load == double(*std::max_element(ref.routed.begin(), ref.routed.end())));

    // The reference's central differences, for the input and every parameter.
    check_against(moe, x, R, [&] {
      const Reference r = naive_moe(moe, x);
      return std::inner_product(r.y.begin(), r.y.end(), R.data(), 0.0) + k.aux * r.aux + k.z * r.z;
    });
    // And the layer's own (a sample of coordinates).
    check_against(
        moe, x, R,
        [&] {
          nn::Cache<double> c2;
          return dot(moe.forward(x, c2), R) + moe.stats().loss;
        },
        3);
  }
}

// Note [MoE metrics window]: the window sums the training forwards whose backward ran
// (counts and drops summed, losses averaged over the forwards), against the per-token
// reference's routing of each batch; evaluation forwards, a training forward without a
// backward and Recompute's replay add nothing; end_window and reset_window start anew.
TEST_CASE("moe: the metrics window sums the step's training forwards, not evaluation ones", "[moe][metrics]") {
  auto c = base_config();
  c.capacity_factor = 0.75;
  c.aux_loss_coef = 0.3;
  c.z_loss_coef = 0.2;
  auto moe = std::make_shared<nn::MoE<double>>(c);
  randomize(*moe, 51);
  CHECK(moe->named_metrics().empty());  // nothing counted yet
  // Forward (and backward when `backward`) of x; the reference's routing when it counts.
  auto run = [&](const Tensor<double>& x, bool train, bool backward) {
    moe->train(train);
    nn::Cache<double> cache;
    const auto y = moe->forward(x, cache);
    if (backward) moe->backward(Tensor<double>::full(y.shape(), 0.5), cache);
    const Reference ref = naive_moe(*moe, x);
    REQUIRE(moe->stats().tokens_per_expert == ref.routed);  // stats(): the latest forward, any mode
    return ref;
  };
  std::vector<Reference> counted;
  counted.push_back(run(random_tensor({3, 3, 6}, 52), true, true));
  const auto before = moe->window().tokens_per_expert;
  run(random_tensor({5, 6}, 53), false, false);  // evaluation
  run(random_tensor({4, 6}, 54), false, true);   // evaluation, even with a backward
  CHECK(moe->window().tokens_per_expert == before);
  counted.push_back(run(random_tensor({2, 4, 6}, 55), true, true));
  run(random_tensor({6, 6}, 56), true, false);  // no backward: not trained on
  counted.push_back(run(random_tensor({7, 6}, 57), true, true));

  std::vector<std::int64_t> routed(4, 0);
  std::int64_t dropped = 0;
  double aux = 0, z = 0;
  for (const Reference& r : counted) {
    for (std::size_t e = 0; e < 4; ++e) routed[e] += r.routed[e];
    dropped += r.dropped;
    aux += r.aux / 3;
    z += r.z / 3;
  }
  REQUIRE(moe->window().forwards == 3);
  const nn::MoeStats w = moe->window_stats();
  CHECK(w.tokens_per_expert == routed);
  CHECK(std::accumulate(routed.begin(), routed.end(), std::int64_t(0)) == (9 + 8 + 7) * 2);
  CHECK(w.dropped == dropped);
  CHECK(dropped > 0);
  CHECK(w.capacity == 3);  // the latest counted forward's: ceil(0.75 * 7 * 2 / 4)
  CHECK(w.aux_loss == Approx(aux).epsilon(1e-13));
  CHECK(w.z_loss == Approx(z).epsilon(1e-13));
  CHECK(w.loss == Approx(0.3 * aux + 0.2 * z).epsilon(1e-13));
  CHECK(w.mean_load == Approx(24.0 * 2 / 4));
  std::map<std::string, double> got;
  for (const auto& [name, value] : moe->named_metrics()) got[name] = value;
  for (std::size_t e = 0; e < 4; ++e) CHECK(got.at("tokens_per_expert." + std::to_string(e)) == double(routed[e]));
  CHECK(got.at("dropped") == double(dropped));
  CHECK(got.at("load_imbalance") ==
        Approx(double(*std::max_element(routed.begin(), routed.end())) / (24.0 * 2 / 4)).epsilon(1e-15));
  CHECK(got.at("aux_loss") == Approx(aux).epsilon(1e-13));
  CHECK(got.at("z_loss") == Approx(z).epsilon(1e-13));
  CHECK(got.at("moe_loss") == Approx(0.3 * aux + 0.2 * z).epsilon(1e-13));

  // all_reduce_moe_stats on one rank ends the window: it still reports the same sums, and
  // the next counted forward starts a new window instead of adding to them.
  dist::SelfCommunicator self;
  parallel::all_reduce_moe_stats(*moe, self);
  CHECK(moe->window().tokens_per_expert == routed);
  CHECK(moe->window().forwards == 3);
  const Reference next = run(random_tensor({3, 6}, 58), true, true);
  CHECK(moe->window().forwards == 1);
  CHECK(moe->window().tokens_per_expert == next.routed);
  CHECK(moe->window_stats().aux_loss == Approx(next.aux).epsilon(1e-13));
  // A reset (the model-level helper) empties it.
  nn::Sequential<double> model;
  model.add(moe);
  parallel::reset_moe_metrics(model);
  CHECK(moe->window().forwards == 0);
  CHECK(moe->window_stats().tokens_per_expert.empty());
  CHECK(model.named_metrics().empty());

  // Under activation checkpointing backward replays the forward; the window counts it once.
  nn::Recompute<double> wrapped(moe);
  wrapped.train(true);
  const auto x = random_tensor({5, 6}, 59);
  nn::Cache<double> cache;
  wrapped.backward(Tensor<double>::full(wrapped.forward(x, cache).shape(), 0.5), cache);
  CHECK(moe->window().forwards == 1);
  CHECK(moe->window().tokens_per_expert == naive_moe(*moe, x).routed);
}

TEST_CASE("moe: names, float against double, and bad configurations", "[moe]") {
  auto c = base_config();
  c.shared_hidden = 4;
  c.shared_gate = true;
  nn::MoE<double> moe(c);
  std::vector<std::string> names;
  for (auto& p : moe.named_parameters()) names.push_back(p.name);
  CHECK(names.front() == "gate.weight");
  CHECK(names[1] == "experts.0.w1.weight");
  CHECK(names[2] == "experts.0.w2.weight");
  CHECK(names[3] == "experts.0.w3.weight");
  CHECK(std::find(names.begin(), names.end(), "experts.3.w3.weight") != names.end());
  CHECK(std::find(names.begin(), names.end(), "shared_experts.down_proj.weight") != names.end());
  CHECK(names.back() == "shared_expert_gate.weight");
  CHECK(moe.num_parameters() == 4 * 6 + 4 * 3 * 30 + 3 * 24 + 6);

  // The same layer in float: the same routing and outputs within float rounding.
  randomize(moe, 41);
  nn::MoE<float> mf(c);
  auto pd = moe.named_parameters();
  auto pf = mf.named_parameters();
  for (std::size_t i = 0; i < pd.size(); ++i) {
    const auto v = pd[i].param->value.to_vector();
    pf[i].param->value.copy_(Tensor<float>::from(std::vector<float>(v.begin(), v.end()), pd[i].param->value.shape()));
  }
  const auto x = random_tensor({8, 6}, 42);
  const auto xv = x.to_vector();
  nn::Cache<double> cd;
  nn::Cache<float> cf;
  const auto yd = moe.forward(x, cd);
  const auto yf = mf.forward(Tensor<float>::from(std::vector<float>(xv.begin(), xv.end()), {8, 6}), cf);
  CHECK(mf.stats().tokens_per_expert == moe.stats().tokens_per_expert);
  for (std::int64_t i = 0; i < yd.numel(); ++i) CHECK(yf.data()[i] == Approx(yd.data()[i]).margin(1e-5));
  const auto dxf = mf.backward(Tensor<float>::full({8, 6}, 1.0f), cf);
  const auto dxd = moe.backward(Tensor<double>::full({8, 6}, 1.0), cd);
  for (std::int64_t i = 0; i < dxd.numel(); ++i) CHECK(dxf.data()[i] == Approx(dxd.data()[i]).margin(1e-5));

  // And in bf16 (computed in float, rounded to 8 bits where stored): within a few bf16 steps.
  nn::MoE<bf16> mb(c);
  auto pb = mb.named_parameters();
  for (std::size_t i = 0; i < pd.size(); ++i) {
    std::vector<bf16> v;
    for (double d : pd[i].param->value.to_vector()) v.push_back(bf16(static_cast<float>(d)));
    pb[i].param->value.copy_(Tensor<bf16>::from(v, pd[i].param->value.shape()));
  }
  std::vector<bf16> xb;
  for (double d : xv) xb.push_back(bf16(static_cast<float>(d)));
  nn::Cache<bf16> cb;
  const auto yb = mb.forward(Tensor<bf16>::from(xb, {8, 6}), cb);
  const auto dxb = mb.backward(Tensor<bf16>::full({8, 6}, bf16(1.0f)), cb);
  auto near_bf16 = [](const Tensor<bf16>& got, const Tensor<double>& want) {
    double max = 0, err = 0;
    for (std::int64_t i = 0; i < want.numel(); ++i) {
      max = std::max(max, std::abs(want.data()[i]));
      err = std::max(err, std::abs(double(float(got.data()[i])) - want.data()[i]));
    }
    return err <= 0.05 * max;  // NaN fails
  };
  CHECK(near_bf16(yb, yd));
  CHECK(near_bf16(dxb, dxd));

  auto bad = base_config();
  bad.top_k = 5;
  CHECK_THROWS_WITH(nn::MoE<double>(bad), Contains("[ptrain.moe.config]"));
  bad = base_config();
  bad.shared_gate = true;
  CHECK_THROWS_WITH(nn::MoE<double>(bad), Contains("[ptrain.moe.config]"));
  bad = base_config();
  bad.capacity_factor = -1;
  CHECK_THROWS_WITH(nn::MoE<double>(bad), Contains("[ptrain.moe.config]"));
  nn::Cache<double> cache;
  CHECK_THROWS_WITH(moe.forward(random_tensor({2, 5}, 1), cache), Contains("[ptrain.moe]"));
  CHECK_THROWS_WITH(moe.backward(random_tensor({2, 6}, 1), cache), Contains("[ptrain.backward]"));
}

TEST_CASE("moe: Llama with MoE blocks, names, counts and finite-difference gradients", "[moe][llama]") {
  nn::LlamaConfig c{.vocab_size = 13, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16, .intermediate_size = 24};
  c.num_experts = 4;
  c.top_k = 2;
  c.moe_every = 2;  // layer 1 only
  c.moe_intermediate_size = 12;
  c.moe_shared_size = 8;
  c.moe_aux_loss_coef = 0.1;
  c.moe_z_loss_coef = 0.05;
  Generator g(11);
  nn::Llama<double> model(c, g);
  REQUIRE(model.block(0).moe() == nullptr);
  REQUIRE(model.block(1).moe() != nullptr);
  CHECK_THROWS_WITH(model.block(1).mlp(), Contains("[ptrain.llama.moe]"));
  CHECK(model.num_parameters() == c.num_parameters());
  std::vector<std::string> names;
  for (auto& p : model.named_parameters()) names.push_back(p.name);
  for (const char* n : {"layers.0.mlp.gate_proj.weight", "layers.1.block_sparse_moe.gate.weight",
                        "layers.1.block_sparse_moe.experts.3.w2.weight",
                        "layers.1.block_sparse_moe.shared_experts.up_proj.weight"})
    CHECK(std::find(names.begin(), names.end(), n) != names.end());
  CHECK_THROWS_WITH(c.to_hf_config(), Contains("[ptrain.llama.hf_config]"));

  Generator r(12);
  for (auto& p : model.named_parameters()) ops::uniform_(p.param->value, -0.3, 0.3, r);
  const auto ids = Tensor<std::int32_t>::from({1, 2, 0, 3, 4, 5, 0, 6, 7, 8, 9, 0, 1, 2, 3, 4}, {2, 8});
  const auto R = random_tensor({2, 8, 13}, 13);
  auto loss = [&] {
    nn::Cache<double> cache;
    return dot(model.forward_tokens(ids, cache), R) + model.block(1).moe()->stats().loss;
  };
  nn::Cache<double> cache;
  model.forward_tokens(ids, cache);
  model.zero_grad();
  model.backward(R, cache);
  for (auto& p : model.named_parameters())
    require_fd(p.param->value, p.param->grad.to_vector(), loss, p.name,
               std::max<std::int64_t>(1, p.param->value.numel() / 5));
}

TEST_CASE("moe: a Llama with MoE blocks learns a toy sequence with AdamW", "[moe][llama]") {
  nn::LlamaConfig c{.vocab_size = 16, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 32, .intermediate_size = 48};
  c.num_experts = 4;
  c.top_k = 2;
  c.moe_intermediate_size = 32;
  c.moe_capacity_factor = 1.25;
  c.moe_aux_loss_coef = 0.01;
  c.moe_z_loss_coef = 1e-3;
  Generator g(3);
  nn::Llama<float> model(c, g);
  nn::FlatParameters<float> flat(model);
  optim::AdamW<float> opt(flat, {.lr = 1e-2});
  // Two rows of a periodic sequence; the target of each token is the next one.
  std::vector<std::int32_t> x, y;
  for (std::int32_t b = 0; b < 2; ++b)
    for (std::int32_t s = 0; s < 24; ++s) {
      x.push_back((3 * b + s) % 8);
      y.push_back((3 * b + s + 1) % 8);
    }
  const auto ids = Tensor<std::int32_t>::from(x, {2, 24});
  const auto targets = Tensor<std::int32_t>::from(y, {48});
  nn::CrossEntropyLoss<float> ce;
  std::vector<double> losses;
  for (int step = 0; step < 30; ++step) {
    nn::Cache<float> cache, lc;
    const auto logits = model.forward_tokens(ids, cache);
    losses.push_back(ce.forward(logits, targets, lc));
    model.zero_grad();
    model.backward(ce.backward(lc), cache);
    opt.step();
    const nn::MoeStats& s = model.block(1).moe()->stats();
    REQUIRE(std::accumulate(s.tokens_per_expert.begin(), s.tokens_per_expert.end(), std::int64_t(0)) == 48 * 2);
    REQUIRE(s.capacity == 30);  // ceil(1.25 * 48 * 2 / 4)
  }
  INFO("loss " << losses.front() << " -> " << losses.back());
  CHECK(losses.front() > 2.0);            // about log 16 at the start
  CHECK(losses.back() < 0.25 * losses.front());
}

}  // namespace test_moe
