#include "passes/frozen_optimizations.h"
#include "test/cpp/passes/pass_test_utils.h"

#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/testing/file_check.h>

namespace torchfuse::passes {
namespace {

// NB: tensor constants parsed as uninitialised tensors of their types'
// sizes: what the folding reads is their shapes.
std::shared_ptr<torch::jit::Graph> parse(const std::string& ir) {
  auto graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(ir, graph.get(), /*parse_tensor_constants=*/true);
  return graph;
}

// conv -> batch_norm in a graph whose parameters are constants, as
// freeze_module leaves them; `training` and the branch are spliced in.
std::string convBatchNorm(const std::string& training) {
  return R"IR(
graph(%x : Tensor, %c : bool):
  %w : Float(4, 4, 1, 1, strides=[4, 1, 1, 1], requires_grad=0, device=cpu) = prim::Constant[value=<Tensor>]()
  %v : Float(4, strides=[1], requires_grad=0, device=cpu) = prim::Constant[value=<Tensor>]()
  %none : NoneType = prim::Constant()
  %one : int[] = prim::Constant[value=[1, 1]]()
  %zero : int[] = prim::Constant[value=[0, 0]]()
  %g : int = prim::Constant[value=1]()
  %m : float = prim::Constant[value=0.1]()
  %e : float = prim::Constant[value=1e-05]()
  %cudnn : bool = prim::Constant[value=1]()
  )IR" +
      training + R"IR(
  %o : Tensor = prim::If(%c)
    block0():
      %y : Tensor = aten::conv2d(%x, %w, %none, %one, %zero, %one, %g)
      %z : Tensor = aten::batch_norm(%y, %v, %v, %v, %v, %t, %m, %e, %cudnn)
      -> (%z)
    block1():
      -> (%x)
  return (%o))IR";
}

TEST(FrozenOptimizations, BatchNormsAreInferenceOnlyForConstantFalse) {
  EXPECT_TRUE(batchNormsAreInference(
      parse(convBatchNorm("%t : bool = prim::Constant[value=0]()"))->block()));
  // NB: nested in a branch, a constant True, and a runtime flag
  EXPECT_FALSE(batchNormsAreInference(
      parse(convBatchNorm("%t : bool = prim::Constant[value=1]()"))->block()));
  EXPECT_FALSE(
      batchNormsAreInference(parse(convBatchNorm("%t : bool = aten::__not__(%c)"))->block()));
}

TEST(FrozenOptimizations, LinearFoldingOnlyIntoA2dLinearReadByTheBatchNormAlone) {
  const std::string ir = R"IR(
graph(%x : Float(5, 4)):
  %w : Float(4, 4, strides=[4, 1], requires_grad=0, device=cpu) = prim::Constant[value=<Tensor>]()
  %v : Float(4, strides=[1], requires_grad=0, device=cpu) = prim::Constant[value=<Tensor>]()
  %m : float = prim::Constant[value=0.1]()
  %e : float = prim::Constant[value=1e-05]()
  %f : bool = prim::Constant[value=0]()
  %one : int = prim::Constant[value=1]()
  %h : HTYPE = aten::linear(%x, %w, %v)
  %d : int = aten::dim(%h)
  %z : Tensor = aten::batch_norm(%h, %v, %v, %v, %v, %f, %m, %e, %f)
  %o : Tensor = aten::add(%z, %USE, %d)
  return (%o))IR";
  auto with = [&](const std::string& h_type, const std::string& use) {
    auto s = ir;
    s.replace(s.find("HTYPE"), 5, h_type);
    s.replace(s.find("%USE"), 4, use);
    return parse(s);
  };
  EXPECT_TRUE(linearBatchNormFoldingKeepsMeaning(with("Float(5, 4)", "%x")->block()));
  // NB: the linear's values read by the add; a rank not known to be 2
  EXPECT_FALSE(linearBatchNormFoldingKeepsMeaning(with("Float(5, 4)", "%h")->block()));
  EXPECT_FALSE(linearBatchNormFoldingKeepsMeaning(with("Tensor", "%x")->block()));
  EXPECT_FALSE(linearBatchNormFoldingKeepsMeaning(with("Float(2, 5, 4)", "%x")->block()));
}

TEST(FrozenOptimizations, LinearsConcatenatedOnlyWhereNoSiblingOutputIsWrittenOrReturned) {
  const std::string ir = R"IR(
graph(%x : Float(5, 4), %y : Float(5, 4)):
  %w : Float(4, 4, strides=[4, 1], requires_grad=0, device=cpu) = prim::Constant[value=<Tensor>]()
  %v : Float(4, strides=[1], requires_grad=0, device=cpu) = prim::Constant[value=<Tensor>]()
  %a : Tensor = aten::linear(%x, %w, %v)
  %b : Tensor = aten::linear(%SECOND, %w, %v)
  %t : Tensor = aten::tanh(%a)
  %r : Tensor = aten::WRITE(%b)
  return (%t, %r))IR";
  auto with = [&](const std::string& second, const std::string& write) {
    auto s = ir;
    s.replace(s.find("%SECOND"), 7, second);
    s.replace(s.find("WRITE"), 5, write);
    return parse(s);
  };
  EXPECT_TRUE(linearConcatenationKeepsMeaning(with("%x", "relu")));
  // NB: the linears of one input, one output written in place: as slices
  // of one tensor the write would bump its sibling's version too, and a
  // backward that saved the sibling would raise
  EXPECT_FALSE(linearConcatenationKeepsMeaning(with("%x", "relu_")));
  // the written linear reads an input of its own: it is never joined
  EXPECT_TRUE(linearConcatenationKeepsMeaning(with("%y", "relu_")));
  // a linear output (or a view of it) returned: a slice would not be
  // contiguous
  EXPECT_FALSE(linearConcatenationKeepsMeaning(with("%x", "t")));
  EXPECT_TRUE(linearConcatenationKeepsMeaning(with("%y", "t")));
}

TEST(FrozenOptimizations, FoldsAnInferenceBatchNorm) {
  auto graph = parse(convBatchNorm("%t : bool = prim::Constant[value=0]()"));
  EXPECT_TRUE(optimizeFrozenGraph(graph));
  torch::jit::testing::FileCheck()
      .check("aten::conv2d")
      ->check_not("aten::batch_norm")
      ->run(*graph);
}

TEST(FrozenOptimizations, NothingRunsWhereABatchNormMayTrain) {
  auto graph = parse(convBatchNorm("%t : bool = aten::__not__(%c)"));
  const auto before = graph->toString();
  EXPECT_FALSE(optimizeFrozenGraph(graph));
  EXPECT_EQ(graph->toString(), before);
}

} // namespace
} // namespace torchfuse::passes
