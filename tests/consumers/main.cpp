// A consumer program: includes the umbrella header, trains one SGD step of a
// Linear layer and checks it against the update worked out by hand.
#include <cstdio>
#include <ptrain/ptrain.hpp>

int main() {
  using namespace ptrain;
  nn::Linear<double> lin(2, 1, false);
  lin.weight().value.data()[0] = 1.0;
  lin.weight().value.data()[1] = -1.0;
  nn::FlatParameters<double> flat(lin);
  optim::SGD<double> sgd(flat, {.lr = 0.5});
  nn::Cache<double> cache;
  auto x = Tensor<double>::from({2.0, 3.0}, {1, 2});
  auto y = lin.forward(x, cache);                        // 2 - 3 = -1
  lin.backward(Tensor<double>::full({1, 1}, 1.0), cache);  // dW = x
  sgd.step();                                            // W -= 0.5 x
  const bool ok = y.data()[0] == -1.0 && lin.weight().value.data()[0] == 0.0 &&
                  lin.weight().value.data()[1] == -2.5;
  std::printf("ptrain %s consumer: %s\n", PTRAIN_VERSION_STRING, ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
