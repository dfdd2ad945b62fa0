#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using namespace testing;

int64_t run(std::shared_ptr<torch::jit::Graph>& g) {
  return FuseGateMul(g);
}

// torchvision's squeeze-and-excitation block: pool -> conv -> silu -> conv
// -> sigmoid -> mul by the pooled tensor; variants edit it into the other
// forms.
std::string chain() {
  return R"IR(
graph(%x : Tensor, %w1 : Tensor, %b1 : Tensor, %w2 : Tensor, %b2 : Tensor, %y : Tensor):
  %one : int = prim::Constant[value=1]()
  %zero : int = prim::Constant[value=0]()
  %ones : int[] = prim::ListConstruct(%one, %one)
  %zeros : int[] = prim::ListConstruct(%zero, %zero)
  %s : Tensor = aten::adaptive_avg_pool2d(%x, %ones)
  %h : Tensor = aten::conv2d(%s, %w1, %b1, %ones, %zeros, %ones, %one)
  %a : Tensor = aten::silu(%h)
  %e : Tensor = aten::conv2d(%a, %w2, %b2, %ones, %zeros, %ones, %one)
  %g : Tensor = aten::sigmoid(%e)
  %o : Tensor = aten::mul(%g, %x)
  return (%o))IR";
}

void expectFused(const std::string& ir) {
  testing::expectFused(
      ir, run, "torchfuse::custom_gate_mul", {"aten::sigmoid", "aten::hardsigmoid", "aten::mul"});
}

const char* const kGate = "%g : Tensor = aten::sigmoid(%e)";
const char* const kMul = "%o : Tensor = aten::mul(%g, %x)";
const char* const kPool = "%s : Tensor = aten::adaptive_avg_pool2d(%x, %ones)";

// chain() and its variants; a negative one names the rule it tests.
const Variant kVariants[] = {
    {"FusesASigmoidGate", true, {}},
    {"FusesAHardsigmoidGate", true, {{kGate, "%g : Tensor = aten::hardsigmoid(%e)"}}},
    {"FusesTheGateSecond", true, {{kMul, "%o : Tensor = aten::mul(%x, %g)"}}},
    {"FusesTimmsMeanSqueeze",
     true,
     {{kPool,
       "%t : bool = prim::Constant[value=1]()\n  %nd : NoneType = prim::Constant()\n"
       "  %three : int = prim::Constant[value=3]()\n  %two : int = prim::Constant[value=2]()\n"
       "  %dims : int[] = prim::ListConstruct(%two, %three)\n"
       "  %s : Tensor = aten::mean(%x, %dims, %t, %nd)"}}},
    {"SkipsAGateUsedTwice", // hasSingleUse
     false,
     {{"return (%o)", "return (%o, %g)"}}},
    {"SkipsAnInPlaceSigmoid", // isGateActivation
     false,
     {{kGate, "%g : Tensor = aten::sigmoid_(%e)"}}},
    {"SkipsATanhGate", // isGateActivation
     false,
     {{kGate, "%g : Tensor = aten::tanh(%e)"}}},
    {"SkipsAnInPlaceMul", // isTensorMul
     false,
     {{kMul, "%o : Tensor = aten::mul_(%x, %g)"}}},
    {"SkipsAGateOfAnotherTensor", // gateSqueezesInput
     false,
     {{kMul, "%o : Tensor = aten::mul(%g, %y)"}}},
    {"SkipsSwish", // gateSqueezesInput
     false,
     {{kMul, "%o : Tensor = aten::mul(%g, %e)"}}},
    {"SkipsAPoolToTwo", // gateSqueezesInput
     false,
     {{"%ones : int[] = prim::ListConstruct(%one, %one)",
       "%ones : int[] = prim::ListConstruct(%one, %one)\n"
       "  %two : int = prim::Constant[value=2]()\n"
       "  %twos : int[] = prim::ListConstruct(%two, %two)"},
      {"adaptive_avg_pool2d(%x, %ones)", "adaptive_avg_pool2d(%x, %twos)"}}},
    {"SkipsAnUnknownOpBetween", // gateSqueezesInput
     false,
     {{"%a : Tensor = aten::silu(%h)", "%a : Tensor = aten::exp(%h)"}}},
};

TORCHFUSE_VARIANT_TESTS(FuseGateMul, GateMulVariant, kVariants, chain(), run, expectFused);

TEST(FuseGateMul, WritesTheOpsArguments) {
  auto graph = parse(edit(chain(), {{kGate, "%g : Tensor = aten::hardsigmoid(%e)"}}));
  ASSERT_EQ(run(graph), 1);
  graph->lint();
  FileCheck()
      .check("prim::Constant[value=\"hardsigmoid\"]()")
      ->check("prim::Constant[value=1]()")
      ->check("torchfuse::custom_gate_mul(%x, ")
      ->run(*graph);
}

TEST(FuseGateMul, MatchesTheUnfusedGraphNumerically) {
  const std::vector<Edits> forms = {
      {},
      {{kGate, "%g : Tensor = aten::hardsigmoid(%e)"}},
      {{kMul, "%o : Tensor = aten::mul(%x, %g)"}},
  };
  for (const auto& form : forms) {
    expectSameOutputs(edit(chain(), form), run, [](const at::TensorOptions& o) {
      return std::vector<at::IValue>{at::randn({2, 6, 5, 4}, o), at::randn({3, 6, 1, 1}, o),
                                     at::randn({3}, o),          at::randn({6, 3, 1, 1}, o) * 3,
                                     at::randn({6}, o),          at::randn({2, 6, 5, 4}, o)};
    });
  }
}

} // namespace
} // namespace torchfuse::passes
