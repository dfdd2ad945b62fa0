#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using namespace testing;

int64_t run(std::shared_ptr<torch::jit::Graph>& g) {
  return FuseConvActMaxPool(g);
}

// conv2d -> relu_ -> max_pool2d; variants edit it into the other forms.
std::string chain() {
  return R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor):
  %zero : int = prim::Constant[value=0]()
  %one : int = prim::Constant[value=1]()
  %two : int = prim::Constant[value=2]()
  %false : bool = prim::Constant[value=0]()
  %lo : float = prim::Constant[value=0.]()
  %hi : float = prim::Constant[value=6.]()
  %l : int[] = prim::ListConstruct(%one, %one)
  %k : int[] = prim::ListConstruct(%two, %two)
  %p : int[] = prim::ListConstruct(%zero, %zero)
  %c : Tensor = aten::conv2d(%x, %w, %b, %l, %l, %l, %one)
  %a : Tensor = aten::relu_(%c)
  %o : Tensor = aten::max_pool2d(%a, %k, %k, %p, %l, %false)
  return (%o))IR";
}

void expectFused(const std::string& ir) {
  testing::expectFused(
      ir, run, "torchfuse::custom_conv_act_max_pool",
      {"aten::conv", "aten::relu", "aten::hardtanh", "aten::max_pool2d"});
}

const char* const kAct = "%a : Tensor = aten::relu_(%c)";

const Variant kVariants[] = {
    {"FusesConvReluMaxPool", true, {}},
    {"FusesOutOfPlaceRelu6", true, {{"aten::relu_(%c)", "aten::hardtanh(%c, %lo, %hi)"}}},
    {"FusesConvMaxPool", true, {{kAct, ""}, {"max_pool2d(%a", "max_pool2d(%c"}}},
    {"SkipsNonConstantActivationArguments", // activationArgumentsAreConstant
     false,
     {{"aten::relu_(%c)", "aten::hardtanh(%c, %lo, %hi)"},
      {"%lo : float = prim::Constant[value=0.]()", "%lo : float = aten::Float(%two)"}}},
    {"SkipsAnAddBetweenConvAndActivation", // isFusableActivation: custom_conv_add_act's
     false,
     {{"aten::relu_(%c)", "aten::add(%c, %c, %one)"}}},
    {"SkipsMaxPoolWithIndices", // isMaxPool2d
     false,
     {{"%o : Tensor = aten::max_pool2d(%a, %k, %k, %p, %l, %false)",
       "%o : Tensor, %i : Tensor = aten::max_pool2d_with_indices(%a, %k, %k, %p, %l, %false)"}}},
    {"SkipsAnIntermediateUsedTwice", // hasSingleUse
     false,
     {{"return (%o)", "return (%o, %c)"}}},
    {"SkipsTheActivationReadTwice", // hasSingleUse
     false,
     {{"return (%o)", "return (%o, %a)"}}},
};

TORCHFUSE_VARIANT_TESTS(
    FuseConvActMaxPool,
    ConvActMaxPoolVariant,
    kVariants,
    chain(),
    run,
    expectFused);

TEST(FuseConvActMaxPool, WritesTheOpsArguments) {
  auto graph = parse(chain());
  ASSERT_EQ(run(graph), 1);
  graph->lint();
  FileCheck()
      .check("prim::Constant[value=\"relu_\"]()")
      ->check("torchfuse::custom_conv_act_max_pool(%x, %w, %b, ")
      ->run(*graph);
  // the pool's lists follow the activation's arguments
  const auto* op = graph->return_node()->input(0)->node();
  ASSERT_EQ(op->inputs().size(), 14u);
  EXPECT_EQ(op->input(9), op->input(10));      // kernel_size, stride: [2, 2]
  EXPECT_EQ(op->input(12), op->input(3));      // dilation, the conv's stride: [1, 1]
  const auto* padding = op->input(11)->node(); // [0, 0]
  ASSERT_EQ(padding->inputs().size(), 2u);
  EXPECT_EQ(torch::jit::toIValue(padding->input(0))->toInt(), 0);
  FileCheck().check("custom_conv_act_max_pool")->run(*graph);
}

TEST(FuseConvActMaxPool, MatchesTheUnfusedGraphNumerically) {
  const std::vector<Edits> forms = {
      {},
      {{"aten::relu_(%c)", "aten::silu(%c)"}},
      {{kAct, ""}, {"max_pool2d(%a", "max_pool2d(%c"}},
      {{"%o : Tensor = aten::max_pool2d(%a, %k, %k, %p, %l, %false)",
        "%t : bool = prim::Constant[value=1]()\n  %o : Tensor = aten::max_pool2d(%a, %k, %l, %l, "
        "%k, %t)"}},
  };
  for (const auto& form : forms) {
    expectSameOutputs(edit(chain(), form), run, [](const at::TensorOptions& o) {
      return std::vector<at::IValue>{
          at::randn({2, 3, 9, 9}, o) * 3, at::randn({4, 3, 3, 3}, o), at::randn({4}, o)};
    });
  }
}

} // namespace
} // namespace torchfuse::passes
