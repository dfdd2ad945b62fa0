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
  return FuseLinearAddRelu(g);
}

void expectFused(const std::string& ir, const std::string& check = "") {
  auto graph = parse(ir);
  EXPECT_EQ(FuseLinearAddRelu(graph), 1);
  graph->lint();
  FileCheck fc;
  if (!check.empty()) {
    fc.check(check);
  }
  fc.check("torchfuse::custom_linear_add_relu")->check_not("aten::linear")
      ->check_not("aten::relu")->check_not("aten::add")->run(*graph);
}

constexpr const char* kBasic = R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add(%y, %r, %one)
  %o : Tensor = aten::relu(%s)
  return (%o))IR";

TEST(FuseLinearAddRelu, FusesOutOfPlaceAdd) {
  expectFused(kBasic);
}

TEST(FuseLinearAddRelu, MatchesTheUnfusedGraphNumerically) {
  auto graph = parse(kBasic);
  auto fused = graph->copy();
  ASSERT_EQ(FuseLinearAddRelu(fused), 1);
  torch::manual_seed(0);
  for (auto dtype : {at::kFloat, at::kDouble}) {
    auto o = at::TensorOptions().dtype(dtype);
    std::vector<at::IValue> in = {
        at::randn({5, 4}, o), at::randn({3, 4}, o), at::randn({3}, o),
        at::randn({5, 3}, o)};
    expectClose(runGraph(fused, in)[0].toTensor(), runGraph(graph, in)[0].toTensor());
  }
}

TEST(FuseLinearAddRelu, FusesWithoutBias) {
  expectFused(R"IR(
graph(%x : Tensor, %w : Tensor, %r : Tensor):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %none)
  %s : Tensor = aten::add(%y, %r, %one)
  %o : Tensor = aten::relu(%s)
  return (%o))IR");
}

TEST(FuseLinearAddRelu, FusesLinearAsSecondOperandWhenAlphaIsOne) {
  expectFused(R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add(%r, %y, %one)
  %o : Tensor = aten::relu(%s)
  return (%o))IR");
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

TEST(FuseLinearAddRelu, FusesInPlaceReluOnAFreshIntermediate) {
  expectFused(R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add(%y, %r, %one)
  %o : Tensor = aten::relu_(%s)
  return (%o))IR");
}

// addPromotes: add_ keeps the linear output's dtype, the op promotes.
TEST(FuseLinearAddRelu, LeavesInPlaceAddOnAFreshIntermediate) {
  expectUnchanged(R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add_(%y, %r, %one)
  %o : Tensor = aten::relu(%s)
  return (%o))IR", run);
}

TEST(FuseLinearAddRelu, RecursesIntoIfBlocks) {
  auto graph = parse(R"IR(
graph(%c : bool, %x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %out : Tensor = prim::If(%c)
    block0():
      %y : Tensor = aten::linear(%x, %w, %b)
      %s : Tensor = aten::add(%y, %r, %one)
      %o : Tensor = aten::relu(%s)
      -> (%o)
    block1():
      -> (%x)
  return (%out))IR");
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

// ---- one negative test per filter ----

TEST(FuseLinearAddRelu, SkipsScalarAdd) {  // isTensorAdd
  expectUnchanged(R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor):
  %one : int = prim::Constant[value=1]()
  %f : float = prim::Constant[value=1.5]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add(%y, %f, %one)
  %o : Tensor = aten::relu(%s)
  return (%o))IR", run);
}

TEST(FuseLinearAddRelu, SkipsReturnedLinearOutput) {  // hasSingleUse
  expectUnchanged(R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add(%y, %r, %one)
  %o : Tensor = aten::relu(%s)
  return (%o, %y))IR", run);
}

TEST(FuseLinearAddRelu, SkipsSumWithAnotherUse) {  // hasSingleUse
  expectUnchanged(R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add(%y, %r, %one)
  %o : Tensor = aten::relu(%s)
  %t : Tensor = aten::mul(%s, %o)
  return (%t))IR", run);
}

TEST(FuseLinearAddRelu, SkipsWhenAlphaScalesTheLinearOutput) {  // alphaIsOne
  expectUnchanged(R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %two : int = prim::Constant[value=2]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add(%r, %y, %two)
  %o : Tensor = aten::relu(%s)
  return (%o))IR", run);
}

TEST(FuseLinearAddRelu, LeavesInPlaceAddOnLiveTensor) {  // notInPlaceOnLiveTensor
  expectUnchanged(R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add_(%r, %y, %one)
  %o : Tensor = aten::relu(%s)
  return (%o))IR", run);
}

TEST(FuseLinearAddRelu, LeavesInPlaceReluOnLiveSum) {  // notInPlaceOnLiveTensor
  expectUnchanged(R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %s : Tensor = aten::add(%y, %r, %one)
  %o : Tensor = aten::relu_(%s)
  return (%o, %s))IR", run);
}

TEST(FuseLinearAddRelu, SkipsChainsSpanningBlocks) {  // inSameBlock
  expectUnchanged(R"IR(
graph(%c : bool, %x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %out : Tensor = prim::If(%c)
    block0():
      %s : Tensor = aten::add(%y, %r, %one)
      %o : Tensor = aten::relu(%s)
      -> (%o)
    block1():
      -> (%x)
  return (%out))IR", run);
}

TEST(FuseLinearAddRelu, SkipsWhenAnInputIsWrittenInBetween) {  // noInterveningWrites
  expectUnchanged(R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %b)
  %z : Tensor = aten::add_(%r, %one, %one)
  %s : Tensor = aten::add(%y, %r, %one)
  %o : Tensor = aten::relu(%s)
  return (%o))IR", run);
}

TEST(FuseLinearAddRelu, SkipsUnresolvedOps) {  // isLinear (schema check)
  expectUnchanged(R"IR(
graph(%x : Tensor, %w : Tensor, %r : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::matmul(%x, %w)
  %s : Tensor = aten::add(%y, %r, %one)
  %o : Tensor = aten::relu(%s)
  return (%o))IR", run);
}

} // namespace
} // namespace torchfuse::passes
