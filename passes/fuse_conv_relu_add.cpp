// FuseConvReluAdd: out = relu(conv(x, W, b, stride, padding, dilation, groups))
//                        + alpha * other
//   => torchfuse::custom_conv_relu_add(x, W, b, stride, padding, dilation,
//                                      groups, other, alpha)
//
// Matched forms (after Inline + ConstantPropagation + Canonicalize, any block):
//   conv1d / conv2d / conv3d with int[] padding (traced _convolution is
//   turned into these by Canonicalize)
//   add(r, other, alpha)     r = relu(conv): any int/float alpha
//   add(other, r, 1)         r as the scaled operand: alpha == 1 only
//   relu_ / add_             only on the chain's fresh intermediate
// Excluded: conv*d.padding (padding='same'/'valid', a str), `r + 1.0`
// (add.Scalar), `other.add_(r)`, and chains whose intermediates have other
// uses.

#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/jit_log.h>

#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

struct Match {
  Node* conv;
  Node* relu;
  Node* add;
  size_t relu_operand;
};

std::optional<Match> matchAt(Node* add, const AliasDb& db) {
  if (!isTensorAdd(add)) {
    return std::nullopt;
  }
  for (size_t i : {0, 1}) {
    Value* r = add->input(i);
    Node* relu = r->node();
    if (!isRelu(relu) || !hasSingleUse(r, add)) {
      continue;
    }
    Value* c = relu->input(0);
    Node* conv = c->node();
    if (!isIntListConv(conv) || !hasSingleUse(c, relu) ||
        !inSameBlock({conv, relu, add}) || !notInPlaceOnLiveTensor(relu, c)) {
      continue;
    }
    if (i == 1 && !alphaIsOne(add->input(2))) {
      continue;
    }
    if (!notInPlaceOnLiveTensor(add, r)) {
      continue;
    }
    if (!noInterveningWrites(
            db, conv, add,
            {conv->input(0), conv->input(1), conv->input(2),
             add->input(1 - i)})) {
      continue;
    }
    return Match{conv, relu, add, i};
  }
  return std::nullopt;
}

bool rewrite(torch::jit::Graph& graph, const Match& m) {
  std::vector<Value*> inputs(m.conv->inputs().begin(), m.conv->inputs().end());
  inputs.push_back(m.add->input(1 - m.relu_operand));
  inputs.push_back(m.add->input(2));
  Node* fused = replaceWithFusedOp(
      graph, "torchfuse::custom_conv_relu_add", inputs, m.add);
  if (fused == nullptr) {
    return false;
  }
  m.add->destroy();
  m.relu->destroy();
  m.conv->destroy();
  return true;
}

} // namespace

int64_t FuseConvReluAdd(std::shared_ptr<torch::jit::Graph>& graph) {
  const int64_t fused = fuseAll(graph, matchAt, rewrite);
  GRAPH_DUMP("After FuseConvReluAdd", graph);
  return fused;
}

} // namespace torchfuse::passes
