#include "passes/frozen_optimizations.h"

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/passes/frozen_graph_optimizations.h>

namespace torchfuse::passes {

bool batchNormsAreInference(const torch::jit::Block* block) {
  for (const auto* node : block->nodes()) {
    for (const auto* sub : node->blocks()) {
      if (!batchNormsAreInference(sub)) {
        return false;
      }
    }
    if (node->kind() != c10::Symbol::fromQualString("aten::batch_norm")) {
      continue;
    }
    const auto training = torch::jit::toIValue(node->namedInput("training"));
    if (!training || !training->isBool() || training->toBool()) {
      return false;
    }
  }
  return true;
}

bool optimizeFrozenGraph(std::shared_ptr<torch::jit::Graph>& graph) {
  if (!batchNormsAreInference(graph->block())) {
    return false;
  }
  torch::jit::OptimizeFrozenGraph(graph, /*optimize_numerics=*/true);
  return true;
}

} // namespace torchfuse::passes
