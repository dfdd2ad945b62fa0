#include <array>
#include <utility>

#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using namespace testing;

int64_t run(std::shared_ptr<torch::jit::Graph>& g) {
  return FuseLinearAct(g);
}

// linear -> gelu (exact); variants edit it into the other forms.
std::string chain() {
  return R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %y : Tensor):
  %one : int = prim::Constant[value=1]()
  %lo : float = prim::Constant[value=0.]()
  %hi : float = prim::Constant[value=6.]()
  %none : str = prim::Constant[value="none"]()
  %l : Tensor = aten::linear(%x, %w, %b)
  %o : Tensor = aten::gelu(%l, %none)
  return (%o))IR";
}

void expectFused(const std::string& ir) {
  testing::expectFused(
      ir, run, "torchfuse::custom_linear_act",
      {"aten::linear", "aten::gelu", "aten::relu", "aten::silu", "aten::hardtanh"});
}

const char* const kAct = "%o : Tensor = aten::gelu(%l, %none)";

// chain() and its variants; a negative one names the filter it tests.
const Variant kVariants[] = {
    {"FusesLinearGelu", true, {}},
    {"FusesWithoutBias",
     true,
     {{"%l : Tensor", "%nb : NoneType = prim::Constant()\n  %l : Tensor"},
      {"linear(%x, %w, %b)", "linear(%x, %w, %nb)"}}},
    {"FusesRelu", true, {{kAct, "%o : Tensor = aten::relu(%l)"}}},
    {"FusesInPlaceRelu", true, {{kAct, "%o : Tensor = aten::relu_(%l)"}}},
    {"FusesRelu6", true, {{kAct, "%o : Tensor = aten::relu6(%l)"}}},
    {"FusesInPlaceHardtanh", true, {{kAct, "%o : Tensor = aten::hardtanh_(%l, %lo, %hi)"}}},
    {"FusesSilu", true, {{kAct, "%o : Tensor = aten::silu(%l)"}}},
    {"FusesHardswish", true, {{kAct, "%o : Tensor = aten::hardswish_(%l)"}}},
    {"FusesSigmoid", true, {{kAct, "%o : Tensor = aten::sigmoid(%l)"}}},
    {"FusesLeakyRelu", true, {{kAct, "%o : Tensor = aten::leaky_relu(%l, %hi)"}}},
    {"FusesGeluTanh",
     true,
     {{"%none : str = prim::Constant[value=\"none\"]()",
       "%none : str = prim::Constant[value=\"tanh\"]()"}}},
    {"LeavesALinearAlone", false, {{kAct, ""}, {"return (%o)", "return (%l)"}}},
    {"SkipsAnIntermediateUsedTwice", // hasSingleUse
     false,
     {{"return (%o)", "return (%o, %l)"}}},
    {"SkipsNonConstantActivationArguments", // activationArgumentsAreConstant
     false,
     {{kAct, "%h : float = aten::Float(%y)\n  %o : Tensor = aten::hardtanh(%l, %lo, %h)"}}},
    {"SkipsNonConstantGeluApproximation", // activationArgumentsAreConstant
     false,
     {{"%none : str = prim::Constant[value=\"none\"]()",
       "%none : str = prim::Constant[value=\"n\"]()\n  %s : str = aten::add(%none, %none)"},
      {"gelu(%l, %none)", "gelu(%l, %s)"}}},
    {"SkipsUnknownGeluApproximation", // activationArgumentsAreConstant
     false,
     {{"%none : str = prim::Constant[value=\"none\"]()",
       "%none : str = prim::Constant[value=\"erf\"]()"}}},
    {"SkipsAnActivationItDoesNotCompute", // isFusableActivation
     false,
     {{kAct, "%o : Tensor = aten::tanh(%l)"}}},
    {"LeavesInPlaceActivationOnLiveTensor", // notInPlaceOnLiveTensor
     false,
     {{kAct, "%o : Tensor = aten::relu_(%l)\n  %z : Tensor = aten::add(%l, %y, %one)"},
      {"return (%o)", "return (%z)"}}},
    // NB: in the pipeline FuseLinearAddRelu runs first and keeps the seed
    // chain (passes/registry.cpp); run alone, this pass takes it too.
    {"FusesLinearAddReluRunAlone",
     true,
     {{kAct, "%a : Tensor = aten::add(%l, %y, %one)\n  %o : Tensor = aten::relu(%a)"}}},
    {"FusesLinearAddGelu",
     true,
     {{kAct, "%a : Tensor = aten::add(%l, %y, %one)\n  %o : Tensor = aten::gelu(%a, %none)"}}},
    {"FusesLinearAdd", true, {{kAct, "%o : Tensor = aten::add(%l, %y, %one)"}}},
    {"FusesLinearAddWithTheResidualFirst", true, {{kAct, "%o : Tensor = aten::add(%y, %l, %one)"}}},
    {"FusesAnAddIntoTheLinearOutput", true, {{kAct, "%o : Tensor = aten::add_(%l, %y, %hi)"}}},
    {"LeavesAnAddIntoTheResidual", // notInPlaceOnLiveTensor
     false,
     {{kAct, "%o : Tensor = aten::add_(%y, %l, %one)"}}},
    {"LeavesASumThatALayerNormReads", // sumIsLayerNormed: FuseAddLayerNorm's
     false,
     {{kAct,
       "%o0 : Tensor = aten::add(%l, %y, %one)\n"
       "  %shape : int[] = prim::ListConstruct(%one)\n"
       "  %eps : float = prim::Constant[value=1.0000000000000001e-05]()\n"
       "  %f : bool = prim::Constant[value=0]()\n"
       "  %nn : NoneType = prim::Constant()\n"
       "  %o : Tensor = aten::layer_norm(%o0, %shape, %nn, %nn, %eps, %f)"}}},
    {"SkipsALinearOutputAlsoReadBesideTheAdd", // hasSingleUse
     false,
     {{kAct, "%o : Tensor = aten::add(%l, %y, %one)"}, {"return (%o)", "return (%o, %l)"}}},
};

TORCHFUSE_VARIANT_TESTS(FuseLinearAct, LinearActVariant, kVariants, chain(), run, expectFused);

TEST(FuseLinearAct, WritesTheOpsArguments) {
  auto graph = parse(edit(chain(), {{kAct, "%o : Tensor = aten::hardtanh_(%l, %lo, %hi)"}}));
  ASSERT_EQ(run(graph), 1);
  graph->lint();
  FileCheck()
      .check("prim::Constant[value=\"hardtanh_\"]()")
      ->check("prim::Constant[value=[0., 6.]]()")
      ->check("torchfuse::custom_linear_act(%x, %w, %b, ")
      ->run(*graph);
}

// The residual's arguments as the graph spelled the add: other, alpha,
// promote (add, not add_), other_first (the residual as add's self).
TEST(FuseLinearAct, WritesTheResidualsArguments) {
  const std::pair<const char*, std::array<bool, 2>> forms[] = {
      {"%o : Tensor = aten::add(%l, %y, %hi)", {true, false}},
      {"%o : Tensor = aten::add_(%l, %y, %hi)", {false, false}},
      {"%o : Tensor = aten::add(%y, %l, %hi)", {true, true}},
  };
  for (const auto& [add, flags] : forms) {
    auto graph = parse(edit(chain(), {{kAct, add}}));
    ASSERT_EQ(run(graph), 1) << add;
    graph->lint();
    const torch::jit::Node* op = nullptr;
    for (const auto* n : graph->nodes()) {
      if (n->kind().toQualString() == std::string("torchfuse::custom_linear_act")) {
        op = n;
      }
    }
    ASSERT_NE(op, nullptr) << add;
    EXPECT_EQ(op->input(5), graph->inputs()[3]) << add; // %y
    EXPECT_EQ(torch::jit::toIValue(op->input(6))->toDouble(), 6.0) << add;
    EXPECT_EQ(torch::jit::toIValue(op->input(3))->toStringRef(), "none") << add;
    EXPECT_EQ(torch::jit::toIValue(op->input(7))->toBool(), flags[0]) << add;
    EXPECT_EQ(torch::jit::toIValue(op->input(8))->toBool(), flags[1]) << add;
  }
}

TEST(FuseLinearAct, FusesInIfAndLoopBlocks) {
  const std::string ir = R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %c : bool, %n : int):
  %true : bool = prim::Constant[value=1]()
)IR" +
      ifTail({"%l : Tensor = aten::linear(%x, %w, %b)", "%o : Tensor = aten::silu(%l)"},
             loop({"%l2 : Tensor = aten::linear(%h, %w, %b)", "%o2 : Tensor = aten::relu(%l2)"}),
             "%lo");
  expectFusedInIfAndLoop(ir, run, "torchfuse::custom_linear_act", "aten::linear");
}

TEST(FuseLinearAct, MatchesTheUnfusedGraphNumerically) {
  const std::vector<Edits> forms = {
      {},
      {{kAct, "%o : Tensor = aten::relu_(%l)"}},
      {{kAct, "%o : Tensor = aten::leaky_relu(%l, %hi)"}},
      {{kAct, "%o : Tensor = aten::hardsigmoid(%l)"}},
  };
  for (const auto& form : forms) {
    expectSameOutputs(edit(chain(), form), run, [](const at::TensorOptions& o) {
      return std::vector<at::IValue>{
          at::randn({2, 5, 8}, o) * 3, at::randn({6, 8}, o), at::randn({6}, o), at::randn({1}, o)};
    });
  }
}

// ---- optimize_for_inference's FrozenLinearTranspose form --------------------

// matmul(x, Wt) [-> add(., b, 1)] -> act, with Wt and b the constants
// `wt` and `b` in place of the graph inputs %wt and %b.
std::shared_ptr<torch::jit::Graph> transposedForm(
    const std::string& tail,
    const at::Tensor& wt,
    const at::Tensor& b) {
  auto graph = parse(R"IR(
graph(%x : Tensor, %wt : Tensor, %b : Tensor):
  %one : int = prim::Constant[value=1]()
  %two : int = prim::Constant[value=2]()
  %m : Tensor = aten::matmul(%x, %wt)
)IR" + tail);
  torch::jit::WithInsertPoint guard(graph->nodes().front());
  graph->inputs()[1]->replaceAllUsesWith(graph->insertConstant(wt));
  graph->inputs()[2]->replaceAllUsesWith(graph->insertConstant(b));
  graph->eraseInput(2);
  graph->eraseInput(1);
  return graph;
}

const char* const kBiasRelu = R"IR(
  %a : Tensor = aten::add(%m, %b, %one)
  %o : Tensor = aten::relu(%a)
  return (%o))IR";

TEST(FuseLinearAct, FusesTheFrozenLinearTransposeFormWithoutBias) {
  torch::manual_seed(0);
  const auto wt = at::randn({8, 6});
  const auto x = at::randn({2, 3, 8}) * 3;
  auto graph = transposedForm("  %o : Tensor = aten::silu(%m)\n  return (%o)", wt, at::randn({6}));
  auto fused = graph->copy();
  ASSERT_EQ(run(fused), 1);
  fused->lint();
  FileCheck()
      .check("NoneType = prim::Constant()")
      ->check("torchfuse::custom_linear_act")
      ->check_not("aten::matmul")
      ->run(*fused);
  expectClose(runGraph(fused, {x})[0].toTensor(), runGraph(graph, {x})[0].toTensor());
}

void expectUnchangedGraph(std::shared_ptr<torch::jit::Graph> graph, const std::string& what) {
  const auto before = graph->toString();
  EXPECT_EQ(run(graph), 0) << what;
  EXPECT_EQ(graph->toString(), before) << what;
}

TEST(FuseLinearAct, SkipsTransposeFormsThatAreNotALinear) {
  torch::manual_seed(0);
  const auto wt = at::randn({8, 6});
  // The form with a bias add: under autocast the add promotes the 16-bit
  // matmul output with the float32 bias to float32, a linear does not.
  expectUnchangedGraph(transposedForm(kBiasRelu, wt, at::randn({6})), "matmul -> add -> relu");
  // matmulWeightIsConstantMatrix: a 1-D or 3-D constant, or a runtime weight.
  for (const auto& w : {at::randn({8}), at::randn({2, 8, 6})}) {
    expectUnchangedGraph(
        transposedForm("  %o : Tensor = aten::relu(%m)\n  return (%o)", w, at::randn({6})),
        std::to_string(w.dim()) + "-D weight");
  }
  expectUnchanged(
      R"IR(
graph(%x : Tensor, %wt : Tensor):
  %m : Tensor = aten::matmul(%x, %wt)
  %o : Tensor = aten::relu(%m)
  return (%o))IR",
      run);
}

} // namespace
} // namespace torchfuse::passes
