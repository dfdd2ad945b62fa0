#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using namespace testing;

int64_t run(std::shared_ptr<torch::jit::Graph>& g) {
  return FuseConvAddAct(g);
}

// conv2d -> add -> hardtanh(0, 6); variants edit it into the other forms.
std::string chain() {
  return R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %other : Tensor):
  %one : int = prim::Constant[value=1]()
  %two : int = prim::Constant[value=2]()
  %lo : float = prim::Constant[value=0.]()
  %hi : float = prim::Constant[value=6.]()
  %l : int[] = prim::ListConstruct(%one, %one)
  %c : Tensor = aten::conv2d(%x, %w, %b, %l, %l, %l, %one)
  %a : Tensor = aten::add(%c, %other, %one)
  %o : Tensor = aten::hardtanh(%a, %lo, %hi)
  return (%o))IR";
}

void expectFused(const std::string& ir) {
  testing::expectFused(
      ir, run, "torchfuse::custom_conv_add_act",
      {"aten::conv", "aten::add", "aten::hardtanh", "aten::relu", "aten::silu"});
}

const char* const kAct = "%o : Tensor = aten::hardtanh(%a, %lo, %hi)";
const char* const kAdd = "%a : Tensor = aten::add(%c, %other, %one)";

// chain() and its variants; a negative one names the filter it tests.
const Variant kVariants[] = {
    {"FusesConvAddHardtanh", true, {}},
    {"FusesInPlaceAddAndActivation",
     true,
     {{"aten::add(", "aten::add_("}, {"aten::hardtanh(", "aten::hardtanh_("}}},
    {"FusesAlphaScalingOther", true, {{"add(%c, %other, %one)", "add(%c, %other, %two)"}}},
    {"FusesConvActivation", true, {{kAdd, ""}, {"hardtanh(%a", "hardtanh(%c"}}},
    {"FusesConvAdd", true, {{kAct, ""}, {"return (%o)", "return (%a)"}}},
    {"FusesRelu6", true, {{"aten::hardtanh(%a, %lo, %hi)", "aten::relu6(%a)"}}},
    {"FusesInPlaceRelu", true, {{"aten::hardtanh(%a, %lo, %hi)", "aten::relu_(%a)"}}},
    {"FusesSilu", true, {{"aten::hardtanh(%a, %lo, %hi)", "aten::silu_(%a)"}}},
    {"FusesLeakyRelu", true, {{"aten::hardtanh(%a, %lo, %hi)", "aten::leaky_relu(%a, %lo)"}}},
    {"FusesGelu",
     true,
     {{"%l : int[]", "%t : str = prim::Constant[value=\"tanh\"]()\n  %l : int[]"},
      {"aten::hardtanh(%a, %lo, %hi)", "aten::gelu(%a, %t)"}}},
    {"LeavesAConvAlone", false, {{kAdd, ""}, {kAct, ""}, {"return (%o)", "return (%c)"}}},
    {"SkipsConvAsSecondOperand", // chainIsAddSelf
     false,
     {{kAct, ""}, {"add(%c, %other, %one)", "add(%other, %c, %one)"}, {"(%o)", "(%a)"}}},
    {"SkipsNonConstantActivationArguments", // activationArgumentsAreConstant
     false,
     {{kAdd, ""},
      {"hardtanh(%a, %lo", "hardtanh(%c, %other"},
      {", %other : Tensor", ""},
      {"%lo : float = prim::Constant[value=0.]()", "%other : float = aten::Float(%one)"}}},
    {"SkipsUnknownGeluApproximation", // activationArgumentsAreConstant
     false,
     {{kAdd, ""},
      {"%l : int[]", "%t : str = prim::Constant[value=\"erf\"]()\n  %l : int[]"},
      {"aten::hardtanh(%a, %lo, %hi)", "aten::gelu(%c, %t)"}}},
    {"SkipsScalarAdd", // isTensorAdd
     false,
     {{kAct, ""},
      {", %other : Tensor", ""},
      {"add(%c, %other", "add(%c, %hi"},
      {"return (%o)", "return (%a)"}}},
    {"SkipsAnActivationItDoesNotCompute", // isFusableActivation
     false,
     {{kAdd, ""}, {"aten::hardtanh(%a, %lo, %hi)", "aten::tanh(%c)"}}},
    {"SkipsBatchNormAfterTheConv", // isFusableActivation: BN is not folded
     false,
     {{kAdd, ""},
      {"%l : int[]", "%f : bool = prim::Constant[value=1]()\n  %l : int[]"},
      {kAct, "%o : Tensor = aten::batch_norm(%c, %b, %b, %b, %b, %f, %lo, %hi, %f)"}}},
    {"SkipsAnIntermediateUsedTwice", // hasSingleUse
     false,
     {{kAct, ""}, {"return (%o)", "return (%a, %c)"}}},
    {"LeavesInPlaceAddOnLiveTensor", // notInPlaceOnLiveTensor
     false,
     {{kAct, ""}, {"aten::add(%c, %other", "aten::add_(%other, %c"}, {"(%o)", "(%a)"}}},
};

TORCHFUSE_VARIANT_TESTS(FuseConvAddAct, ConvAddActVariant, kVariants, chain(), run, expectFused);

TEST(FuseConvAddAct, WritesTheOpsArguments) {
  auto graph = parse(edit(chain(), {{"aten::add(", "aten::add_("}}));
  ASSERT_EQ(run(graph), 1);
  graph->lint();
  // promote=false for add_, activation hardtanh with (0, 6).
  FileCheck()
      .check("prim::Constant[value=0]()")
      ->check("prim::Constant[value=\"hardtanh\"]()")
      ->check("prim::Constant[value=[0., 6.]]()")
      ->check("torchfuse::custom_conv_add_act(%x, %w, %b, ")
      ->check(", %other, ")
      ->run(*graph);
}

TEST(FuseConvAddAct, WritesNoneWithoutAnAdd) {
  auto graph = parse(edit(chain(), {{kAdd, ""}, {"hardtanh(%a", "hardtanh(%c"}}));
  ASSERT_EQ(run(graph), 1);
  FileCheck().check("NoneType = prim::Constant()")->check("custom_conv_add_act")->run(*graph);
}

TEST(FuseConvAddAct, FusesConv1dAndConv3d) {
  for (const char* conv : {"aten::conv1d", "aten::conv3d"}) {
    expectFused(edit(chain(), {{"aten::conv2d", conv}}));
  }
}

TEST(FuseConvAddAct, MatchesTheUnfusedGraphNumerically) {
  const std::vector<Edits> forms = {
      {},
      {{"aten::add(", "aten::add_("}, {"aten::hardtanh(%a, %lo, %hi)", "aten::silu_(%a)"}},
      {{"add(%c, %other, %one)", "add(%c, %other, %two)"},
       {"aten::hardtanh(%a, %lo, %hi)", "aten::leaky_relu(%a, %hi)"}},
      {{kAct, ""}, {"return (%o)", "return (%a)"}},
      {{kAdd, ""}, {"aten::hardtanh(%a, %lo, %hi)", "aten::hardswish(%c)"}},
  };
  for (const auto& form : forms) {
    expectSameOutputs(edit(chain(), form), run, [](const at::TensorOptions& o) {
      return std::vector<at::IValue>{
          at::randn({2, 3, 6, 6}, o) * 3, at::randn({4, 3, 3, 3}, o), at::randn({4}, o),
          at::randn({2, 4, 6, 6}, o)};
    });
  }
}

} // namespace
} // namespace torchfuse::passes
