// Canonicalize: puts graphs into the forms the fusions match.
//   - traced aten::_convolution (non-transposed) => aten::conv{1,2,3}d;
//   - x.relu_() => functional, where x is a fresh tensor that no other value
//     aliases (torch's MutationRemover decides with AliasDb and moves the
//     creation next to the write; writes to inputs, attributes, views or
//     constants stay in place).
//   NB: x.add_(y) stays: it keeps x's dtype where add promotes (a float32 y
//   on a bfloat16 x under autocast, a float64 y on a float32 x), and the
//   graph carries no dtypes to tell.
// RestoreInPlace undoes the second rewrite for every relu no fusion took, so
// that an unfused graph keeps the original's in-place memory behaviour.

#include <torch/csrc/jit/jit_log.h>
#include <torch/csrc/jit/passes/graph_rewrite_helper.h>
#include <torch/csrc/jit/passes/remove_mutation.h>

#include <unordered_set>

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

const c10::Symbol kFromInPlace = fromInPlaceAttr();

void collectRelus(torch::jit::Block* block, std::unordered_set<Node*>& out) {
  for (auto* n : block->nodes()) {
    if (n->kind() == c10::Symbol::aten("relu")) {
      out.insert(n);
    }
    for (auto* b : n->blocks()) {
      collectRelus(b, out);
    }
  }
}

// True when every use of `v` other than `n` comes before `n`: writing `v` in
// place at `n` then changes nothing any other reader sees.  RemoveTensorMutation
// made `v` fresh and unaliased and sent its later uses to n's output.
bool onlyEarlierUses(const Value* v, const Node* n) {
  for (const auto& use : v->uses()) {
    if (use.user != n && !use.user->isBefore(n)) {
      return false;
    }
  }
  return true;
}

} // namespace

void Canonicalize(std::shared_ptr<torch::jit::Graph>& graph) {
  torch::jit::graph_rewrite_helper::replaceConvolutionWithAtenConv(graph);
  std::unordered_set<Node*> before;
  collectRelus(graph->block(), before);
  torch::jit::RemoveTensorMutation(graph, isFunctionalizableInPlaceOp);
  // NB: a relu not in `before` is new: RemoveTensorMutation destroys only
  // the in-place nodes, so no new node can take a relu's address.
  std::unordered_set<Node*> after;
  collectRelus(graph->block(), after);
  for (auto* n : after) {
    if (before.count(n) == 0) {
      n->i_(kFromInPlace, 1);
    }
  }
  GRAPH_DUMP("After Canonicalize", graph);
}

int64_t RestoreInPlace(std::shared_ptr<torch::jit::Graph>& graph) {
  std::unordered_set<Node*> relus;
  collectRelus(graph->block(), relus);
  int64_t restored = 0;
  for (auto* n : relus) {
    if (!n->hasAttribute(kFromInPlace)) {
      continue;
    }
    n->removeAttribute(kFromInPlace);
    auto* input = n->input(0);
    if (!onlyEarlierUses(input, n)) {
      continue;
    }
    auto* inplace = graph->create(c10::Symbol::aten("relu_"), {input});
    inplace->copyMetadata(n);
    inplace->insertBefore(n);
    inplace->output()->setType(n->output()->type());
    n->output()->replaceAllUsesWith(inplace->output());
    n->destroy();
    ++restored;
  }
  GRAPH_DUMP("After RestoreInPlace", graph);
  return restored;
}

} // namespace torchfuse::passes
