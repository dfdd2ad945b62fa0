// FuseAddLayerNorm: (layer_norm(s), s) with s = add(a, b, alpha)
//   => torchfuse::custom_add_layer_norm(a, b, alpha, promote,
//        normalized_shape, weight, bias, eps, write_sum)
//
// Matched forms (after Inline + ConstantPropagation + Canonicalize, any
// block): aten::add.Tensor (promote=true: s takes add's promoted dtype), or
// aten::add_.Tensor into a fresh tensor only it reads (isFreshUnaliasedTensor;
// promote=false: s keeps that tensor's dtype), either operand order (the op
// takes the add's operands as written), any int or float alpha; then
// aten::layer_norm of s with a constant normalized_shape and eps
// (normArgumentsAreConstant).
//   post-LN (BERT: LayerNorm(dense_out + input)): s has no other use;
//     write_sum=false, the op at the layer_norm's position.
//   pre-LN (ViT: x = x + attn; y = ln_2(x); x + mlp(y)): s has other uses,
//     which read the op's second result (write_sum=true).  The op sits at
//     the layer_norm's position when every other use follows it, else at the
//     add's, with the Constants and GetAttrs that give the layer_norm's
//     other arguments moved up before it (normArgumentsHoistable).
// Excluded: add.Scalar (`x + 1.0`); an add_ on a live tensor; s written in
// place anywhere, or through a view (sumNotWrittenInPlace: a write between
// the add and the layer_norm would change what it reads, one after would
// change what the op's saved graph sees); s read by a second layer_norm
// (sumFeedsOneNorm: the matches would overlap); a layer_norm in another
// block than the add; a runtime normalized_shape or eps.
// NB: the op computes the add as written and then layer_norm, so the dtypes
// are the chain's: no dtype condition is needed.  Under a scripted autocast
// scope nothing is fused (fuseAll).
// NB: the op's Autograd kernel records the original ATen chain, so nothing
// it saves differs from eager's (no notWrittenAfter condition).

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

constexpr const char* kOp = "torchfuse::custom_add_layer_norm";

struct Match {
  Node* add;
  Node* norm;
  bool write_sum;
  bool at_head; // the op at the add's position (else the layer_norm's)
};

bool normArgumentsAreConstant(const Node* norm) {
  const auto shape = torch::jit::toIValue(norm->input(1));
  const auto eps = torch::jit::toIValue(norm->input(4));
  return shape && shape->isIntList() && eps && eps->isDouble();
}

// add.Tensor, or add_.Tensor writing a fresh tensor nothing else reads.
bool addIsOutOfPlaceOrIntoFresh(const AliasDb& db, Node* add) {
  if (addPromotes(add)) {
    return true;
  }
  return isTensorAdd(add) && isFreshUnaliasedTensor(db, add->input(0), add);
}

bool sumFeedsOneNorm(const Value* sum) {
  return std::count_if(sum->uses().begin(), sum->uses().end(), [](const torch::jit::Use& u) {
           return u.offset == 0 && isLayerNorm(u.user);
         }) == 1;
}

// No node but the add itself writes s or anything that may alias it.
bool sumNotWrittenInPlace(const AliasDb& db, Node* add) {
  torch::jit::ValueSet sum = {add->output()};
  bool written = false;
  forEachNode(add->owningGraph()->block(), [&](Node* n) {
    written = written || (n != add && n->blocks().empty() && db.writesToAlias(n, sum));
  });
  return !written;
}

// Every use of v but `except` comes after `node` (a use in a nested block by
// the position of the node holding it).
bool otherUsesFollow(const Value* v, const Node* except, const Node* node) {
  return std::all_of(v->uses().begin(), v->uses().end(), [&](const torch::jit::Use& u) {
    return u.user == except || node->isBefore(u.user);
  });
}

// v can be read right before `at`: a graph or enclosing block input, or the
// output of a node before `at` in its block or an enclosing one.
bool availableAt(const Value* v, const Node* at) {
  const Node* d = v->node();
  if (!isInBlock(at, d->owningBlock())) {
    return false;
  }
  return d->kind() == c10::prim::Param || d->isBefore(at);
}

// The nodes to move before `at` so that v is available there, in order:
// Constants, and GetAttrs of available or movable values, in at's block.
bool collectHoist(Value* v, Node* at, std::vector<Node*>& out) {
  if (availableAt(v, at)) {
    return true;
  }
  Node* d = v->node();
  if (d->owningBlock() != at->owningBlock() ||
      (d->kind() != c10::prim::Constant && d->kind() != c10::prim::GetAttr)) {
    return false;
  }
  if (std::find(out.begin(), out.end(), d) != out.end()) {
    return true;
  }
  for (Value* in : d->inputs()) {
    if (!collectHoist(in, at, out)) {
      return false;
    }
  }
  out.push_back(d);
  return true;
}

bool noSetAttrBetween(Node* first, Node* last) {
  for (Node* n = first->next(); n != last; n = n->next()) {
    bool set = n->kind() == c10::prim::SetAttr;
    for (Block* b : n->blocks()) {
      forEachNode(b, [&](Node* m) { set = set || m->kind() == c10::prim::SetAttr; });
    }
    if (set) {
      return false;
    }
  }
  return true;
}

// The layer_norm's arguments but s can be read at the add's position, some
// after moving the pure nodes that give them (Constants and GetAttrs, with
// no SetAttr in between) up there.
bool normArgumentsHoistable(Node* add, Node* norm) {
  std::vector<Node*> hoist;
  for (size_t i = 1; i < norm->inputs().size(); ++i) {
    if (!collectHoist(norm->input(i), add, hoist)) {
      return false;
    }
  }
  return hoist.empty() || noSetAttrBetween(add, norm);
}

std::optional<Match> matchAt(Node* norm, const AliasDb& db) {
  if (!isLayerNorm(norm) || !normArgumentsAreConstant(norm)) {
    return std::nullopt;
  }
  Value* sum = norm->input(0);
  Node* add = sum->node();
  if (!isTensorAdd(add) || !inSameBlock({add, norm}) || !addIsOutOfPlaceOrIntoFresh(db, add) ||
      !sumFeedsOneNorm(sum) || !sumNotWrittenInPlace(db, add)) {
    return std::nullopt;
  }
  std::vector<Value*> reads(add->inputs().begin(), add->inputs().end());
  reads.insert(reads.end(), norm->inputs().begin() + 1, norm->inputs().end());
  if (!noInterveningWrites(db, add, norm, reads)) {
    return std::nullopt;
  }
  const bool write_sum = !hasSingleUse(sum, norm);
  if (!write_sum || otherUsesFollow(sum, norm, norm)) {
    return Match{add, norm, write_sum, /*at_head=*/false};
  }
  if (normArgumentsHoistable(add, norm)) {
    return Match{add, norm, write_sum, /*at_head=*/true};
  }
  return std::nullopt;
}

bool rewrite(torch::jit::Graph& graph, const Match& m) {
  Node* at = m.at_head ? m.add : m.norm;
  if (m.at_head) {
    std::vector<Node*> hoist;
    for (size_t i = 1; i < m.norm->inputs().size(); ++i) {
      collectHoist(m.norm->input(i), m.add, hoist);
    }
    for (Node* n : hoist) {
      n->moveBefore(m.add);
    }
  }
  torch::jit::WithInsertPoint guard(at);
  const std::vector<Value*> inputs = {
      m.add->input(0),
      m.add->input(1),
      m.add->input(2),
      graph.insertConstant(m.add->kind() == c10::aten::add),
      m.norm->input(1),
      m.norm->input(2),
      m.norm->input(3),
      m.norm->input(4),
      graph.insertConstant(m.write_sum)};
  Node* fused = graph.create(c10::Symbol::fromQualString(kOp), inputs, 2);
  fused->insertBefore(at);
  if (fused->maybeSchema() == nullptr) {
    fused->destroy();
    return false;
  }
  fused->copyMetadata(m.norm);
  fused->output(0)->setType(m.norm->output()->type());
  fused->output(1)->setType(m.add->output()->type());
  m.norm->output()->replaceAllUsesWith(fused->output(0));
  m.norm->destroy();
  m.add->output()->replaceAllUsesWith(fused->output(1));
  m.add->destroy();
  return true;
}

} // namespace

int64_t FuseAddLayerNorm(std::shared_ptr<torch::jit::Graph>& graph) {
  const int64_t fused = fuseAll(graph, matchAt, rewrite);
  GRAPH_DUMP("After FuseAddLayerNorm", graph);
  return fused;
}

} // namespace torchfuse::passes
