// torchfuse::custom_linear_add_relu against relu(linear(x, W, b) + alpha * other).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include "test/cpp/util/op_test_utils.h"
#include "torchfuse/ops.h"

namespace {

using namespace torchfuse::test;

constexpr int64_t kIn = 6;
constexpr int64_t kOut = 5;

enum class OtherForm { PerFeature, ScalarLike, Full, BeyondOutput };

const char* name(OtherForm f) {
  switch (f) {
    case OtherForm::PerFeature:
      return "per-feature";
    case OtherForm::ScalarLike:
      return "scalar-like";
    case OtherForm::Full:
      return "full";
    default:
      return "beyond-output";
  }
}

std::vector<int64_t> otherSizes(OtherForm f, std::vector<int64_t> out_sizes) {
  switch (f) {
    case OtherForm::PerFeature:
      return {kOut};
    case OtherForm::ScalarLike:
      return {1};
    case OtherForm::Full:
      return out_sizes;
    default:
      // other broadcasts the result to a leading extra dimension.
      out_sizes.insert(out_sizes.begin(), 2);
      return out_sizes;
  }
}

struct Case {
  std::vector<int64_t> input_sizes;
  OtherForm other;
  bool bias;
  bool contiguous;
  double alpha;
};

std::string describe(const Case& c, at::ScalarType dtype) {
  std::ostringstream s;
  s << dtype << " input " << at::IntArrayRef(c.input_sizes) << " other "
    << name(c.other) << (c.bias ? " bias" : " no bias")
    << (c.contiguous ? " contiguous" : " non-contiguous") << " alpha " << c.alpha;
  return s.str();
}

// Leaves: input, weight, other[, bias].  Non-contiguous inputs are views:
// input takes every second element of a wider last dim, weight is the
// transpose of an (in, out) tensor, and a full other is a transpose.
void checkCase(const Case& c, at::ScalarType dtype) {
  SCOPED_TRACE(describe(c, dtype));
  auto out_sizes = c.input_sizes;
  out_sizes.back() = kOut;
  const auto other_sizes = otherSizes(c.other, out_sizes);
  const bool transpose_other = !c.contiguous && other_sizes.size() >= 2;

  auto input_base_sizes = c.input_sizes;
  if (!c.contiguous) {
    input_base_sizes.back() *= 2;
  }
  auto other_base_sizes = other_sizes;
  if (transpose_other) {
    std::swap(other_base_sizes[other_base_sizes.size() - 1],
              other_base_sizes[other_base_sizes.size() - 2]);
  }
  std::vector<at::Tensor> bases{
      randSigned(input_base_sizes, dtype),
      c.contiguous ? randSigned({kOut, kIn}, dtype) : randSigned({kIn, kOut}, dtype),
      randSigned(other_base_sizes, dtype)};
  if (c.bias) {
    bases.push_back(randSigned({kOut}, dtype));
  }

  const auto views = [&](const std::vector<at::Tensor>& l) {
    std::vector<at::Tensor> v{l[0], l[1], l[2]};
    if (!c.contiguous) {
      v[0] = l[0].slice(-1, 0, std::nullopt, 2);
      v[1] = l[1].t();
      if (transpose_other) {
        v[2] = l[2].transpose(-1, -2);
      }
      // NB: an empty tensor is always contiguous.
      EXPECT_TRUE(v[0].numel() == 0 || !v[0].is_contiguous());
      EXPECT_FALSE(v[1].is_contiguous());
    }
    std::optional<at::Tensor> bias;
    if (c.bias) {
      bias = l[3];
    }
    return std::make_tuple(v[0], v[1], bias, v[2]);
  };
  expectMatchesReference(
      bases,
      [&](const std::vector<at::Tensor>& l) {
        auto [x, w, b, other] = views(l);
        return torchfuse::custom_linear_add_relu(x, w, b, other, c.alpha);
      },
      [&](const std::vector<at::Tensor>& l) {
        auto [x, w, b, other] = views(l);
        return at::relu(at::add(at::linear(x, w, b), other, c.alpha));
      });
}

const std::vector<std::vector<int64_t>>& inputShapes() {
  static const std::vector<std::vector<int64_t>> shapes{
      {4, kIn}, {2, 3, kIn}, {kIn}, {0, kIn}};
  return shapes;
}

TEST(LinearAddRelu, MatchesCompositionForEveryOtherForm) {
  at::manual_seed(0);
  for (const auto dtype : testDtypes()) {
    for (const auto& shape : inputShapes()) {
      for (const auto form : {OtherForm::PerFeature, OtherForm::ScalarLike, OtherForm::Full}) {
        for (const bool bias : {true, false}) {
          checkCase({shape, form, bias, /*contiguous=*/true, 1.0}, dtype);
        }
      }
    }
  }
}

TEST(LinearAddRelu, MatchesCompositionOnNonContiguousInputs) {
  at::manual_seed(1);
  for (const auto dtype : testDtypes()) {
    for (const auto& shape : inputShapes()) {
      for (const auto form : {OtherForm::PerFeature, OtherForm::Full}) {
        checkCase({shape, form, /*bias=*/true, /*contiguous=*/false, 1.0}, dtype);
      }
    }
  }
}

TEST(LinearAddRelu, ScalesOtherByAlpha) {
  at::manual_seed(2);
  for (const auto dtype : testDtypes()) {
    for (const double alpha : {0.5, -2.0, 0.0}) {
      checkCase({{3, kIn}, OtherForm::Full, true, true, alpha}, dtype);
      checkCase({{3, kIn}, OtherForm::PerFeature, false, true, alpha}, dtype);
    }
  }
}

TEST(LinearAddRelu, BroadcastsResultToOthersShape) {
  at::manual_seed(3);
  for (const auto dtype : testDtypes()) {
    checkCase({{3, kIn}, OtherForm::BeyondOutput, true, true, 1.0}, dtype);
    checkCase({{3, kIn}, OtherForm::BeyondOutput, false, true, -1.5}, dtype);
  }
}

TEST(LinearAddRelu, EmptyBatchGivesEmptyResultAndZeroGradients) {
  at::manual_seed(4);
  const auto x = randSigned({0, kIn}, at::kFloat).set_requires_grad(true);
  const auto w = randSigned({kOut, kIn}, at::kFloat).set_requires_grad(true);
  const auto other = randSigned({kOut}, at::kFloat).set_requires_grad(true);
  const auto out = torchfuse::custom_linear_add_relu(x, w, std::nullopt, other);
  EXPECT_EQ(out.sizes(), at::IntArrayRef({0, kOut}));
  out.sum().backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_TRUE(w.grad().eq(0).all().item<bool>());
  EXPECT_TRUE(other.grad().eq(0).all().item<bool>());
}

TEST(LinearAddRelu, NoGradGivesTheSameOutputWithoutAGraph) {
  at::manual_seed(5);
  const auto x = randSigned({4, kIn}, at::kFloat).set_requires_grad(true);
  const auto w = randSigned({kOut, kIn}, at::kFloat).set_requires_grad(true);
  const auto b = randSigned({kOut}, at::kFloat);
  const auto other = randSigned({4, kOut}, at::kFloat);
  const auto expected = at::relu(at::linear(x, w, b) + other).detach();
  c10::NoGradGuard no_grad;
  const auto out = torchfuse::custom_linear_add_relu(x, w, b, other);
  EXPECT_FALSE(out.requires_grad());
  expectClose(out, expected, "no-grad output");
}

// A gradient penalty: d/dw of |d out / dx|^2, against ATen's chain.
TEST(LinearAddRelu, DoubleBackwardMatchesAten) {
  at::manual_seed(6);
  const auto x = randSigned({4, kIn}, at::kDouble).set_requires_grad(true);
  const auto w = randSigned({kOut, kIn}, at::kDouble).set_requires_grad(true);
  const auto b = randSigned({kOut}, at::kDouble).set_requires_grad(true);
  const auto other = randSigned({kOut}, at::kDouble).set_requires_grad(true);
  const auto penalty_grads = [&](const at::Tensor& out) {
    const auto gx = torch::autograd::grad(
        {out}, {x}, {randSigned(out.sizes(), at::kDouble)}, true, true)[0];
    return torch::autograd::grad({gx.pow(2).sum()}, {w, b, other}, {}, false, false, true);
  };
  at::manual_seed(7);
  const auto got = penalty_grads(torchfuse::custom_linear_add_relu(x, w, b, other, -0.5));
  at::manual_seed(7);
  const auto want = penalty_grads(at::relu(at::add(at::linear(x, w, b), other, -0.5)));
  expectClose(got[0], want[0], "d penalty / d weight");
  // NB: bias and other reach the penalty only through relu's mask: ATen
  // gives zeros, the fused backward no gradient; both mean 0.
  for (const size_t i : {1, 2}) {
    EXPECT_TRUE(!got[i].defined() || got[i].eq(0).all().item<bool>());
    EXPECT_TRUE(want[i].eq(0).all().item<bool>());
  }
}

// ---- input checks, one per message ----

at::Tensor f32(at::IntArrayRef sizes) {
  return randSigned(sizes, at::kFloat);
}

TEST(LinearAddRelu, RejectsWeightThatIsNot2D) {
  expectThrowsWith(
      [] { torchfuse::custom_linear_add_relu(f32({2, kIn}), f32({kOut, kIn, 1}), std::nullopt, f32({kOut})); },
      "torchfuse::custom_linear_add_relu: expected weight to be 1-D or 2-D, got 3-D");
}

TEST(LinearAddRelu, RejectsZeroDimInput) {
  expectThrowsWith(
      [] { torchfuse::custom_linear_add_relu(f32({}), f32({kOut, kIn}), std::nullopt, f32({kOut})); },
      "torchfuse::custom_linear_add_relu: expected input to be at least 1-D, got 0-D");
}

TEST(LinearAddRelu, RejectsInFeaturesMismatch) {
  expectThrowsWith(
      [] { torchfuse::custom_linear_add_relu(f32({2, kIn + 1}), f32({kOut, kIn}), std::nullopt, f32({kOut})); },
      "expected input.size(-1) to equal weight.size(-1) (in_features = 6), got 7");
}

// Inputs the kernels do not take run the original chain (ATen's linear
// takes int64 on the CPU, a bias of shape (1, n) or (), a 1-D weight).
TEST(LinearAddRelu, IntegerInputRunsTheOriginalChain) {
  const auto x = at::randint(-5, 5, {2, kIn}, at::kLong);
  const auto w = at::randint(-5, 5, {kOut, kIn}, at::kLong);
  const auto b = at::randint(-5, 5, {kOut}, at::kLong);
  const auto other = at::randint(-5, 5, {kOut}, at::kLong);
  const auto out = torchfuse::custom_linear_add_relu(x, w, b, other, 2);
  EXPECT_EQ(out.scalar_type(), at::kLong);
  EXPECT_TRUE(out.equal(at::relu(at::add(at::linear(x, w, b), other, 2))));
}

TEST(LinearAddRelu, BroadcastBiasAndVectorWeightRunTheOriginalChain) {
  at::manual_seed(8);
  for (const auto& bias_sizes : std::vector<std::vector<int64_t>>{{1, kOut}, {}, {1}}) {
    SCOPED_TRACE("bias " + c10::str(at::IntArrayRef(bias_sizes)));
    expectMatchesReference(
        {f32({4, kIn}), f32({kOut, kIn}), f32(bias_sizes), f32({4, kOut})},
        [](const std::vector<at::Tensor>& l) {
          return torchfuse::custom_linear_add_relu(l[0], l[1], l[2], l[3], 0.5);
        },
        [](const std::vector<at::Tensor>& l) {
          return at::relu(at::add(at::linear(l[0], l[1], l[2]), l[3], 0.5));
        });
  }
  expectMatchesReference(
      {f32({4, kIn}), f32({kIn}), f32({4})},
      [](const std::vector<at::Tensor>& l) {
        return torchfuse::custom_linear_add_relu(l[0], l[1], std::nullopt, l[2]);
      },
      [](const std::vector<at::Tensor>& l) { return at::relu(at::linear(l[0], l[1]) + l[2]); });
}

TEST(LinearAddRelu, RejectsWeightDtypeMismatch) {
  expectThrowsWith(
      [] {
        torchfuse::custom_linear_add_relu(
            f32({2, kIn}), f32({kOut, kIn}).to(at::kDouble), std::nullopt, f32({kOut}));
      },
      "expected weight to have the same dtype as input (Float), got Double");
}

// NB: ATen's linear rejects a float64 bias with a 2-D float32 input, but its
// in-place bias add takes one with a non-contiguous 3-D input.
TEST(LinearAddRelu, BiasOfAnotherDtypeBehavesAsAten) {
  const auto b64 = f32({kOut}).to(at::kDouble);
  expectThrowsWith(
      [&] { torchfuse::custom_linear_add_relu(f32({2, kIn}), f32({kOut, kIn}), b64, f32({kOut})); },
      "self and mat2 must have the same dtype");
  const auto x = f32({2, kIn, 3}).transpose(1, 2);
  const auto w = f32({kOut, kIn});
  const auto other = f32({kOut});
  const auto out = torchfuse::custom_linear_add_relu(x, w, b64, other);
  EXPECT_TRUE(out.equal(at::relu(at::linear(x, w, b64) + other)));
}

TEST(LinearAddRelu, RejectsBiasOfWrongLength) {
  expectThrowsWith(
      [] { torchfuse::custom_linear_add_relu(f32({2, kIn}), f32({kOut, kIn}), f32({kOut + 1}), f32({kOut})); },
      "expected bias to have weight.size(0) = 5 elements, got 6");
}

TEST(LinearAddRelu, RejectsOtherNotBroadcastable) {
  expectThrowsWith(
      [] { torchfuse::custom_linear_add_relu(f32({2, kIn}), f32({kOut, kIn}), std::nullopt, f32({3})); },
      "torchfuse::custom_linear_add_relu: expected other to be broadcastable to [2, 5], got [3]");
}

// A meta tensor among CPU tensors dispatches to the Meta kernel, which runs
// the same checks: this exercises the device check without a GPU.
TEST(LinearAddRelu, RejectsWeightOnAnotherDevice) {
  expectThrowsWith(
      [] {
        torchfuse::custom_linear_add_relu(
            f32({2, kIn}), at::empty({kOut, kIn}, at::device(at::kMeta)), std::nullopt,
            f32({kOut}));
      },
      "expected weight to be on the same device as input (cpu), got meta");
}

TEST(LinearAddRelu, RejectsOtherOnAnotherDevice) {
  expectThrowsWith(
      [] {
        torchfuse::custom_linear_add_relu(
            f32({2, kIn}), f32({kOut, kIn}), std::nullopt,
            at::empty({kOut}, at::device(at::kMeta)));
      },
      "expected other to be on the same device as input (cpu), got meta");
}

} // namespace
