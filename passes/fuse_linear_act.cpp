// FuseLinearAct: out = act(linear(x, W, b) [+ residual])
//   => torchfuse::custom_linear_act(x, W, b, activation, activation_args
//        [, other, alpha, promote, other_first])
//
// Matched forms (after Inline + ConstantPropagation + Canonicalize, any
// block), longest first:
//   linear -> add/add_ -> act   the residual of an MLP block, then act
//   linear -> add/add_          a transformer block's `x + mlp(x)`
//   linear -> act          bias None, a Tensor or a Tensor?
//   matmul(x, Wt) -> act   what optimize_for_inference's FrozenLinearTranspose
//                          leaves of a linear without bias: Wt = Wᵀ stored as
//                          a constant; the op takes W = Wtᵀ, a new contiguous
//                          constant, computed here.
// act (isFusableActivation, in- or out-of-place): relu, relu6 (hardtanh(0,
// 6)), hardtanh, silu, hardswish, hardsigmoid, sigmoid, gelu ('none' or
// 'tanh'), leaky_relu, with constant scalar arguments
// (activationArgumentsAreConstant).
// add is add.Tensor with any alpha: add(y, other) (promote), y.add_(other)
// into the fresh linear output (!promote), or add(other, y) (other_first;
// the op computes it as the graph spells it, so the result keeps the
// strides add gives it from `other`).  other.add_(y) writes `other`: not
// matched (notInPlaceOnLiveTensor).
// Excluded: a linear with nothing fused after it (no pass to save); linear
// -> add -> relu, which FuseLinearAddRelu takes first (passes/registry.cpp);
// linear -> add whose sum a layer_norm reads (sumIsLayerNormed: BERT's
// dense -> add -> LayerNorm stays FuseAddLayerNorm's, measured there);
// chains whose intermediates have other uses (returned ones included); an
// in-place activation on a tensor live elsewhere; activations with runtime
// arguments (an unfrozen module attribute) or a gelu `approximate` that is
// not a constant 'none' / 'tanh'; matmul with anything but a constant 2-D
// second operand (matmulWeightIsConstantMatrix).
// NB: FrozenLinearTranspose's form of a linear with bias, matmul(x, Wt) ->
// add(., b, 1) -> act, is left: it is not a linear under autocast.  There
// the matmul runs in float16/bfloat16 and the add promotes it with the
// float32 constant bias to float32, while linear (and the op) casts the bias
// down and returns float16/bfloat16; the op cannot tell the two apart.
// NB: the op's Autograd kernel records the original ATen chain, so nothing
// it saves differs from eager's (no notWrittenAfter condition).

#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>

#include "passes/chain_matcher.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

constexpr const char* kOp = "torchfuse::custom_linear_act";

bool isMatmul(const Node* n) {
  return hasSchema(n, "aten::matmul", "") && n->inputs().size() == 2 && isTensor(n->input(0)) &&
      isTensor(n->input(1));
}

// matmul(x, Wt) is linear(x, Wtᵀ) for every x when Wt is a 2-D constant.
bool matmulWeightIsConstantMatrix(const Node* matmul) {
  const auto w = constantTensor(matmul->input(1));
  return w && w->dim() == 2 && w->layout() == at::kStrided && !w->is_quantized() &&
      !w->requires_grad();
}

const Link kLinear = {[](const Node* n) { return isLinear(n); }, {}};
const Link kMatmul = {[](const Node* n) { return isMatmul(n); }, {}};
const Link kAdd = {[](const Node* n) { return isTensorAdd(n); }, {0, 1}};
const Link kAct = {[](const Node* n) { return isFusableActivation(n); }, {0}};

// The op's activation and activation_args: those of `act`, or "none" where
// the chain has no activation (nullptr).
void appendActivation(std::vector<Value*>& inputs, const Node* act, torch::jit::Graph& g) {
  const auto spec = act != nullptr ? *activationSpec(act) : ActivationSpec{"none", {}};
  inputs.push_back(g.insertConstant(spec.name));
  inputs.push_back(g.insertConstant(spec.args));
}

// The op's residual arguments where there is none: other None, alpha 1,
// promote, not other_first (the schema's defaults; the node takes every
// argument).
void appendNoResidual(std::vector<Value*>& inputs, torch::jit::Graph& g) {
  inputs.push_back(g.insertConstant(c10::IValue()));
  inputs.push_back(g.insertConstant(1));
  inputs.push_back(g.insertConstant(true));
  inputs.push_back(g.insertConstant(false));
}

// The sum of link k has a layer_norm reader: FuseAddLayerNorm's chain.
bool sumIsLayerNormed(const Chain& c, size_t k) {
  for (const auto& use : c.nodes.at(k)->output()->uses()) {
    if (isLayerNorm(use.user) && use.offset == 0) {
      return true;
    }
  }
  return false;
}

// The form linear [-> add at link `add`] [-> act at link `act`]; 0: absent.
int64_t fuseLinear(std::shared_ptr<torch::jit::Graph>& graph, size_t add, size_t act) {
  std::vector<Link> links = {kLinear};
  if (add > 0) {
    links.push_back(kAdd);
  }
  if (act > 0) {
    links.push_back(kAct);
  }
  return fuseChains(
      graph, links, kOp,
      [&](const Chain& c, const AliasDb&) {
        const bool add_ok = add == 0 ||
            ((chainIsAddSelf(c, add) || addPromotes(c.nodes[add])) && !sumIsLayerNormed(c, add));
        return add_ok && (act == 0 || activationArgumentsAreConstant(c.nodes[act]));
      },
      [&](const Chain& c) {
        Node* linear = c.head();
        auto& g = *linear->owningGraph();
        torch::jit::WithInsertPoint guard(c.tail());
        std::vector<Value*> inputs = {linear->input(0), linear->input(1), linear->input(2)};
        appendActivation(inputs, act > 0 ? c.nodes[act] : nullptr, g);
        if (add > 0) {
          Node* n = c.nodes[add];
          inputs.push_back(c.otherOperand(add));
          inputs.push_back(n->input(2));
          inputs.push_back(g.insertConstant(addPromotes(n)));
          inputs.push_back(g.insertConstant(!chainIsAddSelf(c, add)));
        } else {
          appendNoResidual(inputs, g);
        }
        return inputs;
      });
}

// FrozenLinearTranspose's form of a linear without bias.
int64_t fuseMatmul(std::shared_ptr<torch::jit::Graph>& graph) {
  return fuseChains(
      graph, {kMatmul, kAct}, kOp,
      [](const Chain& c, const AliasDb&) {
        return matmulWeightIsConstantMatrix(c.head()) && activationArgumentsAreConstant(c.tail());
      },
      [](const Chain& c) {
        Node* matmul = c.head();
        auto& g = *matmul->owningGraph();
        torch::jit::WithInsertPoint guard(c.tail());
        // NB: W = Wtᵀ, contiguous: the layout linear's weight has.
        const auto w = constantTensor(matmul->input(1))->t().contiguous();
        std::vector<Value*> inputs = {
            matmul->input(0), g.insertConstant(w), g.insertConstant(c10::IValue())};
        appendActivation(inputs, c.tail(), g);
        appendNoResidual(inputs, g);
        return inputs;
      });
}

} // namespace

int64_t FuseLinearAct(std::shared_ptr<torch::jit::Graph>& graph) {
  int64_t fused = fuseLinear(graph, 1, 2);
  fused += fuseLinear(graph, 1, 0);
  fused += fuseLinear(graph, 0, 1);
  fused += fuseMatmul(graph);
  GRAPH_DUMP("After FuseLinearAct", graph);
  return fused;
}

} // namespace torchfuse::passes
