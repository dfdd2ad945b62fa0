#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using namespace testing;

int64_t run(std::shared_ptr<torch::jit::Graph>& g) {
  return FuseAddLayerNorm(g);
}

// post-LN: layer_norm(x + y); variants edit it into the other forms.
std::string chain() {
  return R"IR(
graph(%x : Tensor, %y : Tensor, %w : Tensor, %b : Tensor):
  %one : int = prim::Constant[value=1]()
  %two : int = prim::Constant[value=2]()
  %half : float = prim::Constant[value=0.5]()
  %eps : float = prim::Constant[value=1.0000000000000001e-05]()
  %true : bool = prim::Constant[value=1]()
  %shape : int[] = prim::Constant[value=[8]]()
  %s : Tensor = aten::add(%x, %y, %one)
  %o : Tensor = aten::layer_norm(%s, %shape, %w, %b, %eps, %true)
  return (%o))IR";
}

void expectFused(const std::string& ir) {
  testing::expectFused(
      ir, run, "torchfuse::custom_add_layer_norm", {"aten::layer_norm", "aten::add_("});
}

const char* const kAdd = "%s : Tensor = aten::add(%x, %y, %one)";
const char* const kNorm = "%o : Tensor = aten::layer_norm(%s, %shape, %w, %b, %eps, %true)";

// chain() and its variants; a negative one names the filter it tests.
const Variant kVariants[] = {
    {"FusesPostNormAdd", true, {}},
    {"FusesEitherOperandOrder", true, {{kAdd, "%s : Tensor = aten::add(%y, %x, %one)"}}},
    {"FusesAnyAlpha", true, {{kAdd, "%s : Tensor = aten::add(%x, %y, %half)"}}},
    {"FusesWithoutWeightAndBias",
     true,
     {{kNorm,
       "%nn : NoneType = prim::Constant()\n"
       "  %o : Tensor = aten::layer_norm(%s, %shape, %nn, %nn, %eps, %true)"}}},
    {"FusesPreNormSumReadAfter",
     true,
     {{"return (%o)", "%r : Tensor = aten::add(%s, %o, %one)\n  return (%r)"}}},
    {"FusesPreNormSumReturned", true, {{"return (%o)", "return (%o, %s)"}}},
    {"FusesPreNormSumReadBefore",
     true,
     {{kNorm, std::string("%z : Tensor = aten::mul(%s, %s)\n  ") + kNorm},
      {"return (%o)", "return (%o, %z)"}}},
    {"FusesAddIntoFreshTensor",
     true,
     {{kAdd, "%t : Tensor = aten::mul(%x, %x)\n  %s : Tensor = aten::add_(%t, %y, %one)"}}},
    {"SkipsAddIntoLiveTensor", // addIsOutOfPlaceOrIntoFresh
     false,
     {{kAdd, "%s : Tensor = aten::add_(%x, %y, %one)"}}},
    {"SkipsAddIntoFreshTensorReadTwice", // addIsOutOfPlaceOrIntoFresh
     false,
     {{kAdd, "%t : Tensor = aten::mul(%x, %x)\n  %s : Tensor = aten::add_(%t, %y, %one)"},
      {"return (%o)", "return (%o, %t)"}}},
    {"SkipsScalarAdd", // isTensorAdd
     false,
     {{kAdd, "%s : Tensor = aten::add(%x, %half, %one)"}}},
    {"SkipsNonConstantNormalizedShape", // normArgumentsAreConstant
     false,
     {{kNorm,
       "%n : int = aten::size(%x, %one)\n  %sh : int[] = prim::ListConstruct(%n)\n"
       "  %o : Tensor = aten::layer_norm(%s, %sh, %w, %b, %eps, %true)"}}},
    {"SkipsNonConstantEps", // normArgumentsAreConstant
     false,
     {{kNorm,
       "%e : float = aten::Float(%y)\n"
       "  %o : Tensor = aten::layer_norm(%s, %shape, %w, %b, %e, %true)"}}},
    {"SkipsSumWrittenInPlaceAfter", // sumNotWrittenInPlace
     false,
     {{"return (%o)", "%z : Tensor = aten::relu_(%s)\n  return (%o, %z)"}}},
    {"SkipsSumWrittenThroughAView", // sumNotWrittenInPlace
     false,
     {{"return (%o)",
       "%v : Tensor = aten::select(%s, %one, %one)\n  %z : Tensor = aten::relu_(%v)\n"
       "  return (%o, %z)"}}},
    {"SkipsSumReadByTwoNorms", // sumFeedsOneNorm
     false,
     {{"return (%o)",
       "%o2 : Tensor = aten::layer_norm(%s, %shape, %w, %b, %eps, %true)\n  return (%o, %o2)"}}},
    {"SkipsWeightWrittenBetween", // noInterveningWrites
     false,
     {{kNorm, std::string("%z : Tensor = aten::mul_(%w, %two)\n  ") + kNorm}}},
    {"SkipsSumReadBeforeANormArgumentIsComputed", // normArgumentsHoistable
     false,
     {{kNorm,
       "%z : Tensor = aten::mul(%s, %s)\n  %w2 : Tensor = aten::mul(%w, %two)\n"
       "  %o : Tensor = aten::layer_norm(%s, %shape, %w2, %b, %eps, %true)"},
      {"return (%o)", "return (%o, %z)"}}},
    {"SkipsAnotherNorm", // isLayerNorm
     false,
     {{kNorm,
       "%g : Tensor = aten::group_norm(%s, %two, %w, %b, %eps, %true)\n  %o : Tensor = aten::relu(%g)"}}},
};

TORCHFUSE_VARIANT_TESTS(FuseAddLayerNorm, AddLayerNormVariant, kVariants, chain(), run, expectFused);

TEST(FuseAddLayerNorm, WritesTheOpsArguments) {
  auto graph = parse(chain());
  ASSERT_EQ(run(graph), 1);
  graph->lint();
  FileCheck()
      .check("torchfuse::custom_add_layer_norm(%x, %y, %")
      ->check(", %w, %b, %")
      ->check_not("aten::add")
      ->check("return")
      ->run(*graph);
  // promote (an out-of-place add) and write_sum (no other use)
  const auto* fused = graph->outputs()[0]->node();
  EXPECT_EQ(torch::jit::toIValue(fused->input(3))->toBool(), true);
  EXPECT_EQ(torch::jit::toIValue(fused->input(8))->toBool(), false);
}

TEST(FuseAddLayerNorm, WritesTheSumForPreNormAndKeepsInPlaceAddsUnpromoted) {
  auto graph = parse(edit(
      chain(), {{kAdd, "%t : Tensor = aten::mul(%x, %x)\n  %s : Tensor = aten::add_(%t, %y, %one)"},
                {"return (%o)", "return (%o, %s)"}}));
  ASSERT_EQ(run(graph), 1);
  graph->lint();
  const auto* fused = graph->outputs()[0]->node();
  ASSERT_EQ(fused->kind().toQualString(), std::string("torchfuse::custom_add_layer_norm"));
  EXPECT_EQ(graph->outputs()[1], fused->output(1));
  EXPECT_EQ(torch::jit::toIValue(fused->input(3))->toBool(), false);
  EXPECT_EQ(torch::jit::toIValue(fused->input(8))->toBool(), true);
}

TEST(FuseAddLayerNorm, PlacesThePreNormOpAtTheAddWhenTheSumIsReadBeforeTheNorm) {
  auto graph = parse(edit(
      chain(), {{kNorm, std::string("%z : Tensor = aten::mul(%s, %s)\n  ") + kNorm},
                {"return (%o)", "return (%o, %z)"}}));
  ASSERT_EQ(run(graph), 1);
  graph->lint();
  FileCheck()
      .check("torchfuse::custom_add_layer_norm")
      ->check("aten::mul")
      ->check_not("aten::layer_norm")
      ->run(*graph);
}

TEST(FuseAddLayerNorm, SkipsANormInAnotherBlock) { // inSameBlock
  expectUnchanged(R"IR(
graph(%x : Tensor, %y : Tensor, %w : Tensor, %b : Tensor, %c : bool):
  %one : int = prim::Constant[value=1]()
  %eps : float = prim::Constant[value=1.0000000000000001e-05]()
  %true : bool = prim::Constant[value=1]()
  %shape : int[] = prim::Constant[value=[8]]()
  %s : Tensor = aten::add(%x, %y, %one)
  %out : Tensor = prim::If(%c)
    block0():
      %o : Tensor = aten::layer_norm(%s, %shape, %w, %b, %eps, %true)
      -> (%o)
    block1():
      -> (%x)
  return (%out))IR",
                  run);
}

TEST(FuseAddLayerNorm, FusesInIfAndLoopBlocks) {
  const std::string ir = R"IR(
graph(%x : Tensor, %y : Tensor, %w : Tensor, %b : Tensor, %c : bool, %n : int):
  %one : int = prim::Constant[value=1]()
  %true : bool = prim::Constant[value=1]()
  %eps : float = prim::Constant[value=1.0000000000000001e-05]()
  %shape : int[] = prim::Constant[value=[8]]()
)IR" +
      ifTail({"%s : Tensor = aten::add(%x, %y, %one)",
              "%o : Tensor = aten::layer_norm(%s, %shape, %w, %b, %eps, %true)"},
             loop({"%s2 : Tensor = aten::add(%h, %y, %one)",
                   "%o2 : Tensor = aten::layer_norm(%s2, %shape, %w, %b, %eps, %true)"}),
             "%lo");
  expectFusedInIfAndLoop(ir, run, "torchfuse::custom_add_layer_norm", "aten::layer_norm");
}

TEST(FuseAddLayerNorm, MatchesTheUnfusedGraphNumerically) {
  const std::vector<Edits> forms = {
      {},
      {{kAdd, "%s : Tensor = aten::add(%y, %x, %half)"}},
      {{"return (%o)", "%r : Tensor = aten::add(%s, %o, %one)\n  return (%r, %s)"}},
      {{kNorm, std::string("%z : Tensor = aten::mul(%s, %s)\n  ") + kNorm},
       {"return (%o)", "return (%o, %z)"}},
      {{kAdd, "%t : Tensor = aten::mul(%x, %x)\n  %s : Tensor = aten::add_(%t, %y, %two)"},
       {"return (%o)", "return (%o, %s)"}},
  };
  for (const auto& form : forms) {
    auto graph = parse(edit(chain(), form));
    auto fused = graph->copy();
    ASSERT_EQ(run(fused), 1);
    for (auto dtype : {at::kFloat, at::kDouble}) {
      torch::manual_seed(0);
      const auto o = at::TensorOptions().dtype(dtype);
      // NB: y broadcasts over the rows (BERT's position embeddings).
      const std::vector<at::IValue> in = {
          at::randn({2, 5, 8}, o) * 3, at::randn({1, 5, 8}, o), at::randn({8}, o),
          at::randn({8}, o)};
      const auto want = runGraph(graph, in);
      const auto got = runGraph(fused, in);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        expectClose(got[i].toTensor(), want[i].toTensor());
      }
    }
  }
}

} // namespace
} // namespace torchfuse::passes
