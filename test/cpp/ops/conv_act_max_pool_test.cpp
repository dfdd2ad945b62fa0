#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test/cpp/util/op_test_utils.h"
#include "torchfuse/ops.h"

namespace torchfuse {
namespace {

using namespace torchfuse::test;

// The op in float32 against the chain in float64: activations with their
// in-place spellings, pools with padding, dilation, ceil_mode and an empty
// stride (the kernel size).
TEST(ConvActMaxPoolOp, MatchesTheFloat64ChainOnCpu) {
  torch::manual_seed(0);
  const auto x = randSigned({2, 4, 9, 9}, at::kFloat) * 2;
  const auto w = randSigned({6, 2, 3, 3}, at::kFloat);
  const auto b = randSigned({6}, at::kFloat);
  struct Pool {
    std::vector<int64_t> k, s, p, d;
    bool ceil;
  };
  const std::vector<Pool> pools = {
      {{2}, {}, {0}, {1}, false},
      {{3, 3}, {2, 2}, {1, 1}, {1, 1}, false},
      {{3, 2}, {2, 1}, {1, 0}, {2, 1}, true},
  };
  for (const auto& act : activations()) {
    for (const auto& p : pools) {
      const auto out = custom_conv_act_max_pool(
          x, w, b, {1}, {1}, {1}, 2, act.name, act.args, p.k, p.s, p.p, p.d, p.ceil);
      const auto t = act.eager(
          at::conv2d(x.to(at::kDouble), w.to(at::kDouble), b.to(at::kDouble), {1}, {1}, {1}, 2));
      const auto ref = at::max_pool2d(t, p.k, p.s, p.p, p.d, p.ceil);
      ASSERT_EQ(out.sizes(), ref.sizes()) << act.name;
      expectClose(out, ref.to(at::kFloat), act.name);
    }
  }
}

TEST(ConvActMaxPoolOp, GradientsMatchTheChain) {
  torch::manual_seed(1);
  expectMatchesReference(
      {randSigned({2, 3, 6, 6}, at::kDouble), randSigned({4, 3, 3, 3}, at::kDouble),
       randSigned({4}, at::kDouble)},
      [](const std::vector<at::Tensor>& t) {
        return custom_conv_act_max_pool(
            t[0], t[1], t[2], {1}, {1}, {1}, 1, "silu", {}, {2}, {2}, {0}, {1}, false);
      },
      [](const std::vector<at::Tensor>& t) {
        return at::max_pool2d(at::silu(at::conv2d(t[0], t[1], t[2], {1}, {1})), {2}, {2});
      });
}

TEST(ConvActMaxPoolOp, RejectsBadArgumentsByName) {
  const auto x = randSigned({1, 2, 4, 4}, at::kFloat);
  const auto w = randSigned({3, 2, 1, 1}, at::kFloat);
  const auto call = [&](const char* act, std::vector<double> args, at::Tensor weight) {
    return [=] {
      custom_conv_act_max_pool(
          x, weight, std::nullopt, {1}, {0}, {1}, 1, act, args, {2}, {2}, {0}, {1}, false);
    };
  };
  expectThrowsWith(
      call("tanh", {}, w),
      "torchfuse::custom_conv_act_max_pool: expected activation to be one of none, relu");
  expectThrowsWith(
      call("relu", {1.0}, w),
      "torchfuse::custom_conv_act_max_pool: expected activation_args to have 0 elements");
  expectThrowsWith(
      call("relu", {}, randSigned({3, 5, 1, 1}, at::kFloat)),
      "torchfuse::custom_conv_act_max_pool: expected");
  // The pool's own checks are max_pool2d's.
  EXPECT_THROW(
      custom_conv_act_max_pool(
          x, w, std::nullopt, {1}, {0}, {1}, 1, "relu", {}, {2}, {2}, {2}, {1}, false),
      c10::Error);
}

} // namespace
} // namespace torchfuse
