#include "passes/frozen_optimizations.h"

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/passes/frozen_graph_optimizations.h>

#include <algorithm>
#include <unordered_set>

namespace torchfuse::passes {
namespace {

// NB: BatchNorm's forward checks its input's dim(): readers of a tensor's
// metadata see the same before and after a fold.
bool readsOnlyMetadata(const torch::jit::Node* node) {
  static const std::unordered_set<c10::Symbol> kinds = {
      c10::Symbol::fromQualString("aten::dim"),   c10::Symbol::fromQualString("aten::size"),
      c10::Symbol::fromQualString("aten::numel"), c10::Symbol::fromQualString("aten::len"),
      c10::Symbol::fromQualString("prim::dtype"), c10::Symbol::fromQualString("prim::device"),
      c10::Symbol::fromQualString("prim::layout")};
  return kinds.count(node->kind()) > 0;
}

} // namespace

bool batchNormFoldingKeepsMeaning(const torch::jit::Block* block) {
  for (const auto* node : block->nodes()) {
    for (const auto* sub : node->blocks()) {
      if (!batchNormFoldingKeepsMeaning(sub)) {
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
    const auto* input = node->input(0);
    if (input->node()->kind() == c10::Symbol::fromQualString("aten::linear") &&
        std::any_of(input->uses().begin(), input->uses().end(), [&](const auto& use) {
          return use.user != node && !readsOnlyMetadata(use.user);
        })) {
      return false;
    }
  }
  return true;
}

bool optimizeFrozenGraph(std::shared_ptr<torch::jit::Graph>& graph) {
  if (!batchNormFoldingKeepsMeaning(graph->block())) {
    return false;
  }
  torch::jit::OptimizeFrozenGraph(graph, /*optimize_numerics=*/true);
  return true;
}

} // namespace torchfuse::passes
