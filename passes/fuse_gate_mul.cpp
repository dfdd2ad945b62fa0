// FuseGateMul: out = act(gate) * input, the gate of a squeeze-and-excitation
// block
//   => torchfuse::custom_gate_mul(input, gate, activation, gate_first)
//
// Matched form (after Inline + ConstantPropagation + Canonicalize, any
// block): act -> mul, act aten::sigmoid or aten::hardsigmoid (out of
// place), mul aten::mul.Tensor (out of place) with the gate as either
// operand (gate_first: as self, so that the op multiplies in the same
// order).
// Excluded:
//   - a gate that is not a squeeze of the tensor it multiplies
//     (gateSqueezesInput): swish's t * sigmoid(t), a GLU's same-shape gate.
//     There NNC fuses the pair itself, and the op's gain, a vectorized
//     broadcast over H and W, does not arise;
//   - an activated gate read elsewhere (the chain matcher's single use);
//   - in-place forms (sigmoid_, mul_): they keep the written tensor's
//     strides, which the op does not reproduce.
// NB: before conv_add_act (passes/registry.cpp), which would take the
// gate's activation into the last excitation conv's epilogue and leave the
// broadcast multiply to ATen.

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "passes/chain_matcher.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

constexpr const char* kOp = "torchfuse::custom_gate_mul";

bool isGateActivation(const Node* n) {
  return isSigmoid(n) || (hasSchema(n, "aten::hardsigmoid", "") && isTensor(n->input(0)));
}

// constantInts, or a prim::ListConstruct of constant ints (a graph
// ConstantPropagation has not folded).
std::optional<std::vector<int64_t>> intsOf(const Value* v) {
  if (auto ints = constantInts(v)) {
    return ints;
  }
  if (v->node()->kind() != c10::prim::ListConstruct) {
    return std::nullopt;
  }
  std::vector<int64_t> out;
  for (const Value* e : v->node()->inputs()) {
    const auto i = torch::jit::constant_as<int64_t>(e);
    if (!i) {
      return std::nullopt;
    }
    out.push_back(*i);
  }
  return out;
}

bool allOnes(const Value* v) {
  const auto sizes = intsOf(v);
  return sizes && !sizes->empty() &&
      std::all_of(sizes->begin(), sizes->end(), [](int64_t s) { return s == 1; });
}

// mean over the last two dims of a 4-D tensor, kept: timm's squeeze.
bool isSpatialMean(const Node* n) {
  if (!hasSchema(n, "aten::mean", "dim") || !isTensor(n->input(0))) {
    return false;
  }
  auto d = intsOf(n->input(1));
  const auto keep = constantBool(n->input(2));
  const auto dtype = torch::jit::toIValue(n->input(3));
  if (!d || !keep || !*keep || !dtype || !dtype->isNone()) {
    return false;
  }
  std::sort(d->begin(), d->end());
  return *d == std::vector<int64_t>{2, 3} || *d == std::vector<int64_t>{-2, -1};
}

// adaptive_avg_pool2d(x, 1) (torchvision's squeeze) or the mean above.
bool isSpatialSqueeze(const Node* n) {
  return (hasSchema(n, "aten::adaptive_avg_pool2d", "") && isTensor(n->input(0)) &&
          allOnes(n->input(1))) ||
      isSpatialMean(n);
}

// The gate's pre-activation comes from a spatial squeeze of the very tensor
// the gate multiplies, through convolutions and activations only (the
// excitation's conv -> act -> conv).
bool gateSqueezesInput(const Chain& c) {
  constexpr int kMaxHops = 8;
  const Value* input = c.otherOperand(1);
  const Value* v = c.head()->input(0);
  for (int hop = 0; hop < kMaxHops; ++hop) {
    const Node* n = v->node();
    if (isSpatialSqueeze(n)) {
      return n->input(0) == input;
    }
    if (!isIntListConv(n) && !isFusableActivation(n)) {
      return false;
    }
    v = n->input(0);
  }
  return false;
}

const Link kAct = {[](const Node* n) { return isGateActivation(n); }, {}};
const Link kMul = {[](const Node* n) { return isTensorMul(n); }, {0, 1}};

} // namespace

int64_t FuseGateMul(std::shared_ptr<torch::jit::Graph>& graph) {
  const int64_t fused = fuseChains(
      graph, {kAct, kMul}, kOp, [](const Chain& c, const AliasDb&) { return gateSqueezesInput(c); },
      [](const Chain& c) {
        Node* act = c.head();
        auto& g = *act->owningGraph();
        torch::jit::WithInsertPoint guard(c.tail());
        const bool sigmoid = isSigmoid(act);
        return std::vector<Value*>{
            c.otherOperand(1), act->input(0), g.insertConstant(sigmoid ? "sigmoid" : "hardsigmoid"),
            g.insertConstant(c.operand[1] == 0)};
      });
  GRAPH_DUMP("After FuseGateMul", graph);
  return fused;
}

} // namespace torchfuse::passes
