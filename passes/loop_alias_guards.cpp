// Loop-carried alias guards: see loop_alias_guards.h.

#include "passes/loop_alias_guards.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/passes/inliner.h>

#include <algorithm>
#include <unordered_set>
#include <utility>
#include <vector>

#include "passes/match_filters.h"

namespace torchfuse::passes {
namespace {

// NB: AliasDb (AliasDb::analyzeLoop) lets a loop body's carried input alias
// only the loop's initial input, not the value the previous iteration
// returned.  In `v2 = relu(v1); for ...: v1.add_(b); v1 = v2` the add_ of the
// second iteration writes v2, but AliasDb sees a write to v1's first value
// only: EliminateDeadCode (ours, ConstantPropagation's, freeze_module's)
// drops it once v1's producer is inlined, and CSE merges reads of v2 across
// the loop.  A slot whose body returns another value than it received is
// exposed when the returned value may alias something that outlives the
// iteration (a value from outside the body, a graph input, an attribute, a
// constant, another slot's received value) and the body writes it, or when
// the body writes the received value and the returned one may alias any of
// those or another slot's returned value.  A value created in the iteration
// and carried by one slot (`h = relu_(fc(h))`) is reachable only through
// that slot, which AliasDb models.
bool loopCarriedWriteHiddenFromAliasDb(
    const torch::jit::AliasDb& db, torch::jit::Node* loop, size_t slot) {
  auto* body = loop->blocks().at(0);
  auto* received = body->inputs().at(slot + 1);   // after the trip count
  auto* returned = body->outputs().at(slot + 1);  // after the condition
  if (received == returned) {
    return false;
  }
  const auto writtenInBody = [&](torch::jit::Value* v) {
    bool written = false;
    forEachNode(body, [&](torch::jit::Node* n) {
      written = written || db.writesToAlias(n, {v});
    });
    return written;
  };
  const bool receivedWritten = writtenInBody(received);
  if (!receivedWritten && !writtenInBody(returned)) {
    return false;
  }
  torch::jit::ValueSet persistent(
      loop->owningGraph()->inputs().begin(), loop->owningGraph()->inputs().end());
  const auto collect = [&](torch::jit::Node* n) {
    for (auto* input : n->inputs()) {
      if (!isInBlock(input->node(), body)) {
        persistent.insert(input);
      }
    }
    if (n->kind() == c10::prim::GetAttr || n->kind() == c10::prim::Constant) {
      persistent.insert(n->output());
    }
  };
  forEachNode(body, collect);
  collect(body->return_node());
  torch::jit::ValueSet otherReturned;
  for (size_t j = 1; j < body->inputs().size(); ++j) {
    if (j != slot + 1) {
      persistent.insert(body->inputs().at(j));
      otherReturned.insert(body->outputs().at(j));
    }
  }
  const torch::jit::ValueSet r = {returned};
  return db.mayAlias(r, persistent) ||
      (receivedWritten && db.mayAlias(r, otherReturned));
}

const c10::Symbol kLoopAliasGuard =
    c10::Symbol::attr("torchfuse_loop_alias_guard");

bool isLoopAliasGuard(const torch::jit::Node* n) {
  return n->kind() == c10::prim::Print && n->hasAttribute(kLoopAliasGuard);
}

// NB: a free function (prim::CallFunction), or a method of a TorchScript
// class that is not a module, is shared by every graph that calls it, and
// its optimized graph is cached on first use: Inline would insert one built
// while the executor's optimization is on (DCE included, so a write AliasDb
// misses may already be gone), and would leave it cached for the caller's
// module too.  Insert a copy of the callee's own graph instead, its calls
// inlined the same way, so the guards see the loops before any DCE and the
// shared function is not touched.
bool callsSharedFunction(torch::jit::Node* n) {
  if (n->kind() == c10::prim::CallFunction) {
    return true;
  }
  if (n->kind() != c10::prim::CallMethod) {
    return false;
  }
  const auto type = n->input(0)->type()->cast<c10::ClassType>();
  return type != nullptr && !type->is_module();
}

// The persistent form of a guard: the body returns `[returned, received][0]`.
// NB: putting a value in a list makes it an AliasDb wildcard, as the
// guard's tuple does, and the list stays as long as the slot does, with no
// side effect.  Unlike the guard it survives serialization: loading compiles
// the saved code again, whose DCE would otherwise drop the write once the
// producer is visible (it does so in the inlined forward).  The optimizing
// executor's list peephole folds it, as it drops the write in the original.
bool isSealedLoopSlot(const torch::jit::Node* loop, size_t slot) {
  auto* body = loop->blocks().at(0);
  const auto* returned = body->outputs().at(slot + 1)->node();
  if (returned->kind() != c10::aten::__getitem__ ||
      returned->input(0)->node()->kind() != c10::prim::ListConstruct) {
    return false;
  }
  const auto index = torch::jit::constant_as<int64_t>(returned->input(1));
  const auto* list = returned->input(0)->node();
  return index == 0 && list->inputs().size() == 2 &&
      list->input(1) == body->inputs().at(slot + 1);
}

} // namespace

// For each exposed slot, puts the received and the returned value into a
// tuple at the end of the body: a tuple's elements (and everything they may
// point to) become AliasDb wildcards, which may alias each other, so every
// AliasDb client sees the write.  A prim::Print of the tuple (a side effect)
// keeps it through torch's passes; nothing runs before the guards are
// removed.
void guardLoopCarriedAliases(const std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<std::pair<torch::jit::Node*, std::vector<torch::jit::Value*>>> guards;
  {
    torch::jit::AliasDb db(graph);
    forEachNode(graph->block(), [&](torch::jit::Node* n) {
      if (n->kind() != c10::prim::Loop ||
          isLoopAliasGuard(n->blocks().at(0)->return_node()->prev())) {
        return;  // not a loop, or guarded already (a type shared by submodules)
      }
      std::vector<torch::jit::Value*> values;
      for (size_t i = 0; i < n->outputs().size(); ++i) {
        if (loopCarriedWriteHiddenFromAliasDb(db, n, i)) {
          values.push_back(n->blocks().at(0)->inputs().at(i + 1));
          values.push_back(n->blocks().at(0)->outputs().at(i + 1));
        }
      }
      if (!values.empty()) {
        guards.emplace_back(n, std::move(values));
      }
    });
  }
  for (auto& [loop, values] : guards) {
    auto* body = loop->blocks().at(0);
    torch::jit::WithInsertPoint insert(body->return_node());
    auto* tuple = graph->insertNode(graph->createTuple(values));
    auto* print =
        graph->insertNode(graph->create(c10::prim::Print, {tuple->output()}, 0));
    print->i_(kLoopAliasGuard, 1);
  }
}

// Removes the guards (with copies made by loop unrolling), then what only
// they kept alive, as far as it writes nothing and has no side effects:
// EliminateDeadCode would again drop the writes AliasDb misses.
void removeLoopCarriedAliasGuards(const std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<torch::jit::Node*> prints;
  forEachNode(graph->block(), [&](torch::jit::Node* n) {
    if (isLoopAliasGuard(n)) {
      prints.push_back(n);
    }
  });
  std::vector<torch::jit::Node*> work;
  for (auto* print : prints) {
    work.push_back(print->input()->node());
    print->destroy();
  }
  const torch::jit::AliasDb db(graph);
  std::unordered_set<torch::jit::Node*> destroyed;
  while (!work.empty()) {
    auto* n = work.back();
    work.pop_back();
    if (destroyed.count(n) > 0 || n->kind() == c10::prim::Param ||
        !n->blocks().empty() || n->hasSideEffects() || db.isMutable(n) ||
        std::any_of(n->outputs().begin(), n->outputs().end(),
                    [](const torch::jit::Value* v) { return v->hasUses(); })) {
      continue;
    }
    for (auto* input : n->inputs()) {
      work.push_back(input->node());
    }
    destroyed.insert(n);
    n->destroy();
  }
}

void inlineSharedFunctions(torch::jit::Block* block) {
  for (auto it = block->nodes().begin(); it != block->nodes().end();) {
    torch::jit::Node* n = *it++;
    for (auto* b : n->blocks()) {
      inlineSharedFunctions(b);
    }
    if (!callsSharedFunction(n)) {
      continue;
    }
    auto* callee = torch::jit::tryToGraphFunction(n);
    if (callee == nullptr) {
      continue;
    }
    const auto body = callee->graph()->copy();
    inlineSharedFunctions(body->block());
    if (n->kind() == c10::prim::CallFunction) {
      n->removeInput(0);  // the function constant, not a graph input
    }
    torch::jit::inlineCallTo(n, callee, body.get());
  }
}

void sealLoopCarriedAliases(const std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<std::pair<torch::jit::Node*, size_t>> slots;
  {
    torch::jit::AliasDb db(graph);
    forEachNode(graph->block(), [&](torch::jit::Node* n) {
      if (n->kind() != c10::prim::Loop) {
        return;
      }
      for (size_t i = 0; i < n->outputs().size(); ++i) {
        if (!isSealedLoopSlot(n, i) && loopCarriedWriteHiddenFromAliasDb(db, n, i)) {
          slots.emplace_back(n, i);
        }
      }
    });
  }
  for (const auto& [loop, slot] : slots) {
    auto* body = loop->blocks().at(0);
    auto* received = body->inputs().at(slot + 1);
    auto* returned = body->outputs().at(slot + 1);
    if (!returned->type()->isSubtypeOf(*received->type())) {
      continue;  // not a well-typed slot; nothing to build the list from
    }
    torch::jit::WithInsertPoint insert(body->return_node());
    auto* list = graph->insertNode(
        graph->createList(received->type(), {returned, received}));
    body->replaceOutput(
        slot + 1,
        graph->insert(c10::aten::__getitem__, {list->output(), int64_t{0}}));
  }
}

} // namespace torchfuse::passes
