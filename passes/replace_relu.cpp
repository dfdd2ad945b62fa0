// ReplaceRelu: relu(x) => torchfuse::custom_relu(x).
//
// Runs after the fusions so it cannot take a fused chain's relu.  Only the
// out-of-place spelling is replaced (isOutOfPlaceSpelling): relu_, and a
// relu Canonicalize made from one, keep their input's strides, which an
// out-of-place op does not reproduce where the layout is ambiguous (size-1
// dimensions: a [3, 2, 1, 1] channels-last conv output keeps (2, 1, 2, 2)
// under relu_, and gets (2, 1, 1, 1) from an out-of-place op; fuzz seed
// 20261127 program 2525).  An elementwise op for another saves nothing.

#include <torch/csrc/jit/jit_log.h>

#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

bool isOutOfPlaceSpelling(const Node* n) {
  return isRelu(n, /*allow_inplace=*/false) && !isInPlaceSpelling(n);
}

} // namespace

int64_t ReplaceRelu(std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<Node*> relus;
  forEachNode(graph->block(), [&](Node* n) {
    if (isOutOfPlaceSpelling(n)) {
      relus.push_back(n);
    }
  });
  int64_t replaced = 0;
  for (Node* n : relus) {
    if (replaceWithFusedOp(*graph, "torchfuse::custom_relu", {n->input(0)}, n)) {
      n->destroy();
      ++replaced;
    }
  }
  GRAPH_DUMP("After ReplaceRelu", graph);
  return replaced;
}

} // namespace torchfuse::passes
