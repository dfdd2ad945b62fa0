#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using namespace testing;

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

void expectFused(
    const std::string& text,
    const std::string& op = "torchfuse::custom_batch_norm_add_div_swish(") {
  testing::expectFused(
      text, run, op, {"aten::batch_norm", "aten::sigmoid", "aten::mul", "aten::silu", "aten::div"});
}

// ir(Chain{}) and its variants; a negative one names the filter it tests.
const Variant kVariants[] = {
    {"FusesTrainingFlagAsValue", true, {}},
    {"SkipsBatchNormAsSecondOperand",
     false,
     {{"add(%y, %other", "add(%other, %y"}}}, // chainIsAddSelf
    // addPromotes: add_ keeps the batch_norm output's dtype, the op promotes.
    {"LeavesInPlaceAddOnTheBatchNormOutput", false, {{"add(", "add_("}}},
    {"SkipsNoneRunningStats",
     false,
     {{"%rm, %rv, %training", "%none, %none, %training"}}}, // runningStatsPresent
    {"SkipsAlphaOtherThanOne",
     false,
     {{"add(%y, %other, %one)", "add(%y, %other, %d)"}}},                        // alphaIsOne
    {"SkipsScalarAdd", false, {{"add(%y, %other, %one)", "add(%y, %d, %one)"}}}, // isTensorAdd
    {"SkipsTensorDivisor", false, {{"div(%s, %d)", "div(%s, %other)"}}},         // isScalarDivisor
    {"SkipsRoundingModeDivision",                                                // isScalarDivisor
     false,
     {{"%d : float", "%d : float, %mode : str"}, {"div(%s, %d)", "div(%s, %d, %mode)"}}},
    {"SkipsConstantZeroDivisor", // divisorIsNonZero
     false,
     {{"div(%s, %d)", "div(%s, %zero)"},
      {"  %one", "  %zero : float = prim::Constant[value=0.]()\n  %one"}}},
    {"SkipsSigmoidOfAnotherValue", false, {{"sigmoid(%t)", "sigmoid(%other)"}}}, // swish shape
    {"LeavesInPlaceAddOnLiveTensor",
     false,
     {{"add(%y, %other", "add_(%other, %y"}}}, // notInPlaceOnLiveTensor
    {"SkipsWhenRunningStatsAreReadInBetween",  // noInterveningAccess
     false,
     {{"div(%s, %d)", "div(%s, %d)\n  %peek : Tensor = aten::mul(%rm, %one)"},
      {"return (%o)", "return (%o, %peek)"}}},
    {"SkipsWhenAnInputIsWrittenInBetween", // noInterveningWrites
     false,
     {{"%rv, %training", "%rv, %false"},
      {"div(%s, %d)", "div(%s, %d)\n  %z : Tensor = aten::mul_(%other, %one)"}}},
    // notWrittenAfter: the op saves `other` for its backward; the unfused
    // chain does not.
    {"SkipsWhenOtherIsWrittenAfterTheChain",
     false,
     {{"mul(%t, %sg)", "mul(%t, %sg)\n  %z : Tensor = aten::mul_(%other, %one)"}}},
    // notWrittenAfter: the eval-mode op reads the running statistics in its
    // backward.
    {"SkipsWhenARunningStatisticIsWrittenAfterTheChain",
     false,
     {{"mul(%t, %sg)", "mul(%t, %sg)\n  %z : Tensor = aten::mul_(%rv, %one)"}}},
    {"FusesWhenAnotherInputIsWrittenAfterTheChain",
     true,
     {{"%d : float", "%d : float, %u : Tensor"},
      {"mul(%t, %sg)", "mul(%t, %sg)\n  %z : Tensor = aten::relu_(%u)"}}},
};

TORCHFUSE_VARIANT_TESTS(
    FuseBatchNormAddDivSwish,
    BatchNormAddDivSwishVariant,
    kVariants,
    ir(Chain{}),
    run,
    expectFused);

TEST(FuseBatchNormAddDivSwish, FusesConstantFalseIntoTheEvalOp) {
  Chain c;
  c.training = "%false";
  expectFused(ir(c), "torchfuse::custom_batch_norm_add_div_swish_eval(%x, %w, %b, %rm, %rv, ");
}

TEST(FuseBatchNormAddDivSwish, FusesSigmoidFirstAndSilu) {
  Chain c;
  c.swish = "%sg : Tensor = aten::sigmoid(%t)\n  %o : Tensor = aten::mul(%sg, %t)";
  expectFused(ir(c));
  c.swish = "%o : Tensor = aten::silu(%t)";
  expectFused(ir(c));
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

TEST(FuseBatchNormAddDivSwish, FusesNoneWeightAndBiasAndIntDivisor) {
  auto graph = parse(edit(
      ir(Chain{}),
      {{"batch_norm(%x, %w, %b", "batch_norm(%x, %none, %none"},
       {"aten::div(%s, %d)", "aten::div(%s, %one)"}}));
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
  const std::string ir = R"IR(
graph(%c : bool, %n : int, %x : Tensor, %rm : Tensor, %rv : Tensor, %d : float):
  %one : int = prim::Constant[value=1]()
  %true : bool = prim::Constant[value=1]()
  %none : NoneType = prim::Constant()
  %m : float = prim::Constant[value=0.1]()
)IR" +
      ifTail({"%y : Tensor = aten::batch_norm(%x, %none, %none, %rm, %rv, %c, %m, %m, %true)",
              "%s : Tensor = aten::add(%y, %x, %one)", "%t : Tensor = aten::div(%s, %d)",
              "%o : Tensor = aten::silu(%t)"},
             loop(
                 {"%y2 : Tensor = aten::batch_norm(%h, %none, %none, %rm, %rv, %c, %m, %m, %true)",
                  "%s2 : Tensor = aten::add(%y2, %h, %one)", "%t2 : Tensor = aten::div(%s2, %d)",
                  "%g2 : Tensor = aten::sigmoid(%t2)", "%o2 : Tensor = aten::mul(%t2, %g2)"}),
             "%lo");
  expectFusedInIfAndLoop(ir, run, "torchfuse::custom_batch_norm_add_div_swish", "aten::batch_norm");
}

TEST(FuseBatchNormAddDivSwish, SkipsReturnedIntermediates) {  // hasSingleUse
  for (const char* ret : {"%o, %y", "%o, %s", "%o, %t", "%o, %sg"}) {
    Chain c;
    c.ret = ret;
    expectUnchanged(ir(c), run);
  }
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

TEST(FuseBatchNormAddDivSwish, SkipsChainsSpanningBlocks) {  // inSameBlock
  expectUnchanged(
      R"IR(
graph(%c : bool, %x : Tensor, %rm : Tensor, %rv : Tensor, %d : float):
  %one : int = prim::Constant[value=1]()
  %true : bool = prim::Constant[value=1]()
  %none : NoneType = prim::Constant()
  %m : float = prim::Constant[value=0.1]()
  %y : Tensor = aten::batch_norm(%x, %none, %none, %rm, %rv, %c, %m, %m, %true)
)IR" +
          ifTail(
              {"%s : Tensor = aten::add(%y, %x, %one)", "%t : Tensor = aten::div(%s, %d)",
               "%o : Tensor = aten::silu(%t)"}),
      run);
}

} // namespace
} // namespace torchfuse::passes
