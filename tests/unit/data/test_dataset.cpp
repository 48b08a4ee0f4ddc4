// TensorDataset: rows by index, micro-batches as views, and a clear error for
// inputs and targets of different lengths.
#include <catch2/catch.hpp>
#include <ptrain/data/dataset.hpp>

namespace test_dataset {

using namespace ptrain;

TEST_CASE("TensorDataset gathers the rows it is asked for", "[data][dataset]") {
  auto x = Tensor<float>::from(std::vector<float>{0, 1, 10, 11, 20, 21, 30, 31}, {4, 2});
  auto y = Tensor<std::int32_t>::from(std::vector<std::int32_t>{5, 6, 7, 8}, {4});
  TensorDataset<float> data(x, y);
  CHECK(data.size() == 4);
  const Batch<float> b = data.get({3, 0, 2});
  CHECK(b.rows() == 3);
  CHECK(b.x.shape() == Shape{3, 2});
  CHECK(b.x.to_vector() == std::vector<float>{30, 31, 0, 1, 20, 21});
  CHECK(b.targets.ids().to_vector() == std::vector<std::int32_t>{8, 5, 7});
  CHECK_FALSE(b.ids.defined());
  const Batch<float> tail = b.narrow(1, 2);
  CHECK(tail.x.to_vector() == std::vector<float>{0, 1, 20, 21});
  CHECK(tail.targets.ids().to_vector() == std::vector<std::int32_t>{5, 7});
  CHECK_THROWS_WITH(data.get({4}), Catch::Contains("[ptrain.data.gather]"));
}

TEST_CASE("TensorDataset refuses inputs and targets of different lengths", "[data][dataset]") {
  auto x = Tensor<float>::zeros({3, 2});
  auto y = Tensor<std::int32_t>::zeros({2});
  CHECK_THROWS_WITH(TensorDataset<float>(x, y), Catch::Contains("[ptrain.data.dataset]"));
}

TEST_CASE("TensorDataset masks targets when a class id is -100", "[data][dataset]") {
  auto x = Tensor<float>::zeros({3, 2});
  CHECK_FALSE(TensorDataset<float>(x, Tensor<std::int32_t>::from(std::vector<std::int32_t>{0, 1, 2}, {3})).masks_targets());
  CHECK(TensorDataset<float>(x, Tensor<std::int32_t>::from(std::vector<std::int32_t>{0, -100, 2}, {3})).masks_targets());
  CHECK_FALSE(TensorDataset<float>(x, Tensor<float>::from(std::vector<float>{0, -100, 2}, {3})).masks_targets());
}

}  // namespace test_dataset
