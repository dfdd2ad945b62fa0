// FuseBatchNormAddDivSwish:
//   t = (batch_norm(x, w, b, rm, rv, training, momentum, eps) + other) / d
//   out = t * sigmoid(t)   (either operand order)   or   silu(t)
//   => torchfuse::custom_batch_norm_add_div_swish(x, w, b, rm, rv, training,
//                                                 momentum, eps, other, d, silu)
//      or, where training is a constant false (frozen graphs),
//      torchfuse::custom_batch_norm_add_div_swish_eval(x, w, b, rm, rv, eps,
//                                                      other, d, silu)
//   with silu = true for silu(t), false for the product: the op then
//   differentiates the swish as autograd does the spelling it replaces
//   (they differ where the incoming gradient is infinite).
//
// Matched: training a constant or a runtime bool; momentum and eps passed
// through as values; bn as add's first operand (chainIsAddSelf: `other + bn`
// takes other's strides), alpha 1, out of
// place (add_ keeps the BN output's dtype where the op promotes:
// addPromotes); d an int/float (literal, constant or attribute).
// Excluded: running stats None or Tensor? (the op's stats are not optional:
// TorchScript cannot express `Tensor(a!)?`), add alpha != 1, div by a Tensor
// or with rounding_mode, a constant zero divisor (left to eager),
// sigmoid of anything but t, chains whose intermediates have other uses, and
// chains whose `other` or BN bias is written after them (the op saves both).
//
// NB: the fused node sits where the swish was, so a training batch_norm's
// running-stat update moves down the chain; nothing in between may read or
// write the statistics.  The eval form never writes them: frozen graphs pool
// identical constants (a fresh BN's weight may be the running_var constant).

#include <torch/csrc/jit/jit_log.h>

#include "passes/chain_matcher.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

// t * sigmoid(t), sigmoid(t) * t or silu(t): the input index of t in the
// swish and the sigmoid node (nullptr for silu).
std::optional<std::pair<size_t, Node*>> matchSwish(Node* n) {
  if (isSilu(n)) {
    return hasSingleUse(n->input(0), n)
        ? std::make_optional(std::make_pair(size_t{0}, static_cast<Node*>(nullptr)))
        : std::nullopt;
  }
  if (!isTensorMul(n) || n->input(0) == n->input(1)) {
    return std::nullopt;
  }
  for (size_t j : {0, 1}) {
    Value* t = n->input(j);
    Node* sig = n->input(1 - j)->node();
    if (isSigmoid(sig) && sig->input(0) == t && hasSingleUse(sig->output(), n) &&
        t->uses().size() == 2 && inSameBlock({sig, n})) {
      return std::make_pair(j, sig);
    }
  }
  return std::nullopt;
}

bool isEval(const Chain& c) {
  return constantBool(c.head()->input(5)) == std::optional<bool>(false);
}

// The pass's own predicates over a matched bn -> add -> div -> swish.
bool accept(const Chain& c, const AliasDb& db) {
  Node* bn = c.nodes[0];
  Node* add = c.nodes[1];
  Node* div = c.nodes[2];
  Value* rm = bn->input(3);
  Value* rv = bn->input(4);
  // runningStatsPresent: both running statistics are Tensors.
  if (!chainIsAddSelf(c, 1) || !alphaIsOne(add->input(2)) || !divisorIsNonZero(div->input(1)) ||
      !isNonOptionalTensor(rm) || !isNonOptionalTensor(rv) || !isOptionalTensorArg(bn->input(1)) ||
      !isOptionalTensorArg(bn->input(2))) {
    return false;
  }
  // NB: the op saves `other` and the BN bias to recompute t in its
  // backward, and in eval mode reads the running statistics there too; the
  // unfused chain saves none of them, so it trains even when they are
  // written after the chain (another batch_norm in training mode on the
  // same statistics, say).
  if (!notWrittenAfter(db, bn, {c.otherOperand(1), bn->input(2), rm, rv})) {
    return false;
  }
  std::vector<Node*> between = {add, div};
  between.insert(between.end(), c.extra.begin(), c.extra.end());
  return isEval(c) || noInterveningAccess(db, bn, c.tail(), {rm, rv}, between);
}

std::optional<Chain> matchAt(Node* swish, const AliasDb& db) {
  const auto sw = matchSwish(swish);
  if (!sw) {
    return std::nullopt;
  }
  const std::vector<Link> links = {
      {[](const Node* n) { return isBatchNorm(n); }, {}},
      {[](const Node* n) { return addPromotes(n); }, {0, 1}},
      {[](const Node* n) { return isScalarDivisor(n); }, {0}},
  };
  for (auto& c : matchChains(swish->input(sw->first)->node(), links)) {
    if (!inSameBlock({c.head(), swish})) {
      continue;
    }
    c.nodes.push_back(swish);
    c.operand.push_back(sw->first);
    if (sw->second != nullptr) {
      c.extra.push_back(sw->second);
    }
    if (noInterveningWrites(db, c.head(), swish, c.externalInputs()) &&
        accept(c, db)) {
      return c;
    }
  }
  return std::nullopt;
}

bool rewrite(torch::jit::Graph& graph, const Chain& c) {
  Node* bn = c.nodes[0];
  Value* other = c.otherOperand(1);
  Value* divisor = c.nodes[2]->input(1);
  Value* silu = nullptr;
  {
    torch::jit::WithInsertPoint guard(c.tail());
    silu = graph.insertConstant(c.extra.empty());
  }
  const bool fused = isEval(c)
      ? replaceChain(
            graph, c, "torchfuse::custom_batch_norm_add_div_swish_eval",
            {bn->input(0), bn->input(1), bn->input(2), bn->input(3),
             bn->input(4), bn->input(7), other, divisor, silu})
      : replaceChain(
            graph, c, "torchfuse::custom_batch_norm_add_div_swish",
            {bn->input(0), bn->input(1), bn->input(2), bn->input(3),
             bn->input(4), bn->input(5), bn->input(6), bn->input(7), other,
             divisor, silu});
  if (!fused) {
    silu->node()->destroy();
  }
  return fused;
}

} // namespace

int64_t FuseBatchNormAddDivSwish(std::shared_ptr<torch::jit::Graph>& graph) {
  const int64_t fused = fuseAll(graph, matchAt, rewrite);
  GRAPH_DUMP("After FuseBatchNormAddDivSwish", graph);
  return fused;
}

} // namespace torchfuse::passes
