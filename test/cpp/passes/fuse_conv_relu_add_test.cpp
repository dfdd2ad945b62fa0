#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using namespace testing;

int64_t run(std::shared_ptr<torch::jit::Graph>& g) {
  return FuseConvReluAdd(g);
}

// A conv2d -> relu -> add chain; CONV, RELU, ADD, BIAS, PAD and the add's
// operands are substituted per test.
std::string chain(
    const std::string& conv = "aten::conv2d",
    const std::string& relu = "aten::relu",
    const std::string& add = "aten::add(%r, %other, %one)",
    const std::string& ret = "%o") {
  return R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %other : Tensor):
  %one : int = prim::Constant[value=1]()
  %two : int = prim::Constant[value=2]()
  %none : NoneType = prim::Constant()
  %l : int[] = prim::ListConstruct(%one, %one)
  %c : Tensor = )IR" + conv + R"IR((%x, %w, %b, %l, %l, %l, %one)
  %r : Tensor = )IR" + relu + R"IR((%c)
  %o : Tensor = )IR" + add + R"IR(
  return ()IR" + ret + ")";
}

void expectFused(const std::string& ir) {
  testing::expectFused(
      ir, run, "torchfuse::custom_conv_relu_add", {"aten::conv", "aten::relu", "aten::add"});
}

const char* const kConstants =
    "  %two : int = prim::Constant[value=2]()\n  %none : NoneType = prim::Constant()\n";

// chain() and its variants; a negative one names the filter it tests.
const Variant kVariants[] = {
    {"FusesConv2d", true, {}},
    {"SkipsInPlaceRelu", false, {{"relu(", "relu_("}}}, // reluWritesConvOutput
    // addPromotes: add_ keeps the relu output's dtype, the op promotes.
    {"LeavesInPlaceAddOnAFreshIntermediate", false, {{"add(", "add_("}}},
    {"SkipsStringPaddingOverload", // isIntListConv
     false,
     {{kConstants, "  %same : str = prim::Constant[value=\"same\"]()\n"},
      {"%l, %l, %l", "%l, %same, %l"}}},
    {"SkipsScalarAdd", // isTensorAdd
     false,
     {{", %other : Tensor", ""},
      {kConstants, "  %f : float = prim::Constant[value=0.5]()\n"},
      {"%r, %other", "%r, %f"}}},
    {"SkipsReluAsSecondOperand", // chainIsAddSelf
     false,
     {{"add(%r, %other", "add(%other, %r"}}},
    {"LeavesInPlaceAddOnLiveTensor",
     false,
     {{"add(%r, %other", "add_(%other, %r"}}}, // notInPlaceOnLiveTensor
    {"SkipsWhenAnInputIsWrittenInBetween",     // noInterveningWrites
     false,
     {{kConstants, ""}, {"%one)\n  %r", "%one)\n  %z : Tensor = aten::mul_(%x, %one)\n  %r"}}},
};

TORCHFUSE_VARIANT_TESTS(FuseConvReluAdd, ConvReluAddVariant, kVariants, chain(), run, expectFused);

TEST(FuseConvReluAdd, FusesConv1dAndConv3d) {
  for (const char* conv : {"aten::conv1d", "aten::conv3d"}) {
    expectFused(chain(conv));
  }
}

TEST(FuseConvReluAdd, MatchesTheUnfusedGraphNumerically) {
  expectSameOutputs(chain(), run, [](const at::TensorOptions& o) {
    return std::vector<at::IValue>{
        at::randn({2, 3, 6, 6}, o), at::randn({4, 3, 3, 3}, o), at::randn({4}, o),
        at::randn({4, 1, 1}, o)};
  });
}

TEST(FuseConvReluAdd, PassesAlphaThatScalesOther) {
  auto graph = parse(chain("aten::conv2d", "aten::relu", "aten::add(%r, %other, %two)"));
  EXPECT_EQ(FuseConvReluAdd(graph), 1);
  FileCheck().check("torchfuse::custom_conv_relu_add(%x, %w, %b, ")->check(", %other, ")
      ->run(*graph);
}

TEST(FuseConvReluAdd, RecursesIntoIfAndLoopBodies) {
  const std::string ir = R"IR(
graph(%c : bool, %n : int, %x : Tensor, %w : Tensor, %b : Tensor):
  %one : int = prim::Constant[value=1]()
  %true : bool = prim::Constant[value=1]()
  %l : int[] = prim::ListConstruct(%one, %one)
)IR" +
      ifTail({"%y : Tensor = aten::conv2d(%x, %w, %b, %l, %l, %l, %one)",
              "%r : Tensor = aten::relu(%y)", "%o : Tensor = aten::add(%r, %x, %one)"},
             loop(
                 {"%y2 : Tensor = aten::conv2d(%h, %w, %b, %l, %l, %l, %one)",
                  "%r2 : Tensor = aten::relu(%y2)", "%o2 : Tensor = aten::add(%r2, %h, %one)"}),
             "%lo");
  expectFusedInIfAndLoop(ir, run, "torchfuse::custom_conv_relu_add", "aten::conv2d");
}

TEST(FuseConvReluAdd, SkipsReturnedIntermediates) {  // hasSingleUse
  expectUnchanged(chain("aten::conv2d", "aten::relu", "aten::add(%r, %other, %one)", "%o, %r"), run);
  expectUnchanged(chain("aten::conv2d", "aten::relu", "aten::add(%r, %other, %one)", "%o, %c"), run);
}

TEST(FuseConvReluAdd, SkipsChainsSpanningBlocks) {  // inSameBlock
  expectUnchanged(
      R"IR(
graph(%c : bool, %x : Tensor, %w : Tensor, %b : Tensor):
  %one : int = prim::Constant[value=1]()
  %l : int[] = prim::ListConstruct(%one, %one)
  %y : Tensor = aten::conv2d(%x, %w, %b, %l, %l, %l, %one)
  %r : Tensor = aten::relu(%y)
)IR" + ifTail({"%o : Tensor = aten::add(%r, %x, %one)"}),
      run);
}

} // namespace
} // namespace torchfuse::passes
