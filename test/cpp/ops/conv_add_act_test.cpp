#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ops/conv_add_act.h"
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

namespace torchfuse {
namespace {

// A tensor allocated in `format`, as a convolution allocates its output
// (for a [N, C, 1, 1] channels-last output: strides (C, 1, C, C)).
at::Tensor allocatedIn(std::vector<int64_t> sizes, at::MemoryFormat format) {
  return at::empty(sizes, at::TensorOptions(at::kFloat).memory_format(format))
      .copy_(randSigned(sizes, at::kFloat));
}

// Conv outputs with size-1 dimensions in the layouts a convolution returns.
std::vector<at::Tensor> ambiguousOutputs() {
  std::vector<at::Tensor> ts;
  for (const auto& sizes : std::vector<std::vector<int64_t>>{
           {4, 6, 1, 1}, {1, 6, 1, 1}, {3, 1, 3, 4}, {2, 6, 1, 5}, {2, 6, 5, 1}, {4, 1, 1, 1}}) {
    ts.push_back(allocatedIn(sizes, at::MemoryFormat::Contiguous));
    ts.push_back(allocatedIn(sizes, at::MemoryFormat::ChannelsLast));
  }
  ts.push_back(allocatedIn({2, 3, 1, 1, 1}, at::MemoryFormat::ChannelsLast3d));
  ts.push_back(allocatedIn({2, 3, 1, 4, 5}, at::MemoryFormat::ChannelsLast3d));
  ts.push_back(allocatedIn({2, 3, 1}, at::MemoryFormat::Contiguous));
  return ts;
}

// outOfPlaceStrides against TensorIterator itself: an out-of-place
// activation, and an add whose operands share the output's strides.
TEST(ConvAddActOp, OutOfPlaceStridesAreTensorIterators) {
  torch::manual_seed(0);
  for (const auto& t : ambiguousOutputs()) {
    const auto other = at::empty_like(t).copy_(randSigned(t.sizes().vec(), at::kFloat));
    ASSERT_EQ(other.strides(), t.strides());
    const auto want = ops::outOfPlaceStrides(t);
    EXPECT_EQ(at::IntArrayRef(want), at::relu(t).strides()) << t.sizes() << " " << t.strides();
    EXPECT_EQ(at::IntArrayRef(want), at::add(t, other).strides())
        << t.sizes() << " " << t.strides();
    EXPECT_EQ(at::IntArrayRef(want), at::hardsigmoid(at::add(t, other)).strides()) << t.sizes();
    // hardtanh (relu6) picks none: it keeps its input's strides
    EXPECT_EQ(at::hardtanh(t, -0.5, 0.5).strides(), t.strides()) << t.sizes();
    EXPECT_EQ(at::IntArrayRef(want), at::hardtanh(at::add(t, other), 0, 6).strides()) << t.sizes();
  }
  // the rule is not the identity: a channels-last [4, 6, 1, 1]
  const auto cl = allocatedIn({4, 6, 1, 1}, at::MemoryFormat::ChannelsLast);
  EXPECT_NE(at::IntArrayRef(ops::outOfPlaceStrides(cl)), cl.strides());
}

// Which spellings hold an out-of-place op over an output with a size-1
// dimension: an out-of-place activation, or an out-of-place add (an in-place
// activation after it included); not the all-in-place chain.
TEST(ConvAddActOp, OutOfPlaceOverAmbiguousLayoutNamesEveryOutOfPlaceOp) {
  const auto x = randSigned({2, 3, 4, 4}, at::kFloat);
  const auto w = randSigned({5, 3, 4, 4}, at::kFloat);
  const std::optional<at::Tensor> bias;
  const std::optional<at::Tensor> other = randSigned({2, 5, 1, 1}, at::kFloat);
  const std::optional<at::Tensor> none;
  const at::Scalar alpha = 1;
  const std::vector<int64_t> one = {1}, zero = {0};
  struct Case {
    bool with_other;
    bool promote;
    const char* act;
    bool want;
  };
  for (const auto& c : std::vector<Case>{
           {false, true, "none", false},
           {false, true, "relu", true},
           {false, true, "relu_", false},
           {true, true, "none", true},
           {true, true, "relu_", true},
           {true, false, "relu_", false},
           {true, false, "relu", true},
           {true, false, "none", false},
           {false, true, "hardtanh", false},
           {false, true, "hardtanh_", false},
           {true, true, "hardtanh", true},
           {true, false, "hardtanh", false},
           {false, true, "silu", true}}) {
    const bool hardtanh = std::string(c.act).rfind("hardtanh", 0) == 0;
    const std::vector<double> args =
        hardtanh ? std::vector<double>{-0.5, 0.5} : std::vector<double>{};
    const ops::ConvAddActArgs a{
        x, w, bias, one, zero, one, 1, c.with_other ? other : none, alpha, c.promote, c.act, args};
    const auto act = ops::parseActivation(c.act, args);
    EXPECT_EQ(ops::outOfPlaceOverAmbiguousLayout(a, act, {2, 5, 1, 1}), c.want)
        << c.act << (c.with_other ? (c.promote ? " add" : " add_") : "");
    EXPECT_FALSE(ops::outOfPlaceOverAmbiguousLayout(a, act, {2, 5, 3, 3})) << c.act;
  }
}

} // namespace
} // namespace torchfuse
