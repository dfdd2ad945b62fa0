// Loops whose body reads values from outside: see loop_outer_reads.h.

#include "passes/loop_outer_reads.h"

#include <functional>
#include <unordered_set>
#include <vector>

#include "passes/match_filters.h"

namespace torchfuse::passes {
namespace {

// The non-constant values defined outside `loop` that its body reads, in
// the order of their first read.
std::vector<torch::jit::Value*> outerReads(torch::jit::Node* loop) {
  auto* body = loop->blocks().at(0);
  std::vector<torch::jit::Value*> reads;
  std::unordered_set<torch::jit::Value*> seen;
  const auto collect = [&](torch::jit::Node* n) {
    for (auto* v : n->inputs()) {
      if (v->node()->kind() != c10::prim::Constant && !isInBlock(v->node(), body) &&
          seen.insert(v).second) {
        reads.push_back(v);
      }
    }
  };
  std::function<void(torch::jit::Block*)> walk = [&](torch::jit::Block* b) {
    for (auto* n : b->nodes()) {
      collect(n);
      for (auto* nested : n->blocks()) {
        walk(nested);
      }
    }
    collect(b->return_node());
  };
  walk(body);
  return reads;
}

// NB: CanEmitInline's precondition for emitting a node inside its user's
// tree (it also needs the user to follow the node); an enclosing node emitted
// inline takes the loop with it.
bool mayBeEmittedInline(const torch::jit::Node* n) {
  for (; n != nullptr; n = n->owningBlock()->owningNode()) {
    if (n->outputs().size() == 1 && n->output()->uses().size() == 1) {
      return true;
    }
  }
  return false;
}

} // namespace

bool loopMayMoveOuterValue(torch::jit::Node* loop) {
  return loop->kind() == c10::prim::Loop && mayBeEmittedInline(loop) && !outerReads(loop).empty();
}

int64_t carryOuterValuesThroughLoops(const std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<torch::jit::Node*> loops;
  forEachNode(graph->block(), [&](torch::jit::Node* n) {
    if (n->kind() == c10::prim::Loop) {
      loops.push_back(n); // outer loops first
    }
  });
  int64_t rewritten = 0;
  for (auto* loop : loops) {
    if (!loopMayMoveOuterValue(loop)) {
      continue;
    }
    auto* body = loop->blocks().at(0);
    for (auto* v : outerReads(loop)) {
      auto* received = body->addInput()->setType(v->type());
      const std::vector<torch::jit::Use> uses = v->uses();
      for (const auto& use : uses) {
        if (isInBlock(use.user, body)) {
          use.user->replaceInput(use.offset, received);
        }
      }
      // NB: returned as `[received][0]`, the same object: ConstantPropagation
      // (run again when a saved module is loaded) drops a slot whose body
      // returns its input unchanged.  The list makes the value an AliasDb
      // wildcard, as the loop-carried alias guards' seal does; nothing of
      // ours runs after this.
      torch::jit::WithInsertPoint insert(body->return_node());
      auto* list = graph->insertNode(graph->createList(received->type(), {received}));
      body->registerOutput(graph->insert(c10::aten::__getitem__, {list->output(), int64_t{0}}));
      loop->addInput(v);
      loop->addOutput()->setType(v->type());
    }
    ++rewritten;
  }
  return rewritten;
}

} // namespace torchfuse::passes
