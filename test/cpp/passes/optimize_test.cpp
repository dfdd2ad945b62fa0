#include "test/cpp/passes/pass_test_utils.h"
#include "test/cpp/util/op_test_utils.h"
#include "torchfuse/optimize.h"
#include "torchfuse/passes.h"
#include "torchfuse/registry.h"

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/serialization/import.h>

#include <sstream>

namespace torchfuse {
namespace {

using torch::jit::testing::FileCheck;

// A module in training mode with `children` as submodules and the methods
// that `source` defines.
torch::jit::Module scriptModule(
    const std::string& name,
    const std::vector<std::pair<std::string, torch::jit::Module>>& children,
    const std::string& source) {
  torch::jit::Module m(name);
  m.register_attribute("training", c10::BoolType::get(), true);
  for (const auto& [child_name, child] : children) {
    m.register_module(child_name, child);
  }
  m.define(source);
  return m;
}

// x * 2.0: a producer that only inlining shows to return a fresh tensor.
torch::jit::Module timesTwo() {
  return scriptModule("sub", {}, R"JIT(
    def forward(self, x):
        return x * 2.0
  )JIT");
}

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
  auto out = optimize(m, OptimizeOptions{false, {"linear_add_relu", "relu"}}, &report);
  EXPECT_EQ(report.fused.at("linear_add_relu"), 1);
  EXPECT_EQ(report.fused.at("relu"), 1);
  EXPECT_EQ(report.fused.at("conv_relu_add"), 0);
  EXPECT_EQ(report.fused.size(), torchfuse::fusions().size());
  EXPECT_EQ(m.get_method("forward").graph()->toString(), before);
  FileCheck().check("torchfuse::custom_linear_add_relu")->check("torchfuse::custom_relu")
      ->run(*out.get_method("forward").graph());
  auto counted = torchfuse::report(out);
  EXPECT_EQ(counted.at("linear_add_relu"), 1);
  EXPECT_EQ(counted.at("relu"), 1);
  EXPECT_EQ(torchfuse::report(m).at("linear_add_relu"), 0);

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

// ReplaceRelu removes no memory traffic (Fusion::by_default): it runs only
// when named.
TEST(Optimize, RunsOnlyTheFusionsOnByDefaultWhenNoneAreNamed) {
  FusionReport report;
  auto out = optimize(linearModule(), {}, &report);
  EXPECT_EQ(report.fused.at("linear_add_relu"), 1);
  EXPECT_EQ(report.fused.at("relu"), 0);
  FileCheck().check("torchfuse::custom_linear_add_relu")->check_not("torchfuse::custom_relu(")
      ->check("aten::relu(")->run(*out.get_method("forward").graph());
  for (const auto& f : torchfuse::fusions()) {
    EXPECT_EQ(f.by_default, f.name != "relu") << f.name;
  }
}

// With nothing fused, an unfrozen result is a new object of the input's
// class types: it runs the input's methods and executors, with attribute
// slots of its own.
TEST(Optimize, LeavesTheMethodsAsTheyAreWhenNothingFuses) {
  auto m = scriptModule("outer", {{"inner", linearModule()}}, R"JIT(
    def forward(self, x, r):
        return self.inner.forward(x, r)
  )JIT");
  FusionReport report;
  auto out = optimize(m, OptimizeOptions{false, {"conv_relu_add"}}, &report);
  EXPECT_EQ(report.fused.at("conv_relu_add"), 0);
  const auto kinds = [](const torch::jit::Module& module) {
    std::vector<c10::Symbol> k;
    for (auto* n : module.get_method("forward").graph()->nodes()) {
      k.push_back(n->kind());
    }
    return k;
  };
  EXPECT_EQ(kinds(out), kinds(m));  // nothing inlined, folded or rewritten
  FileCheck().check("prim::CallMethod")->check_not("aten::linear")
      ->run(*out.get_method("forward").graph());
  EXPECT_EQ(out.type(), m.type());
  EXPECT_EQ(&out.get_method("forward").function(), &m.get_method("forward").function());
  EXPECT_NE(out._ivalue(), m._ivalue());
  out.attr("inner").toModule().train(false);
  EXPECT_TRUE(m.attr("inner").toModule().is_training());
  EXPECT_TRUE(out.attr("inner").toModule().attr("w").toTensor().is_same(
      m.attr("inner").toModule().attr("w").toTensor()));
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

// v1 comes from a submodule, so only inlining shows it is a fresh tensor.
// The second iteration's add_ writes v2 (fuzzer seed 4, program 1565).
torch::jit::Module loopCarriedWriteModule() {
  return scriptModule("m", {{"sub", timesTwo()}}, R"JIT(
    def forward(self, x, b, n: int):
        v1 = self.sub.forward(x)
        v2 = torch.relu(v1)
        before = v2 * 3.0
        for _ in range(n):
            v1.add_(b)
            v1 = v2
        after = v2 * 3.0
        return before, after
  )JIT");
}

TEST(Optimize, KeepsWritesToLoopCarriedTensors) {
  auto x = torch::randn({2, 3}, torch::kDouble), b = torch::randn({2, 3}, torch::kDouble);
  const auto before = torch::relu(x * 2.0) * 3.0;
  const auto after = (torch::relu(x * 2.0) + b) * 3.0;
  for (const bool freeze : {false, true}) {
    auto m = loopCarriedWriteModule();
    if (freeze) {
      m.eval();
    }
    // NB: with a fusion applied: with none, an unfrozen result runs the
    // input's own methods.
    auto out = optimize(m, OptimizeOptions{freeze, {"relu"}});
    auto graph = out.get_method("forward").graph();
    // The write stays, CSE (freeze_module runs it) keeps the reads of v2
    // before and after the loop apart, and the guards are gone.
    FileCheck().check("aten::add_")->run(*graph);
    FileCheck().check_count("aten::mul(", 3, /*exactly=*/true)->run(*graph);
    FileCheck().check_not("prim::Print")->run(*graph);
    // The optimizing executor would drop the write itself (TorchScript
    // behaviour, independent of torchfuse): run the plain interpreter.
    torch::jit::GraphOptimizerEnabledGuard plain(false);
    auto got = out.forward({x.clone(), b, 2}).toTuple();
    passes::testing::expectClose(got->elements()[0].toTensor(), before);
    passes::testing::expectClose(got->elements()[1].toTensor(), after);
  }
}

// The loop sits in a submodule's method: Inline inserts that method's
// optimized graph, whose own DCE runs once count(2) is folded.
TEST(Optimize, KeepsWritesToLoopCarriedTensorsInSubmodules) {
  auto mid = scriptModule("mid", {{"sub", timesTwo()}}, R"JIT(
    def count(self, n: int) -> int:
        if n > 1:
            return n
        return 1

    def forward(self, x, b):
        v1 = self.sub.forward(x)
        v2 = torch.relu(v1)
        for _ in range(self.count(2)):
            v1.add_(b)
            v1 = v2
        return v1 * 3.0
  )JIT");
  auto m = scriptModule("m", {{"mid", mid}}, R"JIT(
    def forward(self, x, b):
        return self.mid.forward(x, b)
  )JIT");
  auto out = optimize(m, OptimizeOptions{false, {"relu"}});
  FileCheck().check("aten::add_")->run(*out.get_method("forward").graph());
  FileCheck().check_not("prim::Print")->run(
      *out.attr("mid").toModule().get_method("forward").graph());
  auto x = torch::randn({2, 3}, torch::kDouble), b = torch::randn({2, 3}, torch::kDouble);
  torch::jit::GraphOptimizerEnabledGuard plain(false);
  passes::testing::expectClose(
      out.forward({x, b}).toTensor(), (torch::relu(x * 2.0) + b) * 3.0);
}

// Loading compiles the saved code again, and its DCE drops the write once
// the inlined forward shows v1 fresh: the guard stays in a persistent form.
TEST(Optimize, KeepsWritesToLoopCarriedTensorsThroughSaveAndLoad) {
  auto x = torch::randn({2, 3}, torch::kDouble), b = torch::randn({2, 3}, torch::kDouble);
  std::stringstream saved;
  optimize(loopCarriedWriteModule(), OptimizeOptions{false, {"relu"}}).save(saved);
  auto loaded = torch::jit::load(saved);
  auto graph = loaded.get_method("forward").graph();
  FileCheck().check("aten::add_")->check("prim::ListConstruct")->check("aten::__getitem__")
      ->run(*graph);
  FileCheck().check_not("prim::Print")->run(*graph);
  torch::jit::GraphOptimizerEnabledGuard plain(false);
  auto got = loaded.forward({x, b, 2}).toTuple();
  passes::testing::expectClose(got->elements()[1].toTensor(), (torch::relu(x * 2.0) + b) * 3.0);
}

// a and b (two class types) share the weight w and the buffer count, which
// their forwards write.
torch::jit::Module tiedModule(const at::Tensor& w, const at::Tensor& count) {
  torch::jit::Module m("m");
  m.register_attribute("training", c10::BoolType::get(), true);
  for (const char* name : {"a", "b"}) {
    torch::jit::Module sub(name);
    sub.register_attribute("training", c10::BoolType::get(), true);
    sub.register_parameter("w", w, false);
    sub.register_buffer("count", count);
    sub.define(R"JIT(
      def forward(self, x):
          self.count.add_(1.0)
          return torch.relu(torch.linear(x, self.w) + x)
    )JIT");
    m.register_module(name, sub);
  }
  m.define(R"JIT(
    def forward(self, x):
        return self.b.forward(self.a.forward(x)) + self.a.count
  )JIT");
  return m;
}

TEST(Optimize, SharesParametersAndBuffersWithTheInput) {
  for (const bool freeze : {false, true}) {
    const auto w = torch::randn({4, 4}, torch::kDouble).requires_grad_();
    const auto count = torch::zeros({4}, torch::kDouble);
    auto m = tiedModule(w, count);
    if (freeze) {
      m.eval();
    }
    const auto before = m.get_method("forward").graph()->toString();
    FusionReport report;
    auto out = optimize(m, OptimizeOptions{freeze, {}}, &report);
    EXPECT_EQ(report.fused.at("linear_add_relu"), 2);
    EXPECT_EQ(m.get_method("forward").graph()->toString(), before);
    EXPECT_TRUE(out.attr("a").toModule().attr("count").toTensor().is_same(count));
    if (freeze) {
      // The fused ops read constants that are w's storage, not copies.
      int fused = 0;
      for (auto* n : out.get_method("forward").graph()->nodes()) {
        if (n->kind() == c10::Symbol::fromQualString("torchfuse::custom_linear_add_relu")) {
          const auto weight = torch::jit::toIValue(n->input(1));
          ASSERT_TRUE(weight.has_value() && weight->isTensor());
          EXPECT_EQ(weight->toTensor().data_ptr(), w.data_ptr());
          ++fused;
        }
      }
      EXPECT_EQ(fused, 2);
    } else {
      for (const char* name : {"a", "b"}) {
        const auto sub = out.attr(name).toModule();
        EXPECT_TRUE(sub.attr("w").toTensor().is_same(w)) << name;
        EXPECT_TRUE(sub.attr("count").toTensor().is_same(count)) << name;
      }
      EXPECT_EQ(out.parameters().size(), 2);  // one tensor, registered twice
    }
    const auto x = torch::randn({2, 4}, torch::kDouble);
    torch::NoGradGuard no_grad;
    const auto h = torch::relu(torch::linear(x, w) + x);
    const auto want = torch::relu(torch::linear(h, w) + h) + 2.0;
    passes::testing::expectClose(out.forward({x}).toTensor(), want);
    // Both forwards wrote the input's buffer.
    passes::testing::expectClose(count, torch::full({4}, 2.0, torch::kDouble));
  }
}

// Module::clone() put the result's types and methods into the input's
// compilation unit (Python's global one for scripted modules), where they
// stayed after the result was gone, a frozen forward with its constants.
TEST(Optimize, ResultTypesLiveAndDieWithTheResult) {
  for (const bool freeze : {false, true}) {
    auto m = linearModule();
    if (freeze) {
      m.eval();
    }
    std::weak_ptr<torch::jit::CompilationUnit> unit;
    {
      auto out = optimize(m, OptimizeOptions{freeze, {}});
      unit = out._ivalue()->compilation_unit();
      EXPECT_NE(unit.lock(), m._ivalue()->compilation_unit());
    }
    EXPECT_TRUE(unit.expired()) << "freeze=" << freeze;
  }
}

torch::jit::Module exportedModule() {
  auto m = linearModule();
  m.register_attribute("scale", c10::FloatType::get(), 2.0);
  m.define(R"JIT(
    def embed(self, x):
        return torch.relu(torch.linear(x, self.w, self.b)) * self.scale
  )JIT");
  m.eval();
  return m;
}

TEST(Optimize, PreservedAttrsSurviveFreezing) {
  auto m = exportedModule();
  auto plain = optimize(m, OptimizeOptions{true, {}});
  EXPECT_FALSE(plain.find_method("embed").has_value());
  EXPECT_FALSE(plain.hasattr("scale"));
  auto out = optimize(m, OptimizeOptions{true, {}, {"embed", "scale"}});
  ASSERT_TRUE(out.find_method("embed").has_value());
  ASSERT_TRUE(out.hasattr("scale"));
  const auto x = torch::randn({2, 4});
  passes::testing::expectClose(
      out.get_method("embed")({x}).toTensor(), m.get_method("embed")({x}).toTensor());
  out.setattr("scale", -3.0);
  m.setattr("scale", -3.0);
  passes::testing::expectClose(
      out.get_method("embed")({x}).toTensor(), m.get_method("embed")({x}).toTensor());
}

TEST(Optimize, PreservedAttrsMustExist) {
  for (const bool freeze : {false, true}) {
    test::expectThrowsWith(
        [&] { optimize(exportedModule(), OptimizeOptions{freeze, {}, {"embed", "nope"}}); },
        "preserved_attrs names 'nope', but the module has no attribute or method 'nope'");
  }
  auto m = linearModule();
  m.register_module("sub", linearModule());
  m.eval();
  test::expectThrowsWith(
      [&] { optimize(m, OptimizeOptions{true, {}, {"sub.nope"}}); },
      "preserved_attrs names 'sub.nope', but submodule 'sub' has no attribute or method 'nope'");
  test::expectThrowsWith(
      [&] { optimize(m, OptimizeOptions{true, {}, {"w.x"}}); },
      "preserved_attrs names 'w.x', but the module has no submodule 'w'");
  auto out = optimize(m, OptimizeOptions{true, {}, {"sub.w"}});
  EXPECT_TRUE(out.attr("sub").toModule().attr("w").toTensor().is_same(
      m.attr("sub").toModule().attr("w").toTensor()));
}

// A frozen module has no training attribute, for which is_training() says
// true: "freeze=True needs a module in eval mode".
TEST(Optimize, FreezesAFrozenResultAgain) {
  auto m = linearModule();
  m.eval();
  auto once = optimize(m, OptimizeOptions{true, {}});
  ASSERT_FALSE(once.hasattr("training"));
  FusionReport report;
  auto twice = optimize(once, OptimizeOptions{true, {}}, &report);
  EXPECT_EQ(torchfuse::report(twice).at("linear_add_relu"), 1);
  const auto x = torch::randn({2, 4}), r = torch::randn({2, 3});
  const auto want = m.forward({x, r}).toTuple();
  const auto got = twice.forward({x, r}).toTuple();
  for (size_t i = 0; i < 2; ++i) {
    passes::testing::expectClose(got->elements()[i].toTensor(), want->elements()[i].toTensor());
  }
}

// add_ stays in place: it keeps self's dtype where add promotes.
TEST(Canonicalize, FunctionalizesInPlaceReluOnFreshTensorsOnly) {
  auto graph = passes::testing::parse(R"IR(
graph(%x : Tensor, %w : Tensor, %r : Tensor):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %y : Tensor = aten::linear(%x, %w, %none)
  %s : Tensor = aten::add_(%y, %r, %one)
  %t : Tensor = aten::mul(%s, %r)
  %o : Tensor = aten::relu_(%t)
  %q : Tensor = aten::relu_(%r)
  return (%o, %q))IR");
  passes::Canonicalize(graph);
  graph->lint();
  FileCheck().check("aten::add_(")->check("aten::relu[")->check("aten::relu_(%r")->run(*graph);
  FileCheck().check_not("aten::add(")->run(*graph);
}

// The relus Canonicalize made and no fusion took go back in place; relus
// that were functional in the original stay functional.
TEST(RestoreInPlace, UndoesCanonicalizeForUnfusedRelus) {
  auto graph = passes::testing::parse(R"IR(
graph(%x : Tensor, %w : Tensor):
  %none : NoneType = prim::Constant()
  %y : Tensor = aten::linear(%x, %w, %none)
  %t : Tensor = aten::relu_(%y)
  %z : Tensor = aten::mul(%y, %x)
  %u : Tensor = aten::relu(%z)
  return (%t, %y, %u))IR");
  passes::Canonicalize(graph);
  FileCheck().check_not("aten::relu_")->run(*graph);
  EXPECT_EQ(passes::RestoreInPlace(graph), 1);
  graph->lint();
  // the relu_ writes the linear's output; the original relu reads the mul's
  FileCheck().check("aten::linear(")->check_count("aten::relu_(", 1, /*exactly=*/true)
      ->check("aten::mul(")->check("aten::relu(")->run(*graph);
  FileCheck().check_count("aten::relu(", 1, /*exactly=*/true)
      ->check_not("torchfuse_from_inplace")->run(*graph);
}

// A relu whose input is read after it (here by a node placed later) stays
// functional: relu_ there would change what that reader sees.
TEST(RestoreInPlace, KeepsAReluWhoseInputIsReadLaterFunctional) {
  auto graph = passes::testing::parse(R"IR(
graph(%x : Tensor):
  %y : Tensor = aten::neg(%x)
  %t : Tensor = aten::relu[torchfuse_from_inplace=1](%y)
  %z : Tensor = aten::mul(%y, %t)
  return (%z))IR");
  EXPECT_EQ(passes::RestoreInPlace(graph), 0);
  FileCheck().check("aten::neg(")->check("aten::relu(")->check_not("aten::relu_(")
      ->check_not("torchfuse_from_inplace")->run(*graph);
}

} // namespace
} // namespace torchfuse
