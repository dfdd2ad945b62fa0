#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/passes.h"

#include <torch/csrc/jit/ir/constants.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>

namespace torchfuse::passes {
namespace {

using namespace testing;

using Constants = std::map<std::string, at::IValue>;

// resnet's downsampling block as the fusions leave it: y = relu(conv(x))
// fused, the downsample conv o = conv(x) + b2 unfused, and
// relu_(conv(y) + b1 + alpha * o) fused.
std::string block() {
  return R"IR(
graph(%x : Tensor, %w0 : Tensor, %b0 : Tensor, %w1 : Tensor, %b1 : Tensor, %w2 : Tensor, %b2 : Tensor, %alpha : float):
  %one : int = prim::Constant[value=1]()
  %zero : int = prim::Constant[value=0]()
  %none : NoneType = prim::Constant()
  %promote : bool = prim::Constant[value=1]()
  %relu : str = prim::Constant[value="relu"]()
  %relu_ : str = prim::Constant[value="relu_"]()
  %args : float[] = prim::ListConstruct()
  %l : int[] = prim::ListConstruct(%one, %one)
  %p : int[] = prim::ListConstruct(%zero, %zero)
  %y : Tensor = torchfuse::custom_conv_add_act(%x, %w0, %b0, %l, %p, %l, %one, %none, %one, %promote, %relu, %args)
  %o : Tensor = aten::conv2d(%x, %w2, %b2, %l, %p, %l, %one)
  %out : Tensor = torchfuse::custom_conv_add_act(%y, %w1, %b1, %l, %p, %l, %one, %o, %alpha, %promote, %relu_, %args)
  return (%out))IR";
}

// The block's parameters, as freeze_module makes them constants.
Constants parameters() {
  torch::manual_seed(0);
  const auto f = at::TensorOptions().dtype(at::kFloat);
  return {{"w0", at::randn({4, 3, 1, 1}, f)}, {"b0", at::randn({4}, f)},
          {"w1", at::randn({4, 4, 1, 1}, f)}, {"b1", at::randn({4}, f)},
          {"w2", at::randn({4, 3, 1, 1}, f)}, {"b2", at::randn({4}, f)},
          {"alpha", at::IValue(0.75)}};
}

// Parses `ir` and replaces the inputs named in `constants` by constants of
// their values.
std::shared_ptr<torch::jit::Graph> frozen(const std::string& ir, const Constants& constants) {
  auto graph = parse(ir);
  torch::jit::WithInsertPoint guard(graph->block()->nodes().front());
  for (size_t i = graph->inputs().size(); i-- > 0;) {
    auto* input = graph->inputs()[i];
    const auto it = constants.find(input->debugName());
    if (it != constants.end()) {
      input->replaceAllUsesWith(graph->insertConstant(it->second));
      graph->eraseInput(i);
    }
  }
  return graph;
}

struct Case {
  std::string name;
  bool folds;
  Edits edits;
  // Edits the parameters (an erased one stays a graph input).
  std::function<void(Constants&)> params = [](Constants&) {};
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

// A folding case: the conv keeps no bias, the op's is b1 + alpha * b2 (or
// b2 alone without b1), and the graph computes what it did.
void expectFolded(const std::string& ir, const Constants& params) {
  auto graph = frozen(ir, params);
  auto original = graph->copy();
  ASSERT_EQ(FoldResidualConvBias(graph), 1);
  graph->lint();
  torch::jit::Node* op = nullptr;
  torch::jit::Node* conv = nullptr;
  for (auto* n : graph->nodes()) {
    if (n->kind().toQualString() == std::string("torchfuse::custom_conv_add_act") &&
        n->input(7)->node()->kind() != c10::prim::Constant) {
      op = n;
    }
  }
  ASSERT_NE(op, nullptr);
  conv = op->input(7)->node();
  EXPECT_TRUE(conv->input(2)->mustBeNone());
  const auto bias = torch::jit::toIValue(op->input(2))->toTensor();
  const auto b2 = params.at("b2").toTensor().to(at::kDouble);
  const auto alpha = params.at("alpha").toScalar().toDouble();
  const auto expected = params.at("b1").isTensor()
      ? params.at("b1").toTensor().to(at::kDouble) + alpha * b2
      : alpha * b2;
  EXPECT_EQ(bias.scalar_type(), params.at("b2").toTensor().scalar_type());
  EXPECT_TRUE(at::allclose(bias.to(at::kDouble), expected, 1e-6, 1e-6));

  torch::manual_seed(1);
  const std::vector<at::IValue> in = {at::randn({2, 3, 5, 5})};
  expectClose(runGraph(graph, in)[0].toTensor(), runGraph(original, in)[0].toTensor());
}

void expectUnchanged(const std::string& ir, const Constants& params) {
  auto graph = frozen(ir, params);
  const auto before = graph->toString();
  EXPECT_EQ(FoldResidualConvBias(graph), 0);
  graph->lint();
  EXPECT_EQ(graph->toString(), before);
}

const char* const kConv = "%o : Tensor = aten::conv2d(%x, %w2, %b2, %l, %p, %l, %one)";
// A conv1d on x[0] transposed, (3, H, W) -> (H, 3, W): on an x of (2, 3, 4, 5)
// its (4, 4, 5) output broadcasts against the conv2d chain's (2, 4, 4, 5).
const char* const kConv1d =
    "%l1 : int[] = prim::ListConstruct(%one)\n"
    "  %p1 : int[] = prim::ListConstruct(%zero)\n"
    "  %x3 : Tensor = aten::select(%x, %zero, %zero)\n"
    "  %xt : Tensor = aten::transpose(%x3, %zero, %one)\n"
    "  %o : Tensor = aten::conv1d(%xt, %w2, %b2, %l1, %p1, %l1, %one)";

// The block and its variants; a negative one names the predicate it tests.
const Case kCases[] = {
    {"FoldsTheDownsampleBias", true, {}},
    {"FoldsIntoAnOpWithoutBias", // b1 None: the op's bias becomes alpha * b2
     true,
     {{"%w1, %b1, %l", "%w1, %none, %l"}},
     [](Constants& c) { c["b1"] = at::IValue(); }},
    {"FoldsAnIntAlpha",
     true,
     {{"%alpha : float", "%alpha : int"}},
     [](Constants& c) { c["alpha"] = at::IValue(int64_t{2}); }},
    {"FoldsAnOutOfPlaceActivationAndAddInPlace", // promote=false: add_ into conv(y)
     true,
     {{"%o, %alpha, %promote, %relu_", "%o, %alpha, %zero_b, %relu"},
      {"%none : NoneType", "%zero_b : bool = prim::Constant[value=0]()\n  %none : NoneType"}}},
    {"FoldsAConvolutionNode", // aten::_convolution, transposed=False
     true,
     {{kConv,
       "%f : bool = prim::Constant[value=0]()\n"
       "  %o : Tensor = aten::_convolution(%x, %w2, %b2, %l, %p, %l, %f, %p, %one, %f, %f, %f, %f)"}}},
    {"FoldsAnUnbatchedResidualConv", // channels k + 1 dims from the end either way
     true,
     {{kConv,
       "%x3 : Tensor = aten::select(%x, %zero, %zero)\n"
       "  %o : Tensor = aten::conv2d(%x3, %w2, %b2, %l, %p, %l, %one)"}}},
    {"SkipsAConvOutputUsedTwice", // otherIsBiasedConvReadOnlyByOp
     false,
     {{"return (%out)", "return (%out, %o)"}}},
    {"SkipsAnOtherThatIsNoConv", // otherIsBiasedConvReadOnlyByOp
     false,
     {{kConv, "%o : Tensor = aten::add(%x, %b2, %one)"}}},
    {"SkipsAConvWithoutBias", // otherIsBiasedConvReadOnlyByOp
     false,
     {{"%w2, %b2, %l", "%w2, %none, %l"}},
     [](Constants& c) { c["b2"] = at::IValue(); }},
    {"SkipsATransposedConvolution", // otherIsBiasedConvReadOnlyByOp (isBiasedConv)
     false,
     {{kConv,
       "%f : bool = prim::Constant[value=0]()\n"
       "  %t : bool = prim::Constant[value=1]()\n"
       "  %o : Tensor = aten::_convolution(%x, %w2, %b2, %l, %p, %l, %t, %p, %one, %f, %f, %f, %f)"}}},
    {"SkipsANonConstantAlpha", // alphaIsFiniteConstant
     false,
     {},
     [](Constants& c) { c.erase("alpha"); }},
    {"SkipsAnInfiniteAlpha", // alphaIsFiniteConstant
     false,
     {},
     [](Constants& c) { c["alpha"] = at::IValue(std::numeric_limits<double>::infinity()); }},
    {"SkipsANonConstantConvBias", // biasesAreFiniteConstants
     false,
     {},
     [](Constants& c) { c.erase("b2"); }},
    {"SkipsANonConstantOpBias", // biasesAreFiniteConstants
     false,
     {},
     [](Constants& c) { c.erase("b1"); }},
    {"SkipsANonFiniteBias", // biasesAreFiniteConstants
     false,
     {},
     [](Constants& c) {
       auto b = c["b2"].toTensor().clone();
       b[1] = std::nan("");
       c["b2"] = b;
     }},
    {"SkipsBiasesOfOtherDtypes", // biasesAgree
     false,
     {},
     [](Constants& c) { c["b2"] = c["b2"].toTensor().to(at::kDouble); }},
    {"SkipsBiasesOfOtherSizes", // biasesAgree (b2 would broadcast a channel)
     false,
     {},
     [](Constants& c) {
       c["w2"] = at::randn({1, 3, 1, 1});
       c["b2"] = at::randn({1});
     }},
    {"SkipsWithoutOpBiasAWeightOfOtherDtype", // biasesAgree
     false,
     {{"%w1, %b1, %l", "%w1, %none, %l"}},
     [](Constants& c) {
       c.erase("b1");
       c["w1"] = c["w1"].toTensor().to(at::kDouble);
     }},
    {"SkipsWithoutOpBiasANonConstantWeight", // biasesAgree
     false,
     {{"%w1, %b1, %l", "%w1, %none, %l"}},
     [](Constants& c) {
       c.erase("b1");
       c.erase("w1");
     }},
    {"SkipsAConv1dIntoAConv2dChain", // residualConvsShareChannelDim
     false,
     {{kConv, kConv1d}},
     [](Constants& c) {
       c["w2"] = at::randn({4, 3, 1});
     }},
    {"SkipsAnOpWeightOfUnknownRank", // residualConvsShareChannelDim
     false,
     {},
     [](Constants& c) { c.erase("w1"); }},
};

class FoldResidualConvBiasCase : public ::testing::TestWithParam<Case> {};

TEST_P(FoldResidualConvBiasCase, Rewrite) {
  const auto ir = edit(block(), GetParam().edits);
  auto params = parameters();
  GetParam().params(params);
  if (GetParam().folds) {
    expectFolded(ir, params);
  } else {
    expectUnchanged(ir, params);
  }
}

INSTANTIATE_TEST_SUITE_P(
    FoldResidualConvBias,
    FoldResidualConvBiasCase,
    ::testing::ValuesIn(kCases),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// NB: the conv1d case runs: conv1d's channels land on dim 2 of the sum, so
// folding its bias into the conv2d's (dim 1) would change the values.
TEST(FoldResidualConvBias, TheSkippedConv1dCaseWouldChangeTheValues) {
  const auto ir = edit(block(), {{kConv, kConv1d}});
  auto params = parameters();
  params["w2"] = at::randn({4, 3, 1});
  auto graph = frozen(ir, params);
  // The fold done by hand, as a pass without residualConvsShareChannelDim would.
  auto forced = graph->copy();
  for (auto* n : forced->nodes()) {
    if (n->kind() == c10::Symbol::fromQualString("aten::conv1d")) {
      torch::jit::WithInsertPoint guard(n);
      n->replaceInput(2, forced->insertConstant(c10::IValue()));
    }
  }
  for (auto* n : forced->nodes()) {
    if (n->kind() == c10::Symbol::fromQualString("torchfuse::custom_conv_add_act") &&
        n->input(7)->node()->kind() != c10::prim::Constant) {
      torch::jit::WithInsertPoint guard(n);
      n->replaceInput(
          2,
          forced->insertConstant(
              params["b1"].toTensor() + params["alpha"].toDouble() * params["b2"].toTensor()));
    }
  }
  torch::manual_seed(1);
  const std::vector<at::IValue> in = {at::randn({2, 3, 4, 5})};
  const auto expected = runGraph(graph, in)[0].toTensor();
  EXPECT_FALSE(at::allclose(runGraph(forced, in)[0].toTensor(), expected, 1e-4, 1e-4));
  EXPECT_EQ(FoldResidualConvBias(graph), 0);
  expectClose(runGraph(graph, in)[0].toTensor(), expected);
}

TEST(FoldResidualConvBias, FoldsInsideABranch) {
  const std::string ir = R"IR(
graph(%x : Tensor, %w0 : Tensor, %b0 : Tensor, %w1 : Tensor, %b1 : Tensor, %w2 : Tensor, %b2 : Tensor, %alpha : float, %c : bool):
  %one : int = prim::Constant[value=1]()
  %zero : int = prim::Constant[value=0]()
  %none : NoneType = prim::Constant()
  %promote : bool = prim::Constant[value=1]()
  %relu : str = prim::Constant[value="relu"]()
  %args : float[] = prim::ListConstruct()
  %l : int[] = prim::ListConstruct(%one, %one)
  %p : int[] = prim::ListConstruct(%zero, %zero)
  %y : Tensor = torchfuse::custom_conv_add_act(%x, %w0, %b0, %l, %p, %l, %one, %none, %one, %promote, %relu, %args)
  %o : Tensor = aten::conv2d(%x, %w2, %b2, %l, %p, %l, %one)
  %r : Tensor = prim::If(%c)
    block0():
      %out : Tensor = torchfuse::custom_conv_add_act(%y, %w1, %b1, %l, %p, %l, %one, %o, %alpha, %promote, %relu, %args)
      -> (%out)
    block1():
      -> (%x)
  return (%r))IR";
  auto graph = frozen(ir, parameters());
  auto original = graph->copy();
  ASSERT_EQ(FoldResidualConvBias(graph), 1);
  graph->lint();
  for (auto* n : graph->nodes()) {
    if (n->kind() == c10::Symbol::fromQualString("aten::conv2d")) {
      EXPECT_TRUE(n->input(2)->mustBeNone());
    }
  }
  torch::manual_seed(1);
  for (const bool c : {true, false}) {
    const std::vector<at::IValue> in = {at::randn({2, 3, 5, 5}), c};
    expectClose(runGraph(graph, in)[0].toTensor(), runGraph(original, in)[0].toTensor());
  }
}

} // namespace
} // namespace torchfuse::passes
