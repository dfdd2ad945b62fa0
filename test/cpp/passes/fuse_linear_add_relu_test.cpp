#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using namespace testing;

int64_t run(std::shared_ptr<torch::jit::Graph>& g) {
  return FuseLinearAddRelu(g);
}

constexpr const char* kBasic = R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add(%y, %r, %one)
  %o : Tensor = aten::relu(%s)
  return (%o))IR";

// kBasic and its variants; a negative one names the filter it tests.
const Variant kVariants[] = {
    {"FusesOutOfPlaceAdd", true, {}},
    {"FusesWithoutBias",
     true,
     {{"%b : Tensor, ", ""},
      {"  %one", "  %none : NoneType = prim::Constant()\n  %one"},
      {"%w, %b)", "%w, %none)"}}},
    {"FusesInPlaceReluOnAFreshIntermediate", true, {{"relu(", "relu_("}}},
    // addPromotes: add_ keeps the linear output's dtype, the op promotes.
    {"LeavesInPlaceAddOnAFreshIntermediate", false, {{"add(", "add_("}}},
    {"SkipsScalarAdd", // isTensorAdd
     false,
     {{", %r : Tensor", ""},
      {"=1]()\n", "=1]()\n  %f : float = prim::Constant[value=1.5]()\n"},
      {"%y, %r", "%y, %f"}}},
    {"SkipsReturnedLinearOutput", false, {{"return (%o)", "return (%o, %y)"}}}, // hasSingleUse
    {"SkipsSumWithAnotherUse",                                                  // hasSingleUse
     false,
     {{"return (%o)", "%t : Tensor = aten::mul(%s, %o)\n  return (%t)"}}},
    {"SkipsLinearAsSecondOperand", false, {{"add(%y, %r", "add(%r, %y"}}}, // chainIsAddSelf
    {"LeavesInPlaceAddOnLiveTensor",
     false,
     {{"add(%y, %r", "add_(%r, %y"}}}, // notInPlaceOnLiveTensor
    {"LeavesInPlaceReluOnLiveSum",     // notInPlaceOnLiveTensor
     false,
     {{"relu(", "relu_("}, {"return (%o)", "return (%o, %s)"}}},
    {"SkipsWhenAnInputIsWrittenInBetween", // noInterveningWrites
     false,
     {{"%b)\n", "%b)\n  %z : Tensor = aten::add_(%r, %one, %one)\n"}}},
    {"SkipsUnresolvedOps", // isLinear (schema check)
     false,
     {{"%b : Tensor, ", ""}, {"aten::linear(%x, %w, %b)", "aten::matmul(%x, %w)"}}},
};

void expectFused(const std::string& ir) {
  testing::expectFused(
      ir, run, "torchfuse::custom_linear_add_relu", {"aten::linear", "aten::relu", "aten::add"});
}

TORCHFUSE_VARIANT_TESTS(
    FuseLinearAddRelu,
    LinearAddReluVariant,
    kVariants,
    kBasic,
    run,
    expectFused);

TEST(FuseLinearAddRelu, MatchesTheUnfusedGraphNumerically) {
  expectSameOutputs(kBasic, run, [](const at::TensorOptions& o) {
    return std::vector<at::IValue>{
        at::randn({5, 4}, o), at::randn({3, 4}, o), at::randn({3}, o), at::randn({5, 3}, o)};
  });
}

TEST(FuseLinearAddRelu, PassesAlphaThatScalesOther) {
  auto graph = parse(R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %two : float = prim::Constant[value=2.5]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add(%y, %r, %two)
  %o : Tensor = aten::relu(%s)
  return (%o))IR");
  EXPECT_EQ(FuseLinearAddRelu(graph), 1);
  FileCheck().check("prim::Constant[value=2.5]")->check("torchfuse::custom_linear_add_relu(%x, %w, %b, %r, ")->run(*graph);
}

TEST(FuseLinearAddRelu, RecursesIntoIfBlocks) {
  auto graph = parse(
      R"IR(
graph(%c : bool, %x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
)IR" +
      ifTail(
          {"%y : Tensor = aten::linear(%x, %w, %b)", "%s : Tensor = aten::add(%y, %r, %one)",
           "%o : Tensor = aten::relu(%s)"}));
  EXPECT_EQ(FuseLinearAddRelu(graph), 1);
  graph->lint();
  FileCheck().check("prim::If")->check("torchfuse::custom_linear_add_relu")
      ->check_not("aten::linear")->run(*graph);
}

TEST(FuseLinearAddRelu, RecursesIntoLoopBodies) {
  auto graph = parse(R"IR(
graph(%n : int, %x : Tensor, %w : Tensor, %b : Tensor):
  %one : int = prim::Constant[value=1]()
  %true : bool = prim::Constant[value=1]()
  %out : Tensor = prim::Loop(%n, %true, %x)
    block0(%i : int, %h : Tensor):
      %y : Tensor = aten::linear(%h, %w, %b)
      %s : Tensor = aten::add(%y, %h, %one)
      %o : Tensor = aten::relu(%s)
      -> (%true, %o)
  return (%out))IR");
  EXPECT_EQ(FuseLinearAddRelu(graph), 1);
  graph->lint();
  FileCheck().check("prim::Loop")->check("torchfuse::custom_linear_add_relu(")
      ->run(*graph);
}

TEST(FuseLinearAddRelu, SkipsChainsSpanningBlocks) {  // inSameBlock
  expectUnchanged(
      R"IR(
graph(%c : bool, %x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
)IR" + ifTail({"%s : Tensor = aten::add(%y, %r, %one)", "%o : Tensor = aten::relu(%s)"}),
      run);
}

} // namespace
} // namespace torchfuse::passes
