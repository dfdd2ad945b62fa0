// FuseConvAddAct: out = act(conv(x, W, b, stride, padding, dilation, groups)
//                           + alpha * other)
//   => torchfuse::custom_conv_add_act(x, W, b, stride, padding, dilation,
//        groups, other, alpha, promote, activation, activation_args)
//
// Matched forms, longest first (after Inline + ConstantPropagation +
// Canonicalize, in any block; a frozen graph has its BN folded into W, b):
//   conv -> add/add_ -> act   resnet's `out += identity; relu(out)`
//   conv -> act               conv-bn-act blocks
//   conv -> add/add_          projections (no activation)
// conv is conv{1,2,3}d with int[] padding; add is add.Tensor: out of place
// (promote=true: the result takes add's promoted dtype) or add_ into the
// fresh conv output (promote=false: it keeps the conv output's dtype), with
// the conv output as add's first operand (chainIsAddSelf), any alpha.  act (isFusableActivation,
// in- or out-of-place): relu, relu6 (hardtanh(0, 6)), hardtanh, silu, hardswish, hardsigmoid,
// sigmoid, gelu, leaky_relu, with constant scalar arguments (activationArgumentsAreConstant).
// Excluded: a conv with nothing fused after it (no pass to save), add.Scalar
// (`conv + 1.0`), conv*d.padding (padding='same'/'valid'), a batch_norm
// between conv and the rest (BN in training, or unfrozen: not folded), and
// chains whose intermediates have other uses.
// NB: runs after the seed chains (passes/registry.cpp), so that conv ->
// relu -> add stays custom_conv_relu_add instead of becoming conv -> relu
// here and an unfused add, and the add of batch_norm -> add -> div -> swish
// stays that chain's.

#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>

#include "passes/chain_matcher.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

constexpr const char* kOp = "torchfuse::custom_conv_add_act";

const Link kConv = {[](const Node* n) { return isIntListConv(n); }, {}};
const Link kAdd = {[](const Node* n) { return isTensorAdd(n); }, {0, 1}}; // chainIsAddSelf
const Link kAct = {[](const Node* n) { return isFusableActivation(n); }, {0}};

// The op's inputs for a chain of conv, then `add` (index, or 0 for none),
// then `act` (index, or 0 for none).
std::vector<Value*> opInputs(const Chain& c, size_t add, size_t act) {
  Node* conv = c.nodes[0];
  auto& graph = *conv->owningGraph();
  torch::jit::WithInsertPoint guard(c.tail());
  std::vector<Value*> inputs(conv->inputs().begin(), conv->inputs().end());
  if (add > 0) {
    Node* n = c.nodes[add];
    inputs.push_back(c.otherOperand(add));
    inputs.push_back(n->input(2));
    inputs.push_back(graph.insertConstant(n->kind() == c10::Symbol::aten("add")));
  } else {
    inputs.push_back(graph.insertConstant(c10::IValue()));
    inputs.push_back(graph.insertConstant(1));
    inputs.push_back(graph.insertConstant(false));
  }
  ActivationSpec spec{"none", {}};
  if (act > 0) {
    spec = *activationSpec(c.nodes[act]);
  }
  inputs.push_back(graph.insertConstant(spec.name));
  inputs.push_back(graph.insertConstant(spec.args));
  return inputs;
}

int64_t fuseForm(std::shared_ptr<torch::jit::Graph>& graph, size_t add, size_t act) {
  std::vector<Link> links = {kConv};
  if (add > 0) {
    links.push_back(kAdd);
  }
  if (act > 0) {
    links.push_back(kAct);
  }
  return fuseChains(
      graph, links, kOp,
      [&](const Chain& c, const AliasDb&) {
        return (add == 0 || chainIsAddSelf(c, add)) &&
            (act == 0 || activationArgumentsAreConstant(c.nodes[act]));
      },
      [&](const Chain& c) { return opInputs(c, add, act); });
}

} // namespace

int64_t FuseConvAddAct(std::shared_ptr<torch::jit::Graph>& graph) {
  int64_t fused = fuseForm(graph, /*add=*/1, /*act=*/2);
  fused += fuseForm(graph, /*add=*/0, /*act=*/1);
  fused += fuseForm(graph, /*add=*/1, /*act=*/0);
  GRAPH_DUMP("After FuseConvAddAct", graph);
  return fused;
}

} // namespace torchfuse::passes
