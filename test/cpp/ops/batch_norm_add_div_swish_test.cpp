// torchfuse::custom_batch_norm_add_div_swish(_eval) against
//   t = (batch_norm(x, w, b, rm, rv, training, momentum, eps) + other) / divisor;
//   t * sigmoid(t)
// including the running statistics that aten::batch_norm updates in training.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test/cpp/util/op_test_utils.h"
#include "torchfuse/ops.h"

namespace {

using namespace torchfuse::test;

constexpr int64_t kC = 3;
constexpr double kEps = 1e-5;

enum class OtherForm { PerChannel, ScalarLike, Full };
enum class Mode { Train, EvalFlag, EvalOp };

struct Case {
  std::vector<int64_t> input_sizes;
  Mode mode;
  double momentum;
  bool weight;
  bool bias;
  OtherForm other;
  double divisor;
  bool contiguous;
};

std::string describe(const Case& c, at::ScalarType dtype) {
  std::ostringstream s;
  s << dtype << " input " << at::IntArrayRef(c.input_sizes) << " mode "
    << static_cast<int>(c.mode) << " momentum " << c.momentum
    << (c.weight ? " weight" : " no weight") << (c.bias ? " bias" : " no bias")
    << " other " << static_cast<int>(c.other) << " divisor " << c.divisor
    << (c.contiguous ? " contiguous" : " non-contiguous");
  return s.str();
}

at::Tensor swish(const at::Tensor& bn, const at::Tensor& other, double divisor) {
  const auto t = (bn + other) / divisor;
  return t * at::sigmoid(t);
}

// Leaves: input, other[, weight][, bias].  Non-contiguous: input is the
// transpose of its last two dims, weight every second element of a longer
// vector, a full other a transpose.  The running statistics are separate
// copies for the fused op and the reference and are compared afterwards.
void checkCase(const Case& c, at::ScalarType dtype) {
  SCOPED_TRACE(describe(c, dtype));
  const auto swapLast = [](std::vector<int64_t> v) {
    std::swap(v[v.size() - 1], v[v.size() - 2]);
    return v;
  };
  std::vector<int64_t> other_sizes;
  switch (c.other) {
    case OtherForm::PerChannel:
      other_sizes.assign(c.input_sizes.size() - 1, 1);
      other_sizes[0] = kC;
      break;
    case OtherForm::ScalarLike:
      other_sizes = {1};
      break;
    case OtherForm::Full:
      other_sizes = c.input_sizes;
  }
  const bool transpose_other = !c.contiguous && other_sizes.size() >= 2;
  std::vector<at::Tensor> bases{
      randSigned(c.contiguous ? c.input_sizes : swapLast(c.input_sizes), dtype),
      randSigned(transpose_other ? swapLast(other_sizes) : other_sizes, dtype)};
  const int64_t weight_index = c.weight ? static_cast<int64_t>(bases.size()) : -1;
  if (c.weight) {
    bases.push_back(randSigned({c.contiguous ? kC : 2 * kC}, dtype));
  }
  const int64_t bias_index = c.bias ? static_cast<int64_t>(bases.size()) : -1;
  if (c.bias) {
    bases.push_back(randSigned({kC}, dtype));
  }
  const auto running_mean = randSigned({kC}, dtype);
  const auto running_var = randPositive({kC}, dtype);
  auto rm_fused = running_mean.clone();
  auto rv_fused = running_var.clone();
  auto rm_ref = running_mean.clone();
  auto rv_ref = running_var.clone();

  const auto views = [&](const std::vector<at::Tensor>& l) {
    auto x = c.contiguous ? l[0] : l[0].transpose(-1, -2);
    auto other = transpose_other ? l[1].transpose(-1, -2) : l[1];
    std::optional<at::Tensor> w, b;
    if (c.weight) {
      w = c.contiguous ? l[weight_index] : l[weight_index].slice(0, 0, std::nullopt, 2);
    }
    if (c.bias) {
      b = l[bias_index];
    }
    return std::make_tuple(x, other, w, b);
  };
  const bool training = c.mode == Mode::Train;
  expectMatchesReference(
      bases,
      [&](const std::vector<at::Tensor>& l) {
        auto [x, other, w, b] = views(l);
        if (c.mode == Mode::EvalOp) {
          return torchfuse::custom_batch_norm_add_div_swish_eval(
              x, w, b, rm_fused, rv_fused, kEps, other, c.divisor);
        }
        return torchfuse::custom_batch_norm_add_div_swish(
            x, w, b, rm_fused, rv_fused, training, c.momentum, kEps, other, c.divisor);
      },
      [&](const std::vector<at::Tensor>& l) {
        auto [x, other, w, b] = views(l);
        const auto bn = at::batch_norm(
            x, w, b, rm_ref, rv_ref, training, c.momentum, kEps,
            /*cudnn_enabled=*/false);
        return swish(bn, other, c.divisor);
      });
  expectClose(rm_fused, rm_ref, "running_mean");
  expectClose(rv_fused, rv_ref, "running_var");
  if (!training) {
    EXPECT_TRUE(rm_fused.equal(running_mean)) << "eval changed running_mean";
    EXPECT_TRUE(rv_fused.equal(running_var)) << "eval changed running_var";
  } else if (at::IntArrayRef(c.input_sizes)[0] > 0 && c.momentum != 0.0) {
    // guards against a reference that silently updated nothing either.
    EXPECT_FALSE(rm_fused.equal(running_mean)) << "training left running_mean";
  }
}

const std::vector<std::vector<int64_t>>& inputShapes() {
  static const std::vector<std::vector<int64_t>> shapes{
      {4, kC}, {4, kC, 5}, {2, kC, 4, 5}, {2, kC, 2, 3, 4}, {0, kC, 4}};
  return shapes;
}

TEST(BatchNormAddDivSwish, TrainingMatchesCompositionAndItsRunningStats) {
  at::manual_seed(0);
  for (const auto dtype : testDtypes()) {
    for (const auto& shape : inputShapes()) {
      checkCase({shape, Mode::Train, 0.1, true, true, OtherForm::PerChannel, 2.0, true}, dtype);
      checkCase({shape, Mode::Train, 0.1, false, false, OtherForm::Full, 2.0, true}, dtype);
      checkCase({shape, Mode::Train, 0.1, true, false, OtherForm::ScalarLike, 2.0, true}, dtype);
    }
  }
}

TEST(BatchNormAddDivSwish, EvalFlagMatchesCompositionAndLeavesRunningStats) {
  at::manual_seed(1);
  for (const auto dtype : testDtypes()) {
    for (const auto& shape : inputShapes()) {
      checkCase({shape, Mode::EvalFlag, 0.1, true, true, OtherForm::PerChannel, 2.0, true}, dtype);
      checkCase({shape, Mode::EvalFlag, 0.1, false, true, OtherForm::Full, -0.5, true}, dtype);
    }
  }
}

TEST(BatchNormAddDivSwish, EvalOpMatchesCompositionAndLeavesRunningStats) {
  at::manual_seed(2);
  for (const auto dtype : testDtypes()) {
    for (const auto& shape : inputShapes()) {
      checkCase({shape, Mode::EvalOp, 0.0, true, true, OtherForm::PerChannel, 2.0, true}, dtype);
      checkCase({shape, Mode::EvalOp, 0.0, false, false, OtherForm::ScalarLike, 3.0, true}, dtype);
      checkCase({shape, Mode::EvalOp, 0.0, true, false, OtherForm::Full, -0.5, true}, dtype);
    }
  }
}

TEST(BatchNormAddDivSwish, MatchesCompositionForEveryOtherForm) {
  at::manual_seed(3);
  for (const auto dtype : testDtypes()) {
    for (const auto form : {OtherForm::PerChannel, OtherForm::ScalarLike, OtherForm::Full}) {
      for (const auto mode : {Mode::Train, Mode::EvalFlag, Mode::EvalOp}) {
        checkCase({{2, kC, 4, 5}, mode, 0.1, true, true, form, 2.0, true}, dtype);
        checkCase({{5, kC}, mode, 0.1, false, true, form, -3.0, true}, dtype);
      }
    }
  }
}

TEST(BatchNormAddDivSwish, MatchesCompositionOnNonContiguousInputs) {
  at::manual_seed(4);
  for (const auto dtype : testDtypes()) {
    for (const auto mode : {Mode::Train, Mode::EvalFlag, Mode::EvalOp}) {
      checkCase({{2, kC, 4, 5}, mode, 0.1, true, true, OtherForm::Full, 2.0, false}, dtype);
      checkCase({{4, kC}, mode, 0.1, true, false, OtherForm::PerChannel, 2.0, false}, dtype);
      checkCase({{2, kC, 6}, mode, 0.1, true, true, OtherForm::ScalarLike, 2.0, false}, dtype);
    }
  }
}

TEST(BatchNormAddDivSwish, UpdatesRunningStatsForEveryMomentum) {
  at::manual_seed(5);
  for (const auto dtype : testDtypes()) {
    for (const double momentum : {0.0, 0.1, 0.5, 1.0}) {
      checkCase({{4, kC, 5}, Mode::Train, momentum, true, true, OtherForm::PerChannel, 2.0, true}, dtype);
    }
  }
}

TEST(BatchNormAddDivSwish, RunningStatsFollowBatchNormOverThreeSteps) {
  at::manual_seed(6);
  for (const auto dtype : testDtypes()) {
    auto rm = randSigned({kC}, dtype);
    auto rv = randPositive({kC}, dtype);
    auto rm_ref = rm.clone();
    auto rv_ref = rv.clone();
    const auto w = randSigned({kC}, dtype);
    const auto b = randSigned({kC}, dtype);
    for (int step = 0; step < 3; ++step) {
      const auto x = randSigned({4, kC, 3}, dtype) * (step + 1) + step;
      const auto other = randSigned({kC, 1}, dtype);
      const auto out = torchfuse::custom_batch_norm_add_div_swish(
          x, w, b, rm, rv, true, 0.2, kEps, other, 2.0);
      const auto bn = at::batch_norm(x, w, b, rm_ref, rv_ref, true, 0.2, kEps, false);
      expectClose(out, swish(bn, other, 2.0), "output of step " + std::to_string(step));
    }
    expectClose(rm, rm_ref, "running_mean");
    expectClose(rv, rv_ref, "running_var");
  }
}

// NB: aten::batch_norm updates the running statistics without bumping their
// version counters; the fused op must do the same, or an eval-mode
// batch_norm that saved the same buffers raises in its backward where the
// original ran.
TEST(BatchNormAddDivSwish, TrainingLeavesTheRunningStatsVersionsAsAtenDoes) {
  at::manual_seed(7);
  auto rm = at::zeros({kC});
  auto rv = at::ones({kC});
  auto rm_ref = at::zeros({kC});
  auto rv_ref = at::ones({kC});
  const auto x = randSigned({4, kC}, at::kFloat).set_requires_grad(true);
  const auto versions = [](const at::Tensor& a, const at::Tensor& b) {
    return std::make_pair(a._version(), b._version());
  };
  const auto before = versions(rm, rv);
  const auto before_ref = versions(rm_ref, rv_ref);
  torchfuse::custom_batch_norm_add_div_swish(
      x, std::nullopt, std::nullopt, rm, rv, true, 0.1, kEps, randSigned({1}, at::kFloat), 2.0);
  at::batch_norm(x, {}, {}, rm_ref, rv_ref, true, 0.1, kEps, false);
  const auto after = versions(rm, rv);
  const auto after_ref = versions(rm_ref, rv_ref);
  EXPECT_EQ(after.first - before.first, after_ref.first - before_ref.first);
  EXPECT_EQ(after.second - before.second, after_ref.second - before_ref.second);
  EXPECT_FALSE(at::equal(rm, at::zeros({kC})));  // the statistics were updated
}

TEST(BatchNormAddDivSwish, NoGradTrainingGivesTheSameOutputAndStats) {
  at::manual_seed(8);
  const auto x = randSigned({4, kC, 5}, at::kFloat).set_requires_grad(true);
  const auto w = randSigned({kC}, at::kFloat).set_requires_grad(true);
  const auto other = randSigned({kC, 1}, at::kFloat);
  auto rm = randSigned({kC}, at::kFloat);
  auto rv = randPositive({kC}, at::kFloat);
  auto rm_ref = rm.clone();
  auto rv_ref = rv.clone();
  c10::NoGradGuard no_grad;
  const auto out = torchfuse::custom_batch_norm_add_div_swish(
      x, w, std::nullopt, rm, rv, true, 0.1, kEps, other, 2.0);
  EXPECT_FALSE(out.requires_grad());
  const auto bn = at::batch_norm(x, w, {}, rm_ref, rv_ref, true, 0.1, kEps, false);
  expectClose(out, swish(bn, other, 2.0), "no-grad output");
  expectClose(rm, rm_ref, "running_mean");
  expectClose(rv, rv_ref, "running_var");
}

TEST(BatchNormAddDivSwish, DoubleBackwardMatchesComposition) {
  at::manual_seed(9);
  const auto rm = randSigned({kC}, at::kDouble);
  const auto rv = randPositive({kC}, at::kDouble);
  for (const auto mode : {Mode::Train, Mode::EvalFlag, Mode::EvalOp}) {
    SCOPED_TRACE("mode " + std::to_string(static_cast<int>(mode)));
    const bool training = mode == Mode::Train;
    auto rm_fused = rm.clone(), rv_fused = rv.clone();
    auto rm_ref = rm.clone(), rv_ref = rv.clone();
    expectDoubleBackwardMatchesReference(
        {randSigned({4, kC, 2}, at::kDouble), randSigned({kC}, at::kDouble),
         randSigned({kC}, at::kDouble), randSigned({kC, 1}, at::kDouble)},
        [&](const std::vector<at::Tensor>& l) {
          if (mode == Mode::EvalOp) {
            return torchfuse::custom_batch_norm_add_div_swish_eval(
                l[0], l[1], l[2], rm_fused, rv_fused, kEps, l[3], -1.5);
          }
          return torchfuse::custom_batch_norm_add_div_swish(
              l[0], l[1], l[2], rm_fused, rv_fused, training, 0.1, kEps, l[3], -1.5);
        },
        [&](const std::vector<at::Tensor>& l) {
          const auto bn = at::batch_norm(l[0], l[1], l[2], rm_ref, rv_ref, training, 0.1, kEps, false);
          return swish(bn, l[3], -1.5);
        });
    // one update per forward, whatever the backward's order
    expectClose(rm_fused, rm_ref, "running_mean");
    expectClose(rv_fused, rv_ref, "running_var");
  }
}

// A zero divisor (an unfrozen attribute) gives the chain's inf and nan.
TEST(BatchNormAddDivSwish, ZeroDivisorGivesTheCompositionsInfAndNan) {
  at::manual_seed(10);
  for (const double divisor : {0.0, -0.0}) {
    const auto x = randSigned({4, kC, 2}, at::kFloat);
    const auto other = randSigned({kC, 1}, at::kFloat);
    auto rm = at::zeros({kC}), rv = at::ones({kC});
    const auto out = torchfuse::custom_batch_norm_add_div_swish(
        x, std::nullopt, std::nullopt, rm, rv, true, 0.1, kEps, other, divisor);
    auto rm_ref = at::zeros({kC}), rv_ref = at::ones({kC});
    const auto want = swish(
        at::batch_norm(x, {}, {}, rm_ref, rv_ref, true, 0.1, kEps, false), other, divisor);
    EXPECT_TRUE(want.isinf().any().item<bool>() && want.isnan().any().item<bool>());
    EXPECT_TRUE(at::equal(out.isnan(), want.isnan()));
    EXPECT_TRUE(at::equal(out.isposinf(), want.isposinf()));
    EXPECT_TRUE(at::equal(out.isneginf(), want.isneginf()));
    expectClose(rm, rm_ref, "running_mean");
  }
}

// batch_norm takes a weight or bias of C elements in any shape (its backward
// then fails): so does the op.
TEST(BatchNormAddDivSwish, TakesWeightAndBiasOfCElementsInAnyShape) {
  at::manual_seed(11);
  const auto x = randSigned({4, kC, 2}, at::kDouble);
  const auto w = randSigned({1, kC}, at::kDouble);
  const auto b = randSigned({kC, 1}, at::kDouble);
  const auto other = randSigned({kC, 1}, at::kDouble);
  for (const bool training : {true, false}) {
    auto rm = randSigned({kC}, at::kDouble), rv = randPositive({kC}, at::kDouble);
    auto rm_ref = rm.clone(), rv_ref = rv.clone();
    const auto out = torchfuse::custom_batch_norm_add_div_swish(
        x, w, b, rm, rv, training, 0.1, kEps, other, 2.0);
    const auto want =
        swish(at::batch_norm(x, w, b, rm_ref, rv_ref, training, 0.1, kEps, false), other, 2.0);
    expectClose(out, want, "output");
    expectClose(rm, rm_ref, "running_mean");
    expectClose(rv, rv_ref, "running_var");
    expectClose(
        torchfuse::custom_batch_norm_add_div_swish_eval(x, w, b, rm, rv, kEps, other, 2.0),
        swish(at::batch_norm(x, w, b, rm, rv, false, 0.0, kEps, false), other, 2.0),
        "eval op output");
  }
}

// ---- input checks, one per message ----

at::Tensor f32(at::IntArrayRef sizes) {
  return randSigned(sizes, at::kFloat);
}

struct Args {
  at::Tensor input = f32({4, kC, 2});
  std::optional<at::Tensor> weight = f32({kC});
  std::optional<at::Tensor> bias = f32({kC});
  at::Tensor running_mean = at::zeros({kC});
  at::Tensor running_var = at::ones({kC});
  at::Tensor other = f32({kC, 1});
  double divisor = 2.0;
};

// Both ops share the checks; each message is asserted on both.
void expectBothReject(const Args& a, const std::string& message) {
  {
    SCOPED_TRACE("custom_batch_norm_add_div_swish");
    expectThrowsWith(
        [&] {
          auto rm = a.running_mean;
          auto rv = a.running_var;
          torchfuse::custom_batch_norm_add_div_swish(
              a.input, a.weight, a.bias, rm, rv, true, 0.1, kEps, a.other, a.divisor);
        },
        message);
  }
  {
    SCOPED_TRACE("custom_batch_norm_add_div_swish_eval");
    expectThrowsWith(
        [&] {
          torchfuse::custom_batch_norm_add_div_swish_eval(
              a.input, a.weight, a.bias, a.running_mean, a.running_var, kEps, a.other,
              a.divisor);
        },
        message);
  }
}

TEST(BatchNormAddDivSwish, RejectsInputBelow2D) {
  Args a;
  a.input = f32({kC});
  expectBothReject(
      a, "torchfuse::custom_batch_norm_add_div_swish: expected input to be at least 2-D (N, C, *), got 1-D");
}

TEST(BatchNormAddDivSwish, RejectsIntegerInput) {
  Args a;
  a.input = at::ones({4, kC, 2}, at::kLong);
  expectBothReject(a, "expected input to have a floating-point dtype, got Long");
}

TEST(BatchNormAddDivSwish, RejectsWeightChannelMismatch) {
  Args a;
  a.weight = f32({kC + 1});
  expectBothReject(a, "expected weight to have input.size(1) = 3 elements, got 4");
}

TEST(BatchNormAddDivSwish, RejectsBiasOfWrongSize) {
  Args a;
  a.bias = f32({2, kC});
  expectBothReject(a, "expected bias to have input.size(1) = 3 elements, got 6");
}

// The CPU's batch_norm refuses these with raw text ("mixed dtype (CPU): ...").
TEST(BatchNormAddDivSwish, RejectsFloat64RunningStatsOnFloat32Input) {
  Args a;
  a.weight = std::nullopt;
  a.bias = std::nullopt;
  a.running_mean = at::zeros({kC}, at::kDouble);
  a.running_var = at::ones({kC}, at::kDouble);
  expectBothReject(
      a, "torchfuse::custom_batch_norm_add_div_swish: expected running_mean to have the input's "
         "dtype (Float), as batch_norm requires on the CPU, got Double");
}

TEST(BatchNormAddDivSwish, RejectsFloat64WeightOnFloat32Input) {
  Args a;
  a.weight = f32({kC}).to(at::kDouble);
  expectBothReject(a, "expected weight to have the input's dtype (Float)");
}

TEST(BatchNormAddDivSwish, RejectsParametersOfTwoDtypesOnA16BitInput) {
  Args a;
  a.input = f32({4, kC, 2}).to(at::kBFloat16);
  a.other = f32({kC, 1}).to(at::kBFloat16);
  a.weight = f32({kC}).to(at::kBFloat16);
  a.bias = std::nullopt;
  expectBothReject(
      a, "expected running_mean to have the dtype of weight (BFloat16): batch_norm requires one "
         "dtype for weight, bias and the running statistics, got Float");
}

TEST(BatchNormAddDivSwish, RejectsRunningMeanChannelMismatch) {
  Args a;
  a.running_mean = at::zeros({kC - 1});
  expectBothReject(a, "expected running_mean to have input.size(1) = 3 elements, got 2");
}

TEST(BatchNormAddDivSwish, RejectsRunningVarOfWrongRank) {
  Args a;
  a.running_var = at::ones({1, kC});
  expectBothReject(a, "expected running_var to be 1-D, got 2-D");
}

TEST(BatchNormAddDivSwish, RejectsOtherNotBroadcastable) {
  Args a;
  a.other = f32({kC});
  expectBothReject(
      a, "torchfuse::custom_batch_norm_add_div_swish: expected other to be broadcastable to [4, 3, 2], got [3]");
}

// A meta tensor among CPU tensors dispatches to the Meta kernel, which runs
// the same checks: this exercises the device checks without a GPU.
TEST(BatchNormAddDivSwish, RejectsOtherOnAnotherDevice) {
  Args a;
  a.other = at::empty({kC, 1}, at::device(at::kMeta));
  expectBothReject(a, "expected other to be on the same device as input (cpu), got meta");
}

TEST(BatchNormAddDivSwish, RejectsRunningMeanOnAnotherDevice) {
  Args a;
  a.running_mean = at::empty({kC}, at::device(at::kMeta));
  expectBothReject(a, "expected running_mean to be on the same device as input (cpu), got meta");
}

} // namespace
