// torchfuse::custom_relu against at::relu, and its 1-bit mask.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>

#include "ops/common/relu_mask.h"
#include "test/cpp/util/op_test_utils.h"
#include "torchfuse/ops.h"

namespace {

using namespace torchfuse::test;

std::tuple<at::Tensor, at::Tensor> forwardMask(const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_relu_forward_mask", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)>();
  return op.call(x);
}

at::Tensor backward(const at::Tensor& grad, const at::Tensor& mask) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_relu_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::OptionalIntArrayRef)>();
  return op.call(grad, mask, std::nullopt);
}

void checkShape(at::IntArrayRef sizes, at::ScalarType dtype, bool contiguous) {
  std::ostringstream label;
  label << dtype << " " << sizes << (contiguous ? " contiguous" : " non-contiguous");
  SCOPED_TRACE(label.str());
  auto base_sizes = sizes.vec();
  if (!contiguous) {
    base_sizes.back() *= 2;
  }
  const auto view = [&](const std::vector<at::Tensor>& l) {
    return contiguous ? l[0] : l[0].slice(-1, 0, std::nullopt, 2).transpose(0, -1);
  };
  expectMatchesReference(
      {randSigned(base_sizes, dtype)},
      [&](const std::vector<at::Tensor>& l) { return torchfuse::custom_relu(view(l)); },
      [&](const std::vector<at::Tensor>& l) { return at::relu(view(l)); });
}

TEST(Relu, MatchesAtenRelu) {
  at::manual_seed(0);
  for (const auto dtype : testDtypes()) {
    for (const auto& sizes : std::vector<std::vector<int64_t>>{
             {7}, {33}, {4, 8}, {3, 5, 7}, {2, 3, 4, 5}, {0, 5}, {}}) {
      checkShape(sizes, dtype, /*contiguous=*/true);
    }
  }
}

TEST(Relu, MatchesAtenReluOnNonContiguousInputs) {
  at::manual_seed(1);
  for (const auto dtype : testDtypes()) {
    for (const auto& sizes : std::vector<std::vector<int64_t>>{
             {4, 8}, {3, 5, 7}, {0, 5}, {2, 3, 33}}) {
      checkShape(sizes, dtype, /*contiguous=*/false);
    }
  }
}

// threshold_backward's rule: the gradient passes where !(y <= 0), so a NaN
// input stays NaN and passes its gradient, and 0 and -0 block it.
TEST(Relu, NanStaysNanAndPassesItsGradientLikeAten) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (const auto dtype : testDtypes()) {
    const auto values =
        at::tensor({nan, -1.5, 0.0, -0.0, 2.0, inf, -inf, nan}, at::dtype(dtype));
    const auto x = values.clone().set_requires_grad(true);
    const auto x_ref = values.clone().set_requires_grad(true);
    const auto out = torchfuse::custom_relu(x);
    const auto expected = at::relu(x_ref);
    EXPECT_TRUE(out.isnan().equal(values.isnan()));
    expectClose(out, expected, "output");
    const auto grad_out = at::arange(1, 9, at::dtype(dtype));
    out.backward(grad_out);
    expected.backward(grad_out);
    EXPECT_TRUE(x.grad().equal(x_ref.grad())) << x.grad() << x_ref.grad();
    EXPECT_EQ(x.grad()[0].item<double>(), 1.0);
    EXPECT_EQ(x.grad()[2].item<double>(), 0.0);
  }
}

// NB: masked_fill, not a product: a NaN gradient where the output was
// clamped gives 0, as threshold_backward does.
TEST(Relu, NanGradientIsBlockedWhereOutputWasClamped) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const auto x = at::tensor({-1.0, 1.0}, at::kDouble).set_requires_grad(true);
  torchfuse::custom_relu(x).backward(at::tensor({nan, nan}, at::kDouble));
  EXPECT_EQ(x.grad()[0].item<double>(), 0.0);
  EXPECT_TRUE(std::isnan(x.grad()[1].item<double>()));
}

TEST(Relu, MaskRoundTripsThroughBackward) {
  at::manual_seed(2);
  for (const int64_t n : {1, 31, 32, 33, 64, 100}) {
    SCOPED_TRACE("numel " + std::to_string(n));
    const auto x = randSigned({n}, at::kFloat);
    auto [out, mask] = forwardMask(x);
    EXPECT_EQ(mask.scalar_type(), at::kByte);
    EXPECT_EQ(mask.numel(), (n + 31) / 32 * 4);
    expectClose(out, at::relu(x), "output");
    const auto keep = x.gt(0);
    EXPECT_TRUE(torchfuse::ops::unpackReluMask(mask, x.sizes()).equal(keep));
    EXPECT_TRUE(torchfuse::ops::packReluMask(keep).equal(mask));
    const auto grad = randSigned({n}, at::kFloat);
    EXPECT_TRUE(backward(grad, mask).equal(grad.masked_fill(keep.logical_not(), 0)));
  }
}

TEST(Relu, MaskRoundTripsForMultiDimensionalShapes) {
  at::manual_seed(3);
  const auto keep = randSigned({3, 5, 7}, at::kFloat).gt(0);
  const auto mask = torchfuse::ops::packReluMask(keep);
  EXPECT_EQ(mask.numel(), torchfuse::ops::reluMaskBytes(keep.numel()));
  EXPECT_TRUE(torchfuse::ops::unpackReluMask(mask, keep.sizes()).equal(keep));
}

TEST(Relu, NoGradGivesTheSameOutputWithoutAGraph) {
  at::manual_seed(4);
  const auto x = randSigned({4, 5}, at::kFloat).set_requires_grad(true);
  c10::NoGradGuard no_grad;
  const auto out = torchfuse::custom_relu(x);
  EXPECT_FALSE(out.requires_grad());
  expectClose(out, at::relu(x), "no-grad output");
}

// The gradient of the backward with respect to grad_output: relu's mask.
TEST(Relu, DoubleBackwardMatchesAten) {
  at::manual_seed(5);
  const auto x = randSigned({4, 5}, at::kDouble).set_requires_grad(true);
  const auto g = randSigned({4, 5}, at::kDouble).set_requires_grad(true);
  const auto second = [&](const at::Tensor& out) {
    const auto gx = torch::autograd::grad({out}, {x}, {g}, true, true)[0];
    return torch::autograd::grad({gx.pow(2).sum()}, {g})[0];
  };
  expectClose(second(torchfuse::custom_relu(x)), second(at::relu(x)), "d2 / d grad_output");
}

// The CPU and Meta kernels run one check: each rejected mask, on both.
TEST(Relu, BackwardRejectsTheSameMasksOnCpuAndMeta) {
  const std::vector<std::pair<at::Tensor, std::string>> cases{
      {at::zeros({4}, at::kByte), "expected mask to be a 1-D uint8 tensor of 8 bytes, got 1-D Byte of 4"},
      {at::zeros({2}, at::kInt), "expected mask to be a 1-D uint8 tensor of 8 bytes, got 1-D Int of 2"},
      {at::zeros({2, 4}, at::kByte), "expected mask to be a 1-D uint8 tensor of 8 bytes, got 2-D Byte of 8"},
  };
  for (const auto& device : {at::kCPU, at::kMeta}) {
    for (const auto& [mask, message] : cases) {
      SCOPED_TRACE(c10::str(device, " ", message));
      expectThrowsWith(
          [&, &mask = mask] { backward(at::ones({40}, at::device(device)), mask.to(device)); },
          "torchfuse::custom_relu_backward: " + message);
    }
  }
}

} // namespace
