// FuseLinearAct: out = act(linear(x, W, b))
//   => torchfuse::custom_linear_act(x, W, b, activation, activation_args)
//
// Matched forms (after Inline + ConstantPropagation + Canonicalize, any
// block):
//   linear -> act          bias None, a Tensor or a Tensor?
//   matmul(x, Wt) -> act   what optimize_for_inference's FrozenLinearTranspose
//                          leaves of a linear without bias: Wt = Wᵀ stored as
//                          a constant; the op takes W = Wtᵀ, a new contiguous
//                          constant, computed here.
// act (isFusableActivation, in- or out-of-place): relu, relu6 (hardtanh(0,
// 6)), hardtanh, silu, hardswish, hardsigmoid, sigmoid, gelu ('none' or
// 'tanh'), leaky_relu, with constant scalar arguments
// (activationArgumentsAreConstant).
// Excluded: a linear with nothing fused after it (no pass to save); linear
// -> add -> relu, which FuseLinearAddRelu takes first (passes/registry.cpp);
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
const Link kAct = {[](const Node* n) { return isFusableActivation(n); }, {0}};

std::vector<Value*> activationInputs(const Chain& c, torch::jit::Graph& graph) {
  const auto spec = *activationSpec(c.tail());
  return {graph.insertConstant(spec.name), graph.insertConstant(spec.args)};
}

int64_t fuseLinear(std::shared_ptr<torch::jit::Graph>& graph) {
  return fuseChains(
      graph, {kLinear, kAct}, kOp,
      [](const Chain& c, const AliasDb&) { return activationArgumentsAreConstant(c.tail()); },
      [](const Chain& c) {
        Node* linear = c.head();
        torch::jit::WithInsertPoint guard(c.tail());
        std::vector<Value*> inputs = {linear->input(0), linear->input(1), linear->input(2)};
        for (Value* v : activationInputs(c, *linear->owningGraph())) {
          inputs.push_back(v);
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
        for (Value* v : activationInputs(c, g)) {
          inputs.push_back(v);
        }
        return inputs;
      });
}

} // namespace

int64_t FuseLinearAct(std::shared_ptr<torch::jit::Graph>& graph) {
  int64_t fused = fuseLinear(graph);
  fused += fuseMatmul(graph);
  GRAPH_DUMP("After FuseLinearAct", graph);
  return fused;
}

} // namespace torchfuse::passes
