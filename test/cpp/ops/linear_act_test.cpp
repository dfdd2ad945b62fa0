#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test/cpp/util/op_test_utils.h"
#include "torchfuse/ops.h"

namespace torchfuse {
namespace {

using namespace torchfuse::test;


// The op in float32 against the chain in float64, for every activation,
// 2-D and 3-D inputs, with and without a bias.
TEST(LinearActOp, MatchesTheFloat64ChainOnCpu) {
  torch::manual_seed(0);
  const auto w = randSigned({6, 9}, at::kFloat);
  const auto b = randSigned({6}, at::kFloat);
  for (const auto& sizes : {std::vector<int64_t>{5, 9}, std::vector<int64_t>{2, 4, 9}}) {
    const auto x = randSigned(sizes, at::kFloat) * 2;
    for (const auto& act : activations()) {
      for (const bool with_bias : {false, true}) {
        const auto bias = with_bias ? std::optional<at::Tensor>(b) : std::nullopt;
        const auto out = custom_linear_act(x, w, bias, act.name, act.args);
        const auto ref = act.eager(at::linear(
            x.to(at::kDouble), w.to(at::kDouble),
            with_bias ? std::optional<at::Tensor>(b.to(at::kDouble)) : std::nullopt));
        const std::string what = std::string(act.name) + (with_bias ? " +bias" : "");
        ASSERT_EQ(out.scalar_type(), at::kFloat) << what;
        ASSERT_EQ(out.sizes(), ref.sizes()) << what;
        expectClose(out, ref.to(at::kFloat), what);
      }
    }
  }
}

TEST(LinearActOp, GradientsMatchTheChain) {
  torch::manual_seed(1);
  expectMatchesReference(
      {randSigned({2, 3, 5}, at::kDouble), randSigned({4, 5}, at::kDouble),
       randSigned({4}, at::kDouble)},
      [](const std::vector<at::Tensor>& t) {
        return custom_linear_act(t[0], t[1], t[2], "gelu", {});
      },
      [](const std::vector<at::Tensor>& t) {
        return at::gelu(at::linear(t[0], t[1], t[2]), "none");
      });
}

// The residual through the C++ API, in each spelling, with its gradients.
TEST(LinearActOp, ResidualGradientsMatchTheChain) {
  torch::manual_seed(2);
  struct Form {
    bool promote, other_first;
  };
  for (const auto form : {Form{true, false}, Form{false, false}, Form{true, true}}) {
    expectMatchesReference(
        {randSigned({2, 3, 5}, at::kDouble), randSigned({4, 5}, at::kDouble),
         randSigned({4}, at::kDouble), randSigned({2, 3, 4}, at::kDouble)},
        [&](const std::vector<at::Tensor>& t) {
          return custom_linear_act(
              t[0], t[1], t[2], "silu", {}, t[3], 0.5, form.promote, form.other_first);
        },
        [&](const std::vector<at::Tensor>& t) {
          auto y = at::linear(t[0], t[1], t[2]);
          y = form.other_first ? at::add(t[3], y, 0.5)
              : form.promote   ? at::add(y, t[3], 0.5)
                               : y.add_(t[3], 0.5);
          return at::silu(y);
        });
  }
}

TEST(LinearActOp, RejectsBadArgumentsByName) {
  const auto x = randSigned({3, 4}, at::kFloat);
  const auto w = randSigned({5, 4}, at::kFloat);
  expectThrowsWith(
      [&] { custom_linear_act(x, w, std::nullopt, "tanh", {}); },
      "torchfuse::custom_linear_act: expected activation to be one of none, relu");
  expectThrowsWith(
      [&] { custom_linear_act(x, w, std::nullopt, "leaky_relu", {}); },
      "torchfuse::custom_linear_act: expected activation_args to have 1 elements for "
      "activation 'leaky_relu', got 0");
  expectThrowsWith(
      [&] {
        custom_linear_act(x, randSigned({5, 3}, at::kFloat), std::nullopt, "relu", {});
      },
      "torchfuse::custom_linear_act: expected input.size(-1) to equal weight.size(-1) "
      "(in_features = 3), got 4");
  expectThrowsWith(
      [&] {
        custom_linear_act(x, randSigned({5, 4}, at::kDouble), std::nullopt, "relu", {});
      },
      "torchfuse::custom_linear_act: expected weight");
  expectThrowsWith(
      [&] { custom_linear_act(x, w, randSigned({3}, at::kFloat), "relu", {}); },
      "torchfuse::custom_linear_act: expected bias to have weight.size(0) = 5 elements, got 3");
}

} // namespace
} // namespace torchfuse
