// FuseConvActMaxPool: out = max_pool2d(act(conv(x, W, b, stride, padding,
//                                       dilation, groups)), kernel_size,
//                                       pool_stride, pool_padding,
//                                       pool_dilation, ceil_mode)
//   => torchfuse::custom_conv_act_max_pool(x, W, b, stride, padding,
//        dilation, groups, activation, activation_args, kernel_size,
//        pool_stride, pool_padding, pool_dilation, ceil_mode)
//
// Matched forms, longest first (after Inline + ConstantPropagation +
// Canonicalize, in any block; a frozen graph has its BN folded into W, b):
//   conv -> act -> max_pool2d   vgg's conv-relu-pool, resnet's stem
//   conv -> max_pool2d
// conv is conv{1,2,3}d with int[] padding; act as custom_conv_add_act takes
// it (isFusableActivation, in- or out-of-place, constant arguments:
// activationArgumentsAreConstant); max_pool2d without indices (isMaxPool2d).
// Excluded: an add between conv and act (custom_conv_add_act's chain, whose
// output the pool reads unfused), conv*d.padding, max_pool2d_with_indices,
// and chains whose intermediates have other uses.
// NB: runs before FuseConvAddAct (passes/registry.cpp), which would take the
// conv -> act link and leave the pool on its own.

#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>

#include "passes/chain_matcher.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

constexpr const char* kOp = "torchfuse::custom_conv_act_max_pool";

const Link kConv = {[](const Node* n) { return isIntListConv(n); }, {}};
const Link kAct = {[](const Node* n) { return isFusableActivation(n); }, {0}};
const Link kPool = {[](const Node* n) { return isMaxPool2d(n); }, {0}};

// The op's inputs for a chain of conv, then the activation at `act` (or 0
// for none), then the pool.
std::vector<Value*> opInputs(const Chain& c, size_t act) {
  Node* conv = c.head();
  Node* pool = c.tail();
  auto& graph = *conv->owningGraph();
  torch::jit::WithInsertPoint guard(pool);
  std::vector<Value*> inputs(conv->inputs().begin(), conv->inputs().end());
  ActivationSpec spec{"none", {}};
  if (act > 0) {
    spec = *activationSpec(c.nodes[act]);
  }
  inputs.push_back(graph.insertConstant(spec.name));
  inputs.push_back(graph.insertConstant(spec.args));
  inputs.insert(inputs.end(), pool->inputs().begin() + 1, pool->inputs().end());
  return inputs;
}

int64_t fuseForm(std::shared_ptr<torch::jit::Graph>& graph, size_t act) {
  std::vector<Link> links = {kConv};
  if (act > 0) {
    links.push_back(kAct);
  }
  links.push_back(kPool);
  return fuseChains(
      graph, links, kOp,
      [&](const Chain& c, const AliasDb&) {
        return act == 0 || activationArgumentsAreConstant(c.nodes[act]);
      },
      [&](const Chain& c) { return opInputs(c, act); });
}

} // namespace

int64_t FuseConvActMaxPool(std::shared_ptr<torch::jit::Graph>& graph) {
  int64_t fused = fuseForm(graph, /*act=*/1);
  fused += fuseForm(graph, /*act=*/0);
  GRAPH_DUMP("After FuseConvActMaxPool", graph);
  return fused;
}

} // namespace torchfuse::passes
