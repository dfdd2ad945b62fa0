// FuseLinearAddRelu: out = relu(linear(x, W, b) + alpha * other)
//   => torchfuse::custom_linear_add_relu(x, W, b, other, alpha)
//
// Matched forms (after Inline + ConstantPropagation, any block):
//   relu(add(lin, other, alpha))      any int/float alpha (it scales other)
//   relu(add(other, lin, 1))          lin as the scaled operand: alpha == 1 only
//   add_ / relu_                      only on the chain's fresh intermediate
//   bias None, a Tensor or a Tensor?
// Excluded: `lin + 1.0` (add.Scalar), `other.add_(lin)` (writes a live
// tensor), `other + alpha * lin` with alpha != 1, and any chain whose
// intermediate has another use (returned intermediates included).

#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/jit_log.h>

#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

struct Match {
  Node* linear;
  Node* add;
  Node* relu;
  size_t linear_operand;  // 0: linear output is add's self; 1: its other
};

std::optional<Match> matchAt(Node* relu, const AliasDb& db) {
  if (!isRelu(relu)) {
    return std::nullopt;
  }
  Value* sum = relu->input(0);
  Node* add = sum->node();
  if (!isTensorAdd(add) || !hasSingleUse(sum, relu) ||
      !notInPlaceOnLiveTensor(relu, sum)) {
    return std::nullopt;
  }
  for (size_t i : {0, 1}) {
    Value* lin = add->input(i);
    Node* linear = lin->node();
    if (!isLinear(linear) || !hasSingleUse(lin, add) ||
        !inSameBlock({linear, add, relu})) {
      continue;
    }
    // NB: alpha scales add's second operand; with the linear output there,
    // the op (which scales `other`) computes something else unless alpha == 1.
    if (i == 1 && !alphaIsOne(add->input(2))) {
      continue;
    }
    // NB: add_ is accepted only when it writes the linear output itself.
    if (!notInPlaceOnLiveTensor(add, lin)) {
      continue;
    }
    if (!noInterveningWrites(
            db, linear, relu,
            {linear->input(0), linear->input(1), linear->input(2),
             add->input(1 - i)})) {
      continue;
    }
    return Match{linear, add, relu, i};
  }
  return std::nullopt;
}

bool rewrite(torch::jit::Graph& graph, const Match& m) {
  Value* other = m.add->input(1 - m.linear_operand);
  Node* fused = replaceWithFusedOp(
      graph, "torchfuse::custom_linear_add_relu",
      {m.linear->input(0), m.linear->input(1), m.linear->input(2), other,
       m.add->input(2)},
      m.relu);
  if (fused == nullptr) {
    return false;
  }
  m.relu->destroy();
  m.add->destroy();
  m.linear->destroy();
  return true;
}

} // namespace

int64_t FuseLinearAddRelu(std::shared_ptr<torch::jit::Graph>& graph) {
  const int64_t fused = fuseAll(graph, matchAt, rewrite);
  GRAPH_DUMP("After FuseLinearAddRelu", graph);
  return fused;
}

} // namespace torchfuse::passes
