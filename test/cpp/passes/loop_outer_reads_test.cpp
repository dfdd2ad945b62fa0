#include "passes/loop_outer_reads.h"
#include "test/cpp/passes/pass_test_utils.h"

#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include <functional>
#include <string>
#include <vector>

namespace torchfuse::passes {
namespace {

using testing::FileCheck;
using testing::parse;

// `x1 - relu(loop)`, the loop running %n times from %x0: `body` (statements
// on %h) then `-> (%true, yield)`.  NB: %true is returned too: a constant
// read last in the body gets a (empty) prim::Drop after the loop, which would
// keep the interpreter from emitting the loop inside sub's tree.
std::string reluOfLoop(const std::string& body, const std::string& yield) {
  return R"IR(
graph(%x0 : Tensor, %x1 : Tensor, %n : int):
  %true : bool = prim::Constant[value=1]()
  %one : int = prim::Constant[value=1]()
  %l : Tensor = prim::Loop(%n, %true, %x0)
    block0(%i : int, %h : Tensor):
)IR" + body +
      "      -> (%true, " + yield + R"IR()
  %r : Tensor = aten::relu(%l)
  %o : Tensor = aten::sub(%x1, %r, %one)
  return (%o, %true))IR";
}

struct Case {
  std::string name;
  std::string ir;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)> reference;
};

// The body as DCE left it in fuzz program 5471 (seed 20261124): it returns
// an outer value; and a body computing from one.
std::vector<Case> cases() {
  return {
      {"returns an outer value", reluOfLoop("", "%x1"),
       [](const at::Tensor& x0, const at::Tensor& x1, int64_t n) {
         return x1 - at::relu(n > 0 ? x1 : x0);
       }},
      {"computes from an outer value", reluOfLoop("      %m : Tensor = aten::mul(%h, %x1)\n", "%m"),
       [](const at::Tensor& x0, const at::Tensor& x1, int64_t n) {
         auto h = x0;
         for (int64_t i = 0; i < n; ++i) {
           h = h * x1;
         }
         return x1 - at::relu(h);
       }},
  };
}

// TorchScript's plain interpreter, as torch.jit.optimized_execution(False)
// runs a graph.
at::Tensor interpret(
    const std::shared_ptr<torch::jit::Graph>& graph,
    const at::Tensor& x0,
    const at::Tensor& x1,
    int64_t n) {
  torch::jit::Code code(graph, "f");
  torch::jit::InterpreterState state(code);
  torch::jit::Stack stack = {x0, x1, n};
  state.run(stack);
  return stack.at(0).toTensor();
}

std::vector<torch::jit::Node*> loops(const std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<torch::jit::Node*> found;
  std::function<void(torch::jit::Block*)> walk = [&](torch::jit::Block* b) {
    for (auto* n : b->nodes()) {
      if (n->kind() == c10::prim::Loop) {
        found.push_back(n);
      }
      for (auto* nested : n->blocks()) {
        walk(nested);
      }
    }
  };
  walk(graph->block());
  return found;
}

void expectMatchesReference(const Case& c, const std::shared_ptr<torch::jit::Graph>& graph) {
  const auto x0 = torch::randn({7}, torch::kDouble);
  const auto x1 = torch::randn({7}, torch::kDouble);
  for (int64_t n : {0, 1, 2, 3}) {
    EXPECT_TRUE(at::equal(interpret(graph, x0, x1, n), c.reference(x0, x1, n)))
        << c.name << ", " << n << " trips";
  }
}

TEST(LoopOuterReads, ThePlainInterpreterMovesAnOuterValueOutOfALoopInATree) {
  // NB: pins the libtorch behaviour the pass exists for: the interpreter
  // emits the loop inside sub's tree after loading %x1, the body's read of
  // %x1 is the last use it emits, so it moves %x1 out of its register, and
  // the second iteration reads None.
  const auto x0 = torch::randn({7}, torch::kDouble);
  const auto x1 = torch::randn({7}, torch::kDouble);
  for (const auto& c : cases()) {
    const auto graph = parse(c.ir);
    EXPECT_TRUE(loopMayMoveOuterValue(loops(graph).at(0))) << c.name;
    EXPECT_TRUE(at::equal(interpret(graph, x0, x1, 1), c.reference(x0, x1, 1))) << c.name;
    try {
      interpret(graph, x0, x1, 2);
      ADD_FAILURE() << c.name << ": the interpreter ran the loop twice";
    } catch (const std::exception& e) { // the interpreter rethrows as std::runtime_error
      // NB: a consumer with a Tensor schema says "Expected Tensor but got
      // None" (conv2d in the fuzz program), relu finds no tensor argument.
      const std::string what = e.what();
      EXPECT_TRUE(
          what.find("Expected Tensor but got None") != std::string::npos ||
          what.find("no tensor arguments") != std::string::npos)
          << c.name << ": " << what;
    }
  }
}

TEST(LoopOuterReads, CarriedOuterValuesLetThePlainInterpreterRunTheLoop) {
  for (const auto& c : cases()) {
    const auto graph = parse(c.ir);
    EXPECT_EQ(carryOuterValuesThroughLoops(graph), 1) << c.name;
    graph->lint();
    auto* loop = loops(graph).at(0);
    EXPECT_FALSE(loopMayMoveOuterValue(loop)) << c.name;
    // NB: %x1 enters the loop as a carried value, which the body returns
    // as [received][0]; the existing slot is untouched.
    ASSERT_EQ(loop->inputs().size(), 4u) << c.name;
    EXPECT_EQ(loop->input(3)->debugName(), "x1") << c.name;
    EXPECT_EQ(loop->outputs().size(), 2u) << c.name;
    FileCheck()
        .check("= prim::Loop(%n, ")
        ->check_same("%x0, %x1)")
        ->check("prim::ListConstruct")
        ->check("aten::__getitem__")
        ->check("aten::relu(")
        ->check("aten::sub(%x1,")
        ->run(*graph);
    expectMatchesReference(c, graph);
  }
}

TEST(LoopOuterReads, TheCarriedValuesSurviveConstantPropagationAndDeadCodeElimination) {
  // NB: both run again when a saved module is loaded; ConstantPropagation
  // drops a slot whose body returns its input unchanged.
  for (const auto& c : cases()) {
    auto graph = parse(c.ir);
    carryOuterValuesThroughLoops(graph);
    torch::jit::ConstantPropagation(graph);
    torch::jit::EliminateDeadCode(graph);
    auto* loop = loops(graph).at(0);
    EXPECT_EQ(loop->outputs().size(), 2u) << c.name;
    EXPECT_FALSE(loopMayMoveOuterValue(loop)) << c.name;
    expectMatchesReference(c, graph);
  }
}

TEST(LoopOuterReads, CarriesThroughNestedLoopsOuterFirst) {
  // NB: the inner body reads %x1 from outside both loops: the outer loop
  // carries it, the inner one carries the outer loop's.  %two is returned
  // for the reason %true is (reluOfLoop).
  auto graph = parse(R"IR(
graph(%x0 : Tensor, %x1 : Tensor, %n : int):
  %true : bool = prim::Constant[value=1]()
  %one : int = prim::Constant[value=1]()
  %two : int = prim::Constant[value=2]()
  %l : Tensor = prim::Loop(%n, %true, %x0)
    block0(%i : int, %h : Tensor):
      %k : Tensor = prim::Loop(%two, %true, %h)
        block0(%j : int, %g : Tensor):
          %m : Tensor = aten::mul(%g, %x1)
          -> (%true, %m)
      -> (%true, %k)
  %r : Tensor = aten::relu(%l)
  %o : Tensor = aten::sub(%x1, %r, %one)
  return (%o, %true, %two))IR");
  const Case nested{"nested", "", [](const at::Tensor& x0, const at::Tensor& x1, int64_t n) {
                      auto h = x0;
                      for (int64_t i = 0; i < 2 * n; ++i) {
                        h = h * x1;
                      }
                      return x1 - at::relu(h);
                    }};
  const auto x0 = torch::randn({7}, torch::kDouble);
  const auto x1 = torch::randn({7}, torch::kDouble);
  EXPECT_THROW(interpret(graph, x0, x1, 1), std::exception);

  EXPECT_EQ(carryOuterValuesThroughLoops(graph), 2);
  graph->lint();
  const auto found = loops(graph);
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found.at(0)->outputs().size(), 2u); // %h, %x1
  EXPECT_EQ(found.at(1)->outputs().size(), 2u); // %g, the outer loop's %x1
  EXPECT_EQ(found.at(1)->input(3), found.at(0)->blocks().at(0)->inputs().at(2));
  for (auto* loop : found) {
    EXPECT_FALSE(loopMayMoveOuterValue(loop));
  }
  expectMatchesReference(nested, graph);
}

TEST(LoopOuterReads, LeavesLoopsTheInterpreterDoesNotEmitInline) {
  // NB: a loop whose output has two uses, and one whose body reads only its
  // own block inputs and constants.
  const std::vector<std::string> irs = {
      R"IR(
graph(%x0 : Tensor, %x1 : Tensor, %n : int):
  %true : bool = prim::Constant[value=1]()
  %one : int = prim::Constant[value=1]()
  %l : Tensor = prim::Loop(%n, %true, %x0)
    block0(%i : int, %h : Tensor):
      -> (%true, %x1)
  %r : Tensor = aten::relu(%l)
  %o : Tensor = aten::sub(%l, %r, %one)
  return (%o, %true))IR",
      reluOfLoop("      %m : Tensor = aten::mul(%h, %one)\n", "%m"),
  };
  for (const auto& ir : irs) {
    const auto graph = parse(ir);
    EXPECT_FALSE(loopMayMoveOuterValue(loops(graph).at(0)));
    const auto before = graph->toString();
    EXPECT_EQ(carryOuterValuesThroughLoops(graph), 0);
    EXPECT_EQ(graph->toString(), before);
  }
}

} // namespace
} // namespace torchfuse::passes
