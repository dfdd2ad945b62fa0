// FuseConvReluAdd: out = relu(conv(x, W, b, stride, padding, dilation, groups))
//                        + alpha * other
//   => torchfuse::custom_conv_relu_add(x, W, b, stride, padding, dilation,
//                                      groups, other, alpha)
//
// Matched forms (after Inline + ConstantPropagation + Canonicalize, any block):
//   conv1d / conv2d / conv3d with int[] padding (traced _convolution is
//   turned into these by Canonicalize)
//   add(r, other, alpha)     r = relu(conv): any int/float alpha
// Excluded: `other + r` (chainIsAddSelf: the output would take other's
// strides), relu_ (reluWritesConvOutput), conv*d.padding
// (padding='same'/'valid', a str), `r + 1.0` (add.Scalar), add_ (it keeps
// r's dtype where the op promotes: addPromotes), and chains whose
// intermediates have other uses.

#include <torch/csrc/jit/jit_log.h>

#include "passes/chain_matcher.h"
#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

// relu_ keeps the conv output's strides where its layout is ambiguous (a
// size-1 dimension), and the add follows them; the op's relu is out of place
// and picks its own (withEagerStrides).  FuseConvAddAct takes conv -> relu_,
// its activation naming the spelling, and leaves the add.
bool reluWritesConvOutput(const Chain& c) {
  return isInPlaceSpelling(c.nodes[1]);
}

} // namespace

int64_t FuseConvReluAdd(std::shared_ptr<torch::jit::Graph>& graph) {
  // conv -> relu -> add
  const std::vector<Link> links = {
      {[](const Node* n) { return isIntListConv(n); }, {}},
      {[](const Node* n) { return isRelu(n); }, {0}},
      {[](const Node* n) { return addPromotes(n); }, {0, 1}},
  };
  const int64_t fused = fuseChains(
      graph, links, "torchfuse::custom_conv_relu_add",
      [](const Chain& c, const AliasDb&) {
        return chainIsAddSelf(c, 2) && !reluWritesConvOutput(c);
      },
      [](const Chain& c) {
        Node* conv = c.nodes[0];
        std::vector<Value*> inputs(conv->inputs().begin(), conv->inputs().end());
        inputs.push_back(c.otherOperand(2));
        inputs.push_back(c.nodes[2]->input(2));
        return inputs;
      });
  GRAPH_DUMP("After FuseConvReluAdd", graph);
  return fused;
}

} // namespace torchfuse::passes
