// torchfuse::custom_conv_relu_add against relu(conv_nd(x, W, b, ...)) + alpha * other.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test/cpp/util/op_test_utils.h"
#include "torchfuse/ops.h"

namespace {

using namespace torchfuse::test;

enum class OtherForm { PerChannel, ScalarLike, Full };

struct Case {
  int64_t spatial; // 1, 2 or 3
  int64_t batch; // -1: unbatched
  std::vector<int64_t> stride;
  std::vector<int64_t> padding;
  std::vector<int64_t> dilation;
  int64_t groups;
  OtherForm other;
  bool bias;
  bool contiguous;
  double alpha;
};

constexpr int64_t kInChannels = 4;
constexpr int64_t kOutChannels = 6;

at::Tensor reference(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    const Case& c, const at::Tensor& other) {
  at::Tensor conv;
  switch (c.spatial) {
    case 1:
      conv = at::conv1d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
      break;
    case 2:
      conv = at::conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
      break;
    default:
      conv = at::conv3d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
  }
  return at::add(at::relu(conv), other, c.alpha);
}

std::string describe(const Case& c, at::ScalarType dtype) {
  std::ostringstream s;
  s << dtype << " conv" << c.spatial << "d batch " << c.batch << " stride "
    << at::IntArrayRef(c.stride) << " padding " << at::IntArrayRef(c.padding)
    << " dilation " << at::IntArrayRef(c.dilation) << " groups " << c.groups
    << " other " << static_cast<int>(c.other) << (c.bias ? " bias" : " no bias")
    << (c.contiguous ? " contiguous" : " non-contiguous") << " alpha " << c.alpha;
  return s.str();
}

// Leaves: input, weight, other[, bias].  Non-contiguous: input and weight are
// transposes of their last two dims (spatial, or channel and the only spatial
// dim), and a full other is a transpose too.
void checkCase(const Case& c, at::ScalarType dtype) {
  SCOPED_TRACE(describe(c, dtype));
  const std::vector<int64_t> spatial_in{7, 6, 5};
  const std::vector<int64_t> kernel{3, 2, 3};
  std::vector<int64_t> input_sizes;
  if (c.batch >= 0) {
    input_sizes.push_back(c.batch);
  }
  input_sizes.push_back(kInChannels);
  std::vector<int64_t> weight_sizes{kOutChannels, kInChannels / c.groups};
  for (int64_t d = 0; d < c.spatial; ++d) {
    input_sizes.push_back(spatial_in[d]);
    weight_sizes.push_back(kernel[d]);
  }
  // The output shape, from ATen itself.
  const auto probe = reference(
      at::zeros(input_sizes, at::kDouble), at::zeros(weight_sizes, at::kDouble),
      std::nullopt, c, at::zeros({1}, at::kDouble));
  std::vector<int64_t> other_sizes;
  switch (c.other) {
    case OtherForm::PerChannel:
      other_sizes.assign(c.spatial + 1, 1);
      other_sizes[0] = kOutChannels;
      break;
    case OtherForm::ScalarLike:
      other_sizes = {1};
      break;
    case OtherForm::Full:
      other_sizes = probe.sizes().vec();
  }
  const auto swapLast = [](std::vector<int64_t> v) {
    if (v.size() >= 2) {
      std::swap(v[v.size() - 1], v[v.size() - 2]);
    }
    return v;
  };
  const bool transpose_other = !c.contiguous && c.other == OtherForm::Full;
  std::vector<at::Tensor> bases{
      randSigned(c.contiguous ? input_sizes : swapLast(input_sizes), dtype),
      randSigned(c.contiguous ? weight_sizes : swapLast(weight_sizes), dtype),
      randSigned(transpose_other ? swapLast(other_sizes) : other_sizes, dtype)};
  if (c.bias) {
    bases.push_back(randSigned({kOutChannels}, dtype));
  }
  const auto views = [&](const std::vector<at::Tensor>& l) {
    auto x = c.contiguous ? l[0] : l[0].transpose(-1, -2);
    auto w = c.contiguous ? l[1] : l[1].transpose(-1, -2);
    auto other = transpose_other ? l[2].transpose(-1, -2) : l[2];
    std::optional<at::Tensor> b;
    if (c.bias) {
      b = l[3];
    }
    return std::make_tuple(x, w, b, other);
  };
  expectMatchesReference(
      bases,
      [&](const std::vector<at::Tensor>& l) {
        auto [x, w, b, other] = views(l);
        return torchfuse::custom_conv_relu_add(
            x, w, b, c.stride, c.padding, c.dilation, c.groups, other, c.alpha);
      },
      [&](const std::vector<at::Tensor>& l) {
        auto [x, w, b, other] = views(l);
        return reference(x, w, b, c, other);
      });
}

TEST(ConvReluAdd, MatchesCompositionIn1d2d3d) {
  at::manual_seed(0);
  for (const auto dtype : testDtypes()) {
    for (const int64_t spatial : {1, 2, 3}) {
      for (const bool bias : {true, false}) {
        checkCase({spatial, 2, {1}, {1}, {1}, 1, OtherForm::PerChannel, bias, true, 1.0}, dtype);
      }
    }
  }
}

TEST(ConvReluAdd, MatchesCompositionForEveryOtherForm) {
  at::manual_seed(1);
  for (const auto dtype : testDtypes()) {
    for (const auto form : {OtherForm::PerChannel, OtherForm::ScalarLike, OtherForm::Full}) {
      checkCase({2, 2, {1}, {0}, {1}, 1, form, true, true, 1.0}, dtype);
      checkCase({1, 3, {1}, {1}, {1}, 1, form, false, true, 1.0}, dtype);
    }
  }
}

TEST(ConvReluAdd, MatchesCompositionOnUnbatchedInputs) {
  at::manual_seed(2);
  for (const auto dtype : testDtypes()) {
    for (const int64_t spatial : {1, 2, 3}) {
      checkCase({spatial, -1, {1}, {1}, {1}, 1, OtherForm::Full, true, true, 1.0}, dtype);
      checkCase({spatial, -1, {1}, {0}, {1}, 1, OtherForm::PerChannel, false, true, 1.0}, dtype);
    }
  }
}

TEST(ConvReluAdd, MatchesCompositionWithStridePaddingDilationGroups) {
  at::manual_seed(3);
  for (const auto dtype : testDtypes()) {
    checkCase({2, 2, {2, 1}, {1, 2}, {1, 2}, 2, OtherForm::Full, true, true, 1.0}, dtype);
    checkCase({1, 2, {2}, {2}, {2}, 2, OtherForm::PerChannel, false, true, 1.0}, dtype);
    checkCase({3, 1, {2}, {1}, {1}, 2, OtherForm::ScalarLike, true, true, 1.0}, dtype);
  }
}

TEST(ConvReluAdd, MatchesCompositionOnNonContiguousInputs) {
  at::manual_seed(4);
  for (const auto dtype : testDtypes()) {
    for (const int64_t spatial : {1, 2, 3}) {
      checkCase({spatial, 2, {1}, {1}, {1}, 1, OtherForm::Full, true, false, 1.0}, dtype);
    }
    checkCase({2, -1, {1}, {1}, {1}, 2, OtherForm::PerChannel, false, false, 1.0}, dtype);
  }
}

TEST(ConvReluAdd, ScalesOtherByAlpha) {
  at::manual_seed(5);
  for (const auto dtype : testDtypes()) {
    for (const double alpha : {0.5, -2.0}) {
      checkCase({2, 2, {1}, {1}, {1}, 1, OtherForm::Full, true, true, alpha}, dtype);
      checkCase({1, 2, {1}, {1}, {1}, 1, OtherForm::PerChannel, false, true, alpha}, dtype);
    }
  }
}

TEST(ConvReluAdd, MatchesCompositionOnEmptyBatch) {
  at::manual_seed(6);
  for (const auto dtype : testDtypes()) {
    for (const int64_t spatial : {1, 2, 3}) {
      checkCase({spatial, 0, {1}, {1}, {1}, 1, OtherForm::PerChannel, true, true, 1.0}, dtype);
      checkCase({spatial, 0, {1}, {1}, {1}, 1, OtherForm::ScalarLike, false, true, 1.0}, dtype);
    }
  }
}

TEST(ConvReluAdd, NoGradGivesTheSameOutputWithoutAGraph) {
  at::manual_seed(7);
  const auto x = randSigned({2, kInChannels, 5, 5}, at::kFloat).set_requires_grad(true);
  const auto w = randSigned({kOutChannels, kInChannels, 3, 3}, at::kFloat).set_requires_grad(true);
  const auto other = randSigned({kOutChannels, 1, 1}, at::kFloat);
  const auto expected = (at::relu(at::conv2d(x, w, {}, 1, 1)) + other).detach();
  c10::NoGradGuard no_grad;
  const auto out = torchfuse::custom_conv_relu_add(x, w, std::nullopt, {1}, {1}, {1}, 1, other);
  EXPECT_FALSE(out.requires_grad());
  expectClose(out, expected, "no-grad output");
}

TEST(ConvReluAdd, DoubleBackwardMatchesComposition) {
  at::manual_seed(8);
  const auto reference = [](const std::vector<at::Tensor>& l, double alpha) {
    return at::relu(at::conv1d(l[0], l[1], l[2], {2}, {1}, {2}, 2)) + alpha * l[3];
  };
  for (const auto& other_sizes : std::vector<std::vector<int64_t>>{{6, 1}, {1}, {2, 6, 3}}) {
    for (const double alpha : {1.0, -2.5}) {
      SCOPED_TRACE("other " + c10::str(at::IntArrayRef(other_sizes)) + " alpha " + c10::str(alpha));
      expectDoubleBackwardMatchesReference(
          {randSigned({2, 4, 7}, at::kDouble), randSigned({6, 2, 3}, at::kDouble),
           randSigned({6}, at::kDouble), randSigned(other_sizes, at::kDouble)},
          [&](const std::vector<at::Tensor>& l) {
            return torchfuse::custom_conv_relu_add(
                l[0], l[1], l[2], {2}, {1}, {2}, 2, l[3], alpha);
          },
          [&](const std::vector<at::Tensor>& l) { return reference(l, alpha); });
    }
  }
}

// ---- input checks, one per message ----

at::Tensor f32(at::IntArrayRef sizes) {
  return randSigned(sizes, at::kFloat);
}

void callConv2d(
    const at::Tensor& x,
    const at::Tensor& w,
    const std::optional<at::Tensor>& b = std::nullopt,
    std::vector<int64_t> stride = {1},
    std::vector<int64_t> padding = {0},
    std::vector<int64_t> dilation = {1},
    int64_t groups = 1,
    std::optional<at::Tensor> other = std::nullopt) {
  torchfuse::custom_conv_relu_add(
      x, w, b, stride, padding, dilation, groups,
      other.has_value() ? *other : f32({1}));
}

TEST(ConvReluAdd, RejectsWeightOfUnsupportedRank) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5}), f32({6, 4})); },
      "torchfuse::custom_conv_relu_add: expected weight to be 3-D, 4-D or 5-D (a 1-d, 2-d or 3-d convolution), got 2-D");
}

TEST(ConvReluAdd, RejectsInputOfWrongRank) {
  expectThrowsWith(
      [] { callConv2d(f32({1, 2, 4, 5, 5}), f32({6, 4, 3, 3})); },
      "expected input to be 4-D (batched) or 3-D (unbatched) for a 4-D weight, got 5-D");
}

TEST(ConvReluAdd, RejectsChannelMismatch) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 3, 5, 5}), f32({6, 4, 3, 3})); },
      "expected input to have 4 channels (weight.size(1) * groups), got 3");
}

TEST(ConvReluAdd, RejectsOutChannelsNotDivisibleByGroups) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5, 5}), f32({3, 2, 3, 3}), std::nullopt, {1}, {0}, {1}, 2); },
      "expected weight.size(0) to be divisible by groups (2), got 3");
}

TEST(ConvReluAdd, RejectsNonPositiveGroups) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5, 5}), f32({6, 4, 3, 3}), std::nullopt, {1}, {0}, {1}, 0); },
      "expected groups >= 1, got 0");
}

TEST(ConvReluAdd, RejectsStrideOfWrongLength) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5, 5}), f32({6, 4, 3, 3}), std::nullopt, {1, 1, 1}); },
      "expected stride to have 1 or 2 elements, got 3");
}

TEST(ConvReluAdd, RejectsZeroStride) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5, 5}), f32({6, 4, 3, 3}), std::nullopt, {1, 0}); },
      "expected stride values >= 1, got [1, 0]");
}

TEST(ConvReluAdd, RejectsNegativePadding) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5, 5}), f32({6, 4, 3, 3}), std::nullopt, {1}, {-1}); },
      "expected padding values >= 0, got [-1]");
}

TEST(ConvReluAdd, RejectsZeroDilation) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5, 5}), f32({6, 4, 3, 3}), std::nullopt, {1}, {0}, {0}); },
      "expected dilation values >= 1, got [0]");
}

TEST(ConvReluAdd, RejectsInputSmallerThanDilatedKernel) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 2, 5}), f32({6, 4, 3, 3})); },
      "to be at least the dilated kernel size");
}

TEST(ConvReluAdd, RejectsBiasOfWrongLength) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5, 5}), f32({6, 4, 3, 3}), f32({5})); },
      "expected bias to have weight.size(0) = 6 elements, got 5");
}

TEST(ConvReluAdd, RejectsBiasOfWrongRank) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5, 5}), f32({6, 4, 3, 3}), f32({6, 1})); },
      "expected bias to be 1-D, got 2-D");
}

TEST(ConvReluAdd, RejectsIntegerInput) {
  expectThrowsWith(
      [] { callConv2d(at::ones({2, 4, 5, 5}, at::kInt), at::ones({6, 4, 3, 3}, at::kInt)); },
      "expected input to have a floating-point dtype, got Int");
}

TEST(ConvReluAdd, RejectsWeightDtypeMismatch) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5, 5}), f32({6, 4, 3, 3}).to(at::kDouble)); },
      "expected weight to have the same dtype as input (Float), got Double");
}

TEST(ConvReluAdd, RejectsBiasDtypeMismatch) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5, 5}), f32({6, 4, 3, 3}), f32({6}).to(at::kDouble)); },
      "expected bias to have the same dtype as input (Float), got Double");
}

TEST(ConvReluAdd, RejectsOtherNotBroadcastable) {
  expectThrowsWith(
      [] {
        callConv2d(f32({2, 4, 5, 5}), f32({6, 4, 3, 3}), std::nullopt, {1}, {0}, {1}, 1, f32({6}));
      },
      "torchfuse::custom_conv_relu_add: expected other to be broadcastable to [2, 6, 3, 3], got [6]");
}

// A meta tensor among CPU tensors dispatches to the Meta kernel, which runs
// the same checks: this exercises the device check without a GPU.
TEST(ConvReluAdd, RejectsWeightOnAnotherDevice) {
  expectThrowsWith(
      [] { callConv2d(f32({2, 4, 5, 5}), at::empty({6, 4, 3, 3}, at::device(at::kMeta))); },
      "expected weight to be on the same device as input (cpu), got meta");
}

TEST(ConvReluAdd, RejectsOtherOnAnotherDevice) {
  expectThrowsWith(
      [] {
        callConv2d(
            f32({2, 4, 5, 5}), f32({6, 4, 3, 3}), std::nullopt, {1}, {0}, {1}, 1,
            at::empty({6, 1, 1}, at::device(at::kMeta)));
      },
      "expected other to be on the same device as input (cpu), got meta");
}

// The output's size is overflow-checked; unchecked, padding 2**31 - 1 on a
// 2x2 input killed the process (SIGFPE in oneDNN), and 2**62 said the kernel
// was larger than the input.
TEST(ConvReluAdd, RejectsPaddingWhoseOutputOverflows) {
  expectThrowsWith(
      [] { callConv2d(f32({1, 4, 2, 2}), f32({6, 4, 1, 1}), std::nullopt, {1}, {(int64_t{1} << 31) - 1}); },
      "torchfuse::custom_conv_relu_add: expected the conv output to have at most 2^63 - 1 bytes, "
      "got sizes [1, 6, 4294967296, 4294967296] of 4-byte elements");
  expectThrowsWith(
      [] { callConv2d(f32({1, 4, 2, 2}), f32({6, 4, 1, 1}), std::nullopt, {1}, {int64_t{1} << 62}); },
      "torchfuse::custom_conv_relu_add: expected the padded input size (input.size(2) + 2 * "
      "padding) to fit in int64");
}

TEST(ConvReluAdd, RejectsDilationWhoseKernelOverflows) {
  expectThrowsWith(
      [] {
        callConv2d(f32({1, 4, 5, 5}), f32({6, 4, 3, 3}), std::nullopt, {1}, {0}, {int64_t{1} << 62});
      },
      "torchfuse::custom_conv_relu_add: expected the dilated kernel size (dilation * (kernel size "
      "- 1) + 1) to fit in int64");
}

} // namespace
