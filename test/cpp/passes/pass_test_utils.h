#pragma once

// Helpers for the pass tests: parse IR, run a pass, check it with FileCheck,
// and compare graphs before and after through the interpreter.

#include <gtest/gtest.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/testing/file_check.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace torchfuse::passes::testing {

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

} // namespace torchfuse::passes::testing
