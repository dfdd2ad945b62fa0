#pragma once

// Helpers for the pass tests: parse IR, run a pass, check it with FileCheck,
// and compare graphs before and after through the interpreter.

#include <gtest/gtest.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/testing/file_check.h>
#include <torch/torch.h>

#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace torchfuse::passes::testing {

using torch::jit::testing::FileCheck;

inline std::shared_ptr<torch::jit::Graph> parse(const std::string& ir) {
  auto graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(ir, graph.get());
  return graph;
}

// Runs `pass` on `ir` and checks that nothing changed and nothing fused.
template <typename Pass>
void expectUnchanged(const std::string& ir, Pass pass) {
  auto graph = parse(ir);
  const auto before = graph->toString();
  EXPECT_EQ(pass(graph), 0);
  graph->lint();
  EXPECT_EQ(graph->toString(), before);
  torch::jit::testing::FileCheck().check_not("torchfuse::")->run(*graph);
}

// The tail of a graph's IR: `%out : Tensor = prim::If(%c)`, whose
// then-block runs `then` (statements) and yields %o and whose else-block
// runs `otherwise` and yields `yield`, then `return (%out)`.
inline std::string ifTail(
    const std::vector<std::string>& then,
    const std::vector<std::string>& otherwise = {},
    const std::string& yield = "%x") {
  std::string ir = "  %out : Tensor = prim::If(%c)\n    block0():\n";
  for (const auto& line : then) {
    ir += "      " + line + "\n";
  }
  ir += "      -> (%o)\n    block1():\n";
  for (const auto& line : otherwise) {
    ir += "      " + line + "\n";
  }
  return ir + "      -> (" + yield + ")\n  return (%out)";
}

// `%lo : Tensor = prim::Loop(%n, %true, %x)`, whose body runs `body` on
// %h and carries %o2: statements for ifTail's else-block.
inline std::vector<std::string> loop(const std::vector<std::string>& body) {
  std::vector<std::string> lines = {
      "%lo : Tensor = prim::Loop(%n, %true, %x)", "  block0(%i : int, %h : Tensor):"};
  for (const auto& line : body) {
    lines.push_back("    " + line);
  }
  lines.push_back("    -> (%true, %o2)");
  return lines;
}

// Runs `pass` on `ir` (a chain in each branch of ifTail(.., loop(..),
// "%lo")) and checks that it fused both into `op` and left no `gone`.
template <typename Pass>
void expectFusedInIfAndLoop(
    const std::string& ir,
    Pass pass,
    const std::string& op,
    const std::string& gone) {
  auto graph = parse(ir);
  EXPECT_EQ(pass(graph), 2);
  graph->lint();
  FileCheck()
      .check("prim::If")
      ->check(op)
      ->check("prim::Loop")
      ->check(op)
      ->check_not(gone)
      ->run(*graph);
}

// Runs `pass` on `ir` and checks that it fused once into `op` and that none
// of `gone` (the chain's node kinds) is left.
template <typename Pass>
void expectFused(
    const std::string& ir,
    Pass pass,
    const std::string& op,
    const std::vector<std::string>& gone) {
  auto graph = parse(ir);
  EXPECT_EQ(pass(graph), 1);
  graph->lint();
  FileCheck check;
  check.check(op);
  for (const auto& kind : gone) {
    check.check_not(kind);
  }
  check.run(*graph);
}

// Text replacements, each of the first occurrence of `first` by `second`.
using Edits = std::vector<std::pair<std::string, std::string>>;

inline std::string edit(std::string ir, const Edits& edits) {
  for (const auto& [from, to] : edits) {
    const auto pos = ir.find(from);
    TORCH_CHECK(pos != std::string::npos, "edit: '", from, "' is not in the IR");
    ir.replace(pos, from.size(), to);
  }
  return ir;
}

// A variant of a pass test's base chain, named as the test it stands for:
// what it changes in the chain, and whether the pass must fuse it.
struct Variant {
  std::string name;
  bool fuses;
  Edits edits;
};

inline void PrintTo(const Variant& v, std::ostream* os) {
  *os << v.name;
}

inline std::string variantName(const ::testing::TestParamInfo<Variant>& info) {
  return info.param.name;
}

// A test `Prefix/Fixture.Rewrite/<name>` per entry of `variants`, on `base`
// edited: `fused(ir)` checks one that fuses, one that must not is left as it
// is by `pass`.
#define TORCHFUSE_VARIANT_TESTS(Prefix, Fixture, variants, base, pass, fused)                \
  class Fixture : public ::testing::TestWithParam<::torchfuse::passes::testing::Variant> {}; \
  TEST_P(Fixture, Rewrite) {                                                                 \
    const auto text = ::torchfuse::passes::testing::edit(base, GetParam().edits);            \
    if (GetParam().fuses) {                                                                  \
      fused(text);                                                                           \
    } else {                                                                                 \
      ::torchfuse::passes::testing::expectUnchanged(text, pass);                             \
    }                                                                                        \
  }                                                                                          \
  INSTANTIATE_TEST_SUITE_P(                                                                  \
      Prefix, Fixture, ::testing::ValuesIn(variants), ::torchfuse::passes::testing::variantName)

inline std::vector<at::IValue> runGraph(
    const std::shared_ptr<torch::jit::Graph>& graph,
    const std::vector<at::IValue>& inputs) {
  torch::jit::GraphExecutor executor(graph->copy(), "test");
  torch::jit::Stack stack(inputs.begin(), inputs.end());
  executor.run(stack);
  return stack;
}

// Tolerances per dtype: float32 tight, float64 tighter.
inline void expectClose(const at::Tensor& actual, const at::Tensor& expected) {
  const bool dbl = expected.scalar_type() == at::kDouble;
  EXPECT_TRUE(at::allclose(actual, expected, dbl ? 1e-10 : 1e-5, dbl ? 1e-10 : 1e-6))
      << "max abs diff " << (actual - expected).abs().max().item<double>();
}

// Fuses a copy of `ir` once with `pass` and compares it with `ir` through
// the interpreter, in float32 and float64, on the inputs `inputs(options)`.
template <typename Pass, typename Inputs>
void expectSameOutputs(const std::string& ir, Pass pass, Inputs inputs) {
  auto graph = parse(ir);
  auto fused = graph->copy();
  ASSERT_EQ(pass(fused), 1);
  torch::manual_seed(0);
  for (auto dtype : {at::kFloat, at::kDouble}) {
    const std::vector<at::IValue> in = inputs(at::TensorOptions().dtype(dtype));
    expectClose(runGraph(fused, in)[0].toTensor(), runGraph(graph, in)[0].toTensor());
  }
}

} // namespace torchfuse::passes::testing
