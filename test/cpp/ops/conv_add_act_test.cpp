#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test/cpp/util/op_test_utils.h"
#include "torchfuse/ops.h"

namespace torchfuse {
namespace {

using namespace torchfuse::test;

// The op in float32 against the chain in float64, for every activation,
// with and without other, promote or not, grouped.
TEST(ConvAddActOp, MatchesTheFloat64ChainOnCpu) {
  torch::manual_seed(0);
  const auto x = randSigned({2, 4, 7, 7}, at::kFloat) * 2;
  const auto w = randSigned({6, 2, 3, 3}, at::kFloat);
  const auto b = randSigned({6}, at::kFloat);
  const auto other = randSigned({2, 6, 4, 4}, at::kFloat);
  for (const auto& act : activations()) {
    for (const bool with_other : {false, true}) {
      for (const bool promote : {false, true}) {
        const auto out = custom_conv_add_act(
            x, w, b, {2}, {1}, {1}, 2, with_other ? std::optional<at::Tensor>(other) : std::nullopt,
            0.5, promote, act.name, act.args);
        auto ref =
            at::conv2d(x.to(at::kDouble), w.to(at::kDouble), b.to(at::kDouble), {2}, {1}, {1}, 2);
        if (with_other) {
          ref = ref + 0.5 * other.to(at::kDouble);
        }
        ref = act.eager(ref);
        const std::string what = std::string(act.name) + (with_other ? " +other" : "");
        ASSERT_EQ(out.scalar_type(), at::kFloat) << what;
        expectClose(out, ref.to(at::kFloat), what);
      }
    }
  }
}

TEST(ConvAddActOp, GradientsMatchTheChain) {
  torch::manual_seed(1);
  expectMatchesReference(
      {randSigned({2, 3, 5, 5}, at::kDouble), randSigned({4, 3, 3, 3}, at::kDouble),
       randSigned({4}, at::kDouble), randSigned({2, 4, 3, 3}, at::kDouble)},
      [](const std::vector<at::Tensor>& t) {
        return custom_conv_add_act(t[0], t[1], t[2], {1}, {0}, {1}, 1, t[3], 2, true, "silu", {});
      },
      [](const std::vector<at::Tensor>& t) {
        return at::silu(at::add(at::conv2d(t[0], t[1], t[2]), t[3], 2));
      });
}

TEST(ConvAddActOp, PromoteSelectsTheAddsDtype) {
  const auto x = randSigned({1, 2, 4, 4}, at::kFloat);
  const auto w = randSigned({3, 2, 1, 1}, at::kFloat);
  const auto other = randSigned({1, 3, 4, 4}, at::kDouble);
  EXPECT_EQ(
      custom_conv_add_act(x, w, std::nullopt, {1}, {0}, {1}, 1, other, 1, true, "relu", {})
          .scalar_type(),
      at::kDouble);
  EXPECT_EQ(
      custom_conv_add_act(x, w, std::nullopt, {1}, {0}, {1}, 1, other, 1, false, "relu", {})
          .scalar_type(),
      at::kFloat);
}

TEST(ConvAddActOp, RejectsBadArgumentsByName) {
  const auto x = randSigned({1, 2, 4, 4}, at::kFloat);
  const auto w = randSigned({3, 2, 1, 1}, at::kFloat);
  const auto call = [&](const char* act, std::vector<double> args,
                        std::optional<at::Tensor> other = std::nullopt, bool promote = true) {
    return [=] {
      custom_conv_add_act(x, w, std::nullopt, {1}, {0}, {1}, 1, other, 1, promote, act, args);
    };
  };
  expectThrowsWith(
      call("tanh", {}),
      "torchfuse::custom_conv_add_act: expected activation to be one of none, relu");
  expectThrowsWith(
      call("hardtanh", {0.0}),
      "torchfuse::custom_conv_add_act: expected activation_args to have 2 elements for "
      "activation 'hardtanh', got 1");
  expectThrowsWith(
      call("relu", {1.0}), "expected activation_args to have 0 elements for activation 'relu'");
  expectThrowsWith(
      call("relu", {}, randSigned({2, 3, 4, 4}, at::kFloat), /*promote=*/false),
      "torchfuse::custom_conv_add_act: expected other to broadcast to the conv output's shape");
  expectThrowsWith(
      call("relu", {}, randSigned({5, 4, 4}, at::kFloat)),
      "torchfuse::custom_conv_add_act: expected other to be broadcastable");
}

} // namespace
} // namespace torchfuse
