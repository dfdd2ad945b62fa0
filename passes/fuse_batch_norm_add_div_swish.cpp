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
// through as values; bn as either add operand (alpha must be 1); add_ only
// on the batch_norm output; d an int/float (literal, constant or attribute).
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

#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/jit_log.h>

#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

struct Match {
  Node* bn;
  Node* add;
  Node* div;
  Node* sigmoid;  // nullptr for silu
  Node* swish;    // the mul or the silu
  size_t bn_operand;
};

// t * sigmoid(t), sigmoid(t) * t or silu(t): returns t's producer's output t
// and the sigmoid node (nullptr for silu).
std::optional<std::pair<Value*, Node*>> matchSwish(Node* n) {
  if (isSilu(n)) {
    Value* t = n->input(0);
    if (!hasSingleUse(t, n)) {
      return std::nullopt;
    }
    return std::make_pair(t, static_cast<Node*>(nullptr));
  }
  if (!isTensorMul(n) || n->input(0) == n->input(1)) {
    return std::nullopt;
  }
  for (size_t j : {0, 1}) {
    Value* t = n->input(j);
    Value* s = n->input(1 - j);
    Node* sig = s->node();
    if (isSigmoid(sig) && sig->input(0) == t && hasSingleUse(s, n) &&
        t->uses().size() == 2 && inSameBlock({sig, n})) {
      return std::make_pair(t, sig);
    }
  }
  return std::nullopt;
}

std::optional<Match> matchAt(Node* swish, const AliasDb& db) {
  auto sw = matchSwish(swish);
  if (!sw) {
    return std::nullopt;
  }
  auto [t, sigmoid] = *sw;
  Node* div = t->node();
  if (!isScalarDivisor(div) || !divisorIsNonZero(div->input(1))) {
    return std::nullopt;
  }
  Value* u = div->input(0);
  Node* add = u->node();
  if (!isTensorAdd(add) || !hasSingleUse(u, div) || !alphaIsOne(add->input(2))) {
    return std::nullopt;
  }
  for (size_t i : {0, 1}) {
    Value* y = add->input(i);
    Node* bn = y->node();
    if (!isBatchNorm(bn) || !hasSingleUse(y, add) ||
        !inSameBlock({bn, add, div, swish}) ||
        !notInPlaceOnLiveTensor(add, y)) {
      continue;
    }
    // runningStatsPresent: both running statistics are Tensors.
    Value* rm = bn->input(3);
    Value* rv = bn->input(4);
    if (!isNonOptionalTensor(rm) || !isNonOptionalTensor(rv) ||
        !isOptionalTensorArg(bn->input(1)) ||
        !isOptionalTensorArg(bn->input(2))) {
      continue;
    }
    Value* other = add->input(1 - i);
    if (!noInterveningWrites(
            db, bn, swish,
            {bn->input(0), bn->input(1), bn->input(2), rm, rv, other})) {
      continue;
    }
    // NB: the op saves `other` and the BN bias to recompute t in its
    // backward; the unfused chain saves neither, so it trains even when they
    // are written after the chain.
    if (!notWrittenAfter(db, bn, {other, bn->input(2)})) {
      continue;
    }
    const bool eval = constantBool(bn->input(5)) == std::optional<bool>(false);
    if (!eval && !noInterveningAccess(
                     db, bn, swish, {rm, rv}, {add, div, sigmoid})) {
      continue;
    }
    return Match{bn, add, div, sigmoid, swish, i};
  }
  return std::nullopt;
}

bool rewrite(torch::jit::Graph& graph, const Match& m) {
  Node* bn = m.bn;
  Value* other = m.add->input(1 - m.bn_operand);
  Value* divisor = m.div->input(1);
  const bool eval = constantBool(bn->input(5)) == std::optional<bool>(false);
  Value* silu = nullptr;
  {
    torch::jit::WithInsertPoint guard(m.swish);
    silu = graph.insertConstant(m.sigmoid == nullptr);
  }
  Node* fused = eval
      ? replaceWithFusedOp(
            graph, "torchfuse::custom_batch_norm_add_div_swish_eval",
            {bn->input(0), bn->input(1), bn->input(2), bn->input(3),
             bn->input(4), bn->input(7), other, divisor, silu},
            m.swish)
      : replaceWithFusedOp(
            graph, "torchfuse::custom_batch_norm_add_div_swish",
            {bn->input(0), bn->input(1), bn->input(2), bn->input(3),
             bn->input(4), bn->input(5), bn->input(6), bn->input(7), other,
             divisor, silu},
            m.swish);
  if (fused == nullptr) {
    silu->node()->destroy();
    return false;
  }
  m.swish->destroy();
  if (m.sigmoid != nullptr) {
    m.sigmoid->destroy();
  }
  m.div->destroy();
  m.add->destroy();
  bn->destroy();
  return true;
}

} // namespace

int64_t FuseBatchNormAddDivSwish(std::shared_ptr<torch::jit::Graph>& graph) {
  const int64_t fused = fuseAll(graph, matchAt, rewrite);
  GRAPH_DUMP("After FuseBatchNormAddDivSwish", graph);
  return fused;
}

} // namespace torchfuse::passes
