#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using testing::expectClose;
using testing::expectUnchanged;
using testing::parse;
using testing::runGraph;
using torch::jit::testing::FileCheck;

int64_t run(std::shared_ptr<torch::jit::Graph>& g) {
  return FuseBatchNormAddDivSwish(g);
}

struct Chain {
  std::string training = "%training";          // a graph input by default
  std::string add = "aten::add(%y, %other, %one)";
  std::string div = "aten::div(%s, %d)";
  std::string swish = "%sg : Tensor = aten::sigmoid(%t)\n  %o : Tensor = aten::mul(%t, %sg)";
  std::string stats = "%rm, %rv";
  std::string extra_inputs = "";
  std::string ret = "%o";
};

std::string ir(const Chain& c) {
  return R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %rm : Tensor, %rv : Tensor, %other : Tensor, %training : bool, %d : float)IR" +
      c.extra_inputs + R"IR():
  %one : int = prim::Constant[value=1]()
  %false : bool = prim::Constant[value=0]()
  %true : bool = prim::Constant[value=1]()
  %none : NoneType = prim::Constant()
  %momentum : float = prim::Constant[value=0.1]()
  %eps : float = prim::Constant[value=1.0000000000000001e-05]()
  %y : Tensor = aten::batch_norm(%x, %w, %b, )IR" + c.stats + ", " + c.training +
      R"IR(, %momentum, %eps, %true)
  %s : Tensor = )IR" + c.add + R"IR(
  %t : Tensor = )IR" + c.div + R"IR(
  )IR" + c.swish + R"IR(
  return ()IR" + c.ret + ")";
}

void replaceOnce(std::string& text, const std::string& from, const std::string& to) {
  const auto pos = text.find(from);
  ASSERT_NE(pos, std::string::npos) << from;
  text.replace(pos, from.size(), to);
}

void expectFused(const Chain& c, const std::string& op = "torchfuse::custom_batch_norm_add_div_swish(") {
  auto graph = parse(ir(c));
  EXPECT_EQ(FuseBatchNormAddDivSwish(graph), 1);
  graph->lint();
  FileCheck().check(op)->check_not("aten::batch_norm")->check_not("aten::sigmoid")
      ->check_not("aten::mul")->check_not("aten::silu")->check_not("aten::div")
      ->run(*graph);
}

TEST(FuseBatchNormAddDivSwish, FusesTrainingFlagAsValue) {
  expectFused(Chain{});
}

TEST(FuseBatchNormAddDivSwish, FusesConstantFalseIntoTheEvalOp) {
  Chain c;
  c.training = "%false";
  expectFused(c, "torchfuse::custom_batch_norm_add_div_swish_eval(%x, %w, %b, %rm, %rv, ");
}

TEST(FuseBatchNormAddDivSwish, FusesSigmoidFirstAndSilu) {
  Chain c;
  c.swish = "%sg : Tensor = aten::sigmoid(%t)\n  %o : Tensor = aten::mul(%sg, %t)";
  expectFused(c);
  c.swish = "%o : Tensor = aten::silu(%t)";
  expectFused(c);
}

// The op differentiates the swish as autograd does the spelling it replaced
// (NaN vs +-Inf where the incoming gradient is infinite): its last argument.
TEST(FuseBatchNormAddDivSwish, PassesTheSwishSpellingToTheOp) {
  const std::pair<std::string, bool> spellings[] = {
      {"%sg : Tensor = aten::sigmoid(%t)\n  %o : Tensor = aten::mul(%t, %sg)", false},
      {"%sg : Tensor = aten::sigmoid(%t)\n  %o : Tensor = aten::mul(%sg, %t)", false},
      {"%o : Tensor = aten::silu(%t)", true}};
  const std::pair<std::string, std::string> modes[] = {
      {"%training", "torchfuse::custom_batch_norm_add_div_swish"},
      {"%false", "torchfuse::custom_batch_norm_add_div_swish_eval"}};
  for (const auto& [training, op] : modes) {
    for (const auto& [swish, silu] : spellings) {
      Chain c;
      c.training = training;
      c.swish = swish;
      auto graph = parse(ir(c));
      ASSERT_EQ(FuseBatchNormAddDivSwish(graph), 1);
      const torch::jit::Node* fused = graph->outputs()[0]->node();
      ASSERT_EQ(std::string(fused->kind().toQualString()), op);
      const auto flag = torch::jit::constant_as<bool>(fused->inputs().back());
      ASSERT_TRUE(flag.has_value()) << *graph;
      EXPECT_EQ(*flag, silu) << swish;
    }
  }
}

TEST(FuseBatchNormAddDivSwish, FusesBatchNormAsSecondOperand) {
  Chain c;
  c.add = "aten::add(%other, %y, %one)";
  expectFused(c);
}

// addPromotes: add_ keeps the batch_norm output's dtype, the op promotes.
TEST(FuseBatchNormAddDivSwish, LeavesInPlaceAddOnTheBatchNormOutput) {
  Chain c;
  c.add = "aten::add_(%y, %other, %one)";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, FusesNoneWeightAndBiasAndIntDivisor) {
  Chain c;
  c.stats = "%rm, %rv";
  auto text = ir(c);
  replaceOnce(text, "batch_norm(%x, %w, %b", "batch_norm(%x, %none, %none");
  replaceOnce(text, "aten::div(%s, %d)", "aten::div(%s, %one)");
  auto graph = parse(text);
  EXPECT_EQ(FuseBatchNormAddDivSwish(graph), 1);
  FileCheck().check("prim::Constant()")->check("custom_batch_norm_add_div_swish(%x, ")
      ->check(", %rm, %rv, %training, ")->check(", %other, ")->run(*graph);
}

TEST(FuseBatchNormAddDivSwish, MatchesTheUnfusedGraphNumericallyIncludingRunningStats) {
  auto graph = parse(ir(Chain{}));
  auto fused = graph->copy();
  ASSERT_EQ(FuseBatchNormAddDivSwish(fused), 1);
  torch::manual_seed(0);
  for (bool training : {true, false}) {
    for (auto dtype : {at::kFloat, at::kDouble}) {
      auto o = at::TensorOptions().dtype(dtype);
      auto x = at::randn({6, 4}, o), w = at::randn({4}, o), b = at::randn({4}, o);
      auto rm = at::randn({4}, o), rv = at::rand({4}, o) + 0.5, other = at::randn({1}, o);
      auto rm2 = rm.clone(), rv2 = rv.clone();
      auto want = runGraph(graph, {x, w, b, rm, rv, other, training, 3.0})[0].toTensor();
      auto got = runGraph(fused, {x, w, b, rm2, rv2, other, training, 3.0})[0].toTensor();
      expectClose(got, want);
      expectClose(rm2, rm);
      expectClose(rv2, rv);
    }
  }
}

TEST(FuseBatchNormAddDivSwish, RecursesIntoIfAndLoopBodies) {
  auto graph = parse(R"IR(
graph(%c : bool, %n : int, %x : Tensor, %rm : Tensor, %rv : Tensor, %d : float):
  %one : int = prim::Constant[value=1]()
  %true : bool = prim::Constant[value=1]()
  %none : NoneType = prim::Constant()
  %m : float = prim::Constant[value=0.1]()
  %out : Tensor = prim::If(%c)
    block0():
      %y : Tensor = aten::batch_norm(%x, %none, %none, %rm, %rv, %c, %m, %m, %true)
      %s : Tensor = aten::add(%y, %x, %one)
      %t : Tensor = aten::div(%s, %d)
      %o : Tensor = aten::silu(%t)
      -> (%o)
    block1():
      %lo : Tensor = prim::Loop(%n, %true, %x)
        block0(%i : int, %h : Tensor):
          %y2 : Tensor = aten::batch_norm(%h, %none, %none, %rm, %rv, %c, %m, %m, %true)
          %s2 : Tensor = aten::add(%y2, %h, %one)
          %t2 : Tensor = aten::div(%s2, %d)
          %g2 : Tensor = aten::sigmoid(%t2)
          %o2 : Tensor = aten::mul(%t2, %g2)
          -> (%true, %o2)
      -> (%lo)
  return (%out))IR");
  EXPECT_EQ(FuseBatchNormAddDivSwish(graph), 2);
  graph->lint();
  FileCheck().check("prim::If")->check("torchfuse::custom_batch_norm_add_div_swish")
      ->check("prim::Loop")->check("torchfuse::custom_batch_norm_add_div_swish")
      ->check_not("aten::batch_norm")->run(*graph);
}

// ---- one negative test per filter ----

TEST(FuseBatchNormAddDivSwish, SkipsNoneRunningStats) {  // runningStatsPresent
  Chain c;
  c.stats = "%none, %none";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, SkipsAlphaOtherThanOne) {  // alphaIsOne
  Chain c;
  c.add = "aten::add(%y, %other, %d)";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, SkipsScalarAdd) {  // isTensorAdd
  Chain c;
  c.add = "aten::add(%y, %d, %one)";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, SkipsTensorDivisor) {  // isScalarDivisor
  Chain c;
  c.div = "aten::div(%s, %other)";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, SkipsRoundingModeDivision) {  // isScalarDivisor
  Chain c;
  c.extra_inputs = ", %mode : str";
  c.div = "aten::div(%s, %d, %mode)";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, SkipsConstantZeroDivisor) {  // divisorIsNonZero
  Chain c;
  c.div = "aten::div(%s, %zero)";
  auto text = ir(c);
  replaceOnce(text, "  %one", "  %zero : float = prim::Constant[value=0.]()\n  %one");
  expectUnchanged(text, run);
}

TEST(FuseBatchNormAddDivSwish, SkipsSigmoidOfAnotherValue) {  // swish shape
  Chain c;
  c.swish = "%sg : Tensor = aten::sigmoid(%other)\n  %o : Tensor = aten::mul(%t, %sg)";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, SkipsReturnedIntermediates) {  // hasSingleUse
  for (const char* ret : {"%o, %y", "%o, %s", "%o, %t", "%o, %sg"}) {
    Chain c;
    c.ret = ret;
    expectUnchanged(ir(c), run);
  }
}

TEST(FuseBatchNormAddDivSwish, LeavesInPlaceAddOnLiveTensor) {  // notInPlaceOnLiveTensor
  Chain c;
  c.add = "aten::add_(%other, %y, %one)";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, SkipsWhenRunningStatsAreReadInBetween) {  // noInterveningAccess
  Chain c;
  c.div = "aten::div(%s, %d)\n  %peek : Tensor = aten::mul(%rm, %one)";
  c.ret = "%o, %peek";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, SkipsWhenAnInputIsWrittenInBetween) {  // noInterveningWrites
  Chain c;
  c.training = "%false";
  c.div = "aten::div(%s, %d)\n  %z : Tensor = aten::mul_(%other, %one)";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, SkipsWhenOtherIsWrittenAfterTheChain) {  // notWrittenAfter
  // The op saves `other` for its backward; the unfused chain does not.
  Chain c;
  c.swish += "\n  %z : Tensor = aten::mul_(%other, %one)";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, SkipsWhenARunningStatisticIsWrittenAfterTheChain) {  // notWrittenAfter
  // The eval-mode op reads the running statistics in its backward.
  Chain c;
  c.swish += "\n  %z : Tensor = aten::mul_(%rv, %one)";
  expectUnchanged(ir(c), run);
}

TEST(FuseBatchNormAddDivSwish, SkipsWhenBiasIsWrittenInALaterIteration) {  // notWrittenAfter
  expectUnchanged(R"IR(
graph(%x : Tensor, %b : Tensor, %rm : Tensor, %rv : Tensor, %n : int, %d : float):
  %one : int = prim::Constant[value=1]()
  %true : bool = prim::Constant[value=1]()
  %none : NoneType = prim::Constant()
  %m : float = prim::Constant[value=0.1]()
  %out : Tensor = prim::Loop(%n, %true, %x)
    block0(%i : int, %h : Tensor):
      %z : Tensor = aten::add_(%b, %one, %one)
      %y : Tensor = aten::batch_norm(%h, %none, %b, %rm, %rv, %true, %m, %m, %true)
      %s : Tensor = aten::add(%y, %h, %one)
      %t : Tensor = aten::div(%s, %d)
      %o : Tensor = aten::silu(%t)
      -> (%true, %o)
  return (%out))IR", run);
}

TEST(FuseBatchNormAddDivSwish, FusesWhenAnotherInputIsWrittenAfterTheChain) {
  Chain c;
  c.extra_inputs = ", %u : Tensor";
  c.swish += "\n  %z : Tensor = aten::relu_(%u)";
  expectFused(c);
}

TEST(FuseBatchNormAddDivSwish, SkipsChainsSpanningBlocks) {  // inSameBlock
  expectUnchanged(R"IR(
graph(%c : bool, %x : Tensor, %rm : Tensor, %rv : Tensor, %d : float):
  %one : int = prim::Constant[value=1]()
  %true : bool = prim::Constant[value=1]()
  %none : NoneType = prim::Constant()
  %m : float = prim::Constant[value=0.1]()
  %y : Tensor = aten::batch_norm(%x, %none, %none, %rm, %rv, %c, %m, %m, %true)
  %out : Tensor = prim::If(%c)
    block0():
      %s : Tensor = aten::add(%y, %x, %one)
      %t : Tensor = aten::div(%s, %d)
      %o : Tensor = aten::silu(%t)
      -> (%o)
    block1():
      -> (%x)
  return (%out))IR", run);
}

} // namespace
} // namespace torchfuse::passes
