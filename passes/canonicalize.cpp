// Canonicalize: puts graphs into the forms the fusions match.
//   - traced aten::_convolution (non-transposed) => aten::conv{1,2,3}d;
//   - x.relu_() => functional, where x is a fresh tensor that no other value
//     aliases (torch's MutationRemover decides with AliasDb and moves the
//     creation next to the write; writes to inputs, attributes, views or
//     constants stay in place).
//   NB: x.add_(y) stays: it keeps x's dtype where add promotes (a float32 y
//   on a bfloat16 x under autocast, a float64 y on a float32 x), and the
//   graph carries no dtypes to tell.

#include <torch/csrc/jit/jit_log.h>
#include <torch/csrc/jit/passes/graph_rewrite_helper.h>
#include <torch/csrc/jit/passes/remove_mutation.h>

#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

// Only the in-place forms our patterns contain whose functional form
// computes the same dtype; functionalizing others would change graphs for
// no fusion.
bool isFunctionalizableInPlaceOp(Node* n) {
  return n->kind() == c10::Symbol::aten("relu_");
}

} // namespace

void Canonicalize(std::shared_ptr<torch::jit::Graph>& graph) {
  torch::jit::graph_rewrite_helper::replaceConvolutionWithAtenConv(graph);
  torch::jit::RemoveTensorMutation(graph, isFunctionalizableInPlaceOp);
  GRAPH_DUMP("After Canonicalize", graph);
}

} // namespace torchfuse::passes
