#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test/cpp/util/op_test_utils.h"
#include "torchfuse/ops.h"

namespace torchfuse {
namespace {

using namespace torchfuse::test;

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The op in float32 against the chain in float64: 2-D and 3-D inputs, a
// broadcast `other`, normalized_shape of one and two dims, with and without
// weight and bias, both sum modes.
TEST(AddLayerNormOp, MatchesTheFloat64ChainOnCpu) {
  torch::manual_seed(0);
  struct Case {
    std::vector<int64_t> input, other, shape;
  };
  const std::vector<Case> cases = {
      {{6, 16}, {6, 16}, {16}},
      {{2, 5, 16}, {1, 5, 16}, {16}},
      {{2, 3, 4, 8}, {4, 8}, {4, 8}},
  };
  for (const auto& c : cases) {
    const auto x = randSigned(c.input, at::kFloat) * 2;
    const auto y = randSigned(c.other, at::kFloat);
    const auto w = randSigned(c.shape, at::kFloat);
    const auto b = randSigned(c.shape, at::kFloat);
    for (const bool affine : {false, true}) {
      for (const bool write_sum : {false, true}) {
        const auto [out, sum] = custom_add_layer_norm(
            x, y, 0.5, true, c.shape, affine ? opt(w) : std::nullopt,
            affine ? opt(b) : std::nullopt, 1e-5, write_sum);
        const auto s64 = at::add(x.to(at::kDouble), y.to(at::kDouble), 0.5);
        const auto ref = at::layer_norm(
            s64, c.shape, affine ? opt(w.to(at::kDouble)) : std::nullopt,
            affine ? opt(b.to(at::kDouble)) : std::nullopt, 1e-5);
        expectClose(out, ref.to(at::kFloat), "normalized");
        if (write_sum) {
          expectClose(sum, s64.to(at::kFloat), "sum");
        } else {
          EXPECT_EQ(sum.numel(), 0);
          EXPECT_EQ(sum.scalar_type(), at::kFloat);
        }
      }
    }
  }
}

TEST(AddLayerNormOp, KeepsTheInputDtypeWithoutPromotion) {
  torch::manual_seed(1);
  const auto x = randSigned({3, 8}, at::kFloat);
  const auto y = randSigned({3, 8}, at::kDouble);
  const auto [promoted, psum] =
      custom_add_layer_norm(x, y, 1, true, {8}, std::nullopt, std::nullopt, 1e-5, true);
  EXPECT_EQ(promoted.scalar_type(), at::kDouble);
  EXPECT_EQ(psum.scalar_type(), at::kDouble);
  const auto [kept, ksum] =
      custom_add_layer_norm(x, y, 1, false, {8}, std::nullopt, std::nullopt, 1e-5, true);
  EXPECT_EQ(kept.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(ksum, x.clone().add_(y)));
}

TEST(AddLayerNormOp, GradientsMatchTheChain) {
  torch::manual_seed(2);
  for (const bool write_sum : {false, true}) {
    expectMatchesReference(
        {randSigned({2, 3, 6}, at::kDouble), randSigned({2, 3, 6}, at::kDouble),
         randSigned({6}, at::kDouble), randSigned({6}, at::kDouble)},
        [write_sum](const std::vector<at::Tensor>& t) {
          const auto [out, sum] =
              custom_add_layer_norm(t[0], t[1], 2, true, {6}, t[2], t[3], 1e-5, write_sum);
          return write_sum ? out * sum : out;
        },
        [write_sum](const std::vector<at::Tensor>& t) {
          const auto sum = at::add(t[0], t[1], 2);
          const auto out = at::layer_norm(sum, {6}, t[2], t[3], 1e-5);
          return write_sum ? out * sum : out;
        });
  }
}

TEST(AddLayerNormOp, RejectsBadArgumentsByName) {
  const auto x = randSigned({3, 8}, at::kFloat);
  const auto y = randSigned({3, 8}, at::kFloat);
  const auto none = std::nullopt;
  expectThrowsWith(
      [&] { custom_add_layer_norm(x, y, 1, true, {}, none, none, 1e-5, false); },
      "torchfuse::custom_add_layer_norm: expected normalized_shape to have at least 1 "
      "dimension, got 0");
  expectThrowsWith(
      [&] { custom_add_layer_norm(x, y, 1, true, {3}, none, none, 1e-5, false); },
      "torchfuse::custom_add_layer_norm: expected normalized_shape [3] to be the trailing "
      "sizes of input + other (sizes [3, 8])");
  expectThrowsWith(
      [&] {
        custom_add_layer_norm(x, randSigned({2, 8}, at::kFloat), 1, true, {8}, none, none, 1e-5,
                              false);
      },
      "torchfuse::custom_add_layer_norm: expected other (sizes [2, 8]) to broadcast with "
      "input (sizes [3, 8])");
  expectThrowsWith(
      [&] {
        custom_add_layer_norm(x, y, 1, true, {8}, randSigned({4}, at::kFloat), none, 1e-5,
                              false);
      },
      "torchfuse::custom_add_layer_norm: expected weight to have sizes normalized_shape = [8], "
      "got [4]");
}

} // namespace
} // namespace torchfuse
