#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/optimize.h"
#include "torchfuse/passes.h"

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/frontend/resolver.h>

namespace torchfuse {
namespace {

using torch::jit::testing::FileCheck;

torch::jit::Module linearModule() {
  torch::jit::Module m("m");
  m.register_attribute("training", c10::BoolType::get(), true);
  m.register_parameter("w", torch::randn({3, 4}), false);
  m.register_parameter("b", torch::randn({3}), false);
  m.define(R"JIT(
    def forward(self, x, r):
        y = torch.linear(x, self.w, self.b) + r
        return torch.relu(y), torch.relu(r)
  )JIT");
  return m;
}

TEST(Optimize, ReturnsANewModuleAndLeavesTheInputUnchanged) {
  auto m = linearModule();
  const auto before = m.get_method("forward").graph()->toString();
  FusionReport report;
  auto out = optimize(m, {}, &report);
  EXPECT_EQ(report.linear_add_relu, 1);
  EXPECT_EQ(report.relu, 1);
  EXPECT_EQ(m.get_method("forward").graph()->toString(), before);
  FileCheck().check("torchfuse::custom_linear_add_relu")->check("torchfuse::custom_relu")
      ->run(*out.get_method("forward").graph());
  auto counted = torchfuse::report(out);
  EXPECT_EQ(counted.linear_add_relu, 1);
  EXPECT_EQ(counted.relu, 1);
  EXPECT_EQ(torchfuse::report(m).linear_add_relu, 0);

  auto x = torch::randn({2, 4}), r = torch::randn({2, 3});
  auto want = m.forward({x, r}).toTuple();
  auto got = out.forward({x, r}).toTuple();
  for (size_t i = 0; i < 2; ++i) {
    passes::testing::expectClose(got->elements()[i].toTensor(), want->elements()[i].toTensor());
  }
}

TEST(Optimize, FreezesInEvalMode) {
  auto m = linearModule();
  m.eval();
  auto out = optimize(m, OptimizeOptions{true, {}});
  FileCheck().check("torchfuse::custom_linear_add_relu")->check_not("prim::GetAttr")
      ->run(*out.get_method("forward").graph());
}

TEST(Optimize, RunsOnlyTheSelectedPasses) {
  auto out = optimize(linearModule(), OptimizeOptions{false, {"relu"}});
  FileCheck().check_not("custom_linear_add_relu")->check("torchfuse::custom_relu")
      ->run(*out.get_method("forward").graph());
}

TEST(Optimize, RejectsUnknownPassesAndFreezingInTraining) {
  EXPECT_THROW(optimize(linearModule(), OptimizeOptions{false, {"nope"}}), c10::Error);
  auto m = linearModule();
  m.train();
  EXPECT_THROW(optimize(m, OptimizeOptions{true, {}}), c10::Error);
}

TEST(Canonicalize, FunctionalizesInPlaceOpsOnFreshTensorsOnly) {
  auto graph = passes::testing::parse(R"IR(
graph(%x : Tensor, %w : Tensor, %r : Tensor):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %none)
  %s : Tensor = aten::add_(%y, %r, %one)
  %q : Tensor = aten::add_(%r, %one, %one)
  %o : Tensor = aten::relu_(%s)
  return (%o, %q))IR");
  passes::Canonicalize(graph);
  graph->lint();
  FileCheck().check("aten::add(")->check("aten::relu(")->check_not("aten::relu_")->run(*graph);
  FileCheck().check("aten::add_(%r")->run(*graph);
}

} // namespace
} // namespace torchfuse
