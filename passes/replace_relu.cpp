// ReplaceRelu: relu(x) => torchfuse::custom_relu(x).
//
// Runs after the fusions so it cannot take a fused chain's relu.  relu_(x)
// is replaced only when x is a fresh tensor that nothing else reads or
// aliases (then the write is unobservable); relu_ on an input, attribute,
// constant, view or otherwise live tensor stays.

#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/jit_log.h>

#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {

int64_t ReplaceRelu(std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<Node*> relus;
  {
    // NB: decided on the original graph; replacing one relu_ never makes
    // another decision unsafe (it only removes a write).
    AliasDb db(graph);
    forEachNode(graph->block(), [&](Node* n) {
      if (isRelu(n, /*allow_inplace=*/false) ||
          (isRelu(n) && isFreshUnaliasedTensor(db, n->input(0), n))) {
        relus.push_back(n);
      }
    });
  }
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
