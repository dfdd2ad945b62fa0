#include "passes/match_filters.h"
#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using testing::expectUnchanged;
using testing::parse;
using torch::jit::testing::FileCheck;

int64_t run(std::shared_ptr<torch::jit::Graph>& g) {
  return ReplaceRelu(g);
}

TEST(ReplaceRelu, ReplacesRelu) {
  auto graph = parse(R"IR(
graph(%x : Tensor):
  %o : Tensor = aten::relu(%x)
  return (%o))IR");
  EXPECT_EQ(ReplaceRelu(graph), 1);
  graph->lint();
  FileCheck().check("torchfuse::custom_relu(%x)")->check_not("aten::relu")->run(*graph);
}

// ---- isOutOfPlaceSpelling ----

TEST(ReplaceRelu, LeavesInPlaceReluOnFreshTensor) {
  expectUnchanged(
      R"IR(
graph(%x : Tensor, %w : Tensor):
  %none : NoneType = prim::Constant()
  %y : Tensor = aten::linear(%x, %w, %none)
  %o : Tensor = aten::relu_(%y)
  return (%o))IR",
      run);
}

TEST(ReplaceRelu, LeavesAReluCanonicalizeMadeFromInPlace) {
  auto graph = parse(R"IR(
graph(%x : Tensor, %w : Tensor):
  %none : NoneType = prim::Constant()
  %y : Tensor = aten::linear(%x, %w, %none)
  %o : Tensor = aten::relu(%y)
  return (%o))IR");
  graph->return_node()->input(0)->node()->i_(fromInPlaceAttr(), 1);
  EXPECT_EQ(ReplaceRelu(graph), 0);
  FileCheck().check("aten::relu")->check_not("custom_relu")->run(*graph);
}

TEST(ReplaceRelu, RecursesIntoIfAndLoopBodies) {
  auto graph = parse(R"IR(
graph(%c : bool, %n : int, %x : Tensor):
  %true : bool = prim::Constant[value=1]()
  %out : Tensor = prim::If(%c)
    block0():
      %o : Tensor = aten::relu(%x)
      -> (%o)
    block1():
      %lo : Tensor = prim::Loop(%n, %true, %x)
        block0(%i : int, %h : Tensor):
          %o2 : Tensor = aten::relu(%h)
          -> (%true, %o2)
      -> (%lo)
  return (%out))IR");
  EXPECT_EQ(ReplaceRelu(graph), 2);
  graph->lint();
  FileCheck().check("prim::If")->check("torchfuse::custom_relu")->check("prim::Loop")
      ->check("torchfuse::custom_relu")->check_not("aten::relu")->run(*graph);
}

TEST(ReplaceRelu, LeavesInPlaceReluOnGraphInput) {
  expectUnchanged(R"IR(
graph(%x : Tensor):
  %o : Tensor = aten::relu_(%x)
  return (%o))IR", run);
}

TEST(ReplaceRelu, LeavesInPlaceReluOnTensorReadAgain) {
  expectUnchanged(R"IR(
graph(%x : Tensor, %w : Tensor):
  %none : NoneType = prim::Constant()
  %y : Tensor = aten::linear(%x, %w, %none)
  %o : Tensor = aten::relu_(%y)
  return (%o, %y))IR", run);
}

TEST(ReplaceRelu, LeavesInPlaceReluOnView) {
  expectUnchanged(R"IR(
graph(%x : Tensor, %w : Tensor):
  %none : NoneType = prim::Constant()
  %y : Tensor = aten::linear(%x, %w, %none)
  %v : Tensor = aten::t(%y)
  %o : Tensor = aten::relu_(%v)
  return (%o, %y))IR", run);
}

} // namespace
} // namespace torchfuse::passes
