// FuseLinearAct: out = act(linear(x, W, b))
//   => torchfuse::custom_linear_act(x, W, b, activation, activation_args)
//
// Matched forms (after Inline + ConstantPropagation + Canonicalize, any
// block):
//   linear -> act                  bias None, a Tensor or a Tensor?
//   matmul(x, Wt) -> add(., b, 1) -> act
//   matmul(x, Wt) -> act           what optimize_for_inference's
//                                  FrozenLinearTranspose leaves of a linear
//                                  (with and without bias): Wt = Wᵀ stored
//                                  as a constant; the op takes W = Wtᵀ, a new
//                                  contiguous constant, computed here.
// act (isFusableActivation, in- or out-of-place): relu, relu6 (hardtanh(0,
// 6)), hardtanh, silu, hardswish, hardsigmoid, sigmoid, gelu ('none' or
// 'tanh'), leaky_relu, with constant scalar arguments
// (activationArgumentsAreConstant).
// Excluded: a linear with nothing fused after it (no pass to save); linear
// -> add -> relu, which FuseLinearAddRelu takes first (passes/registry.cpp);
// chains whose intermediates have other uses (returned ones included); an
// in-place activation on a tensor live elsewhere; activations with runtime
// arguments (an unfrozen module attribute) or a gelu `approximate` that is
// not a constant 'none' / 'tanh'.  The matmul form only where it is a
// linear for every input: Wt a constant 2-D tensor
// (matmulWeightIsConstantMatrix), b a constant 1-D tensor of Wt.size(1)
// elements of Wt's dtype and device, alpha the constant 1, the matmul output
// add's self (biasIsConstantFeatureVector): the add then neither promotes
// nor broadcasts beyond the matmul's shape.
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
  const auto* schema = n->maybeSchema();
  return schema != nullptr && schema->name() == "aten::matmul" &&
      schema->overload_name().empty() && n->inputs().size() == 2 && isTensor(n->input(0)) &&
      isTensor(n->input(1));
}

std::optional<at::Tensor> constantTensor(const Value* v) {
  const auto iv = torch::jit::toIValue(v);
  if (!iv || !iv->isTensor()) {
    return std::nullopt;
  }
  return iv->toTensor();
}

// matmul(x, Wt) is linear(x, Wtᵀ) for every x when Wt is a 2-D constant.
bool matmulWeightIsConstantMatrix(const Node* matmul) {
  const auto w = constantTensor(matmul->input(1));
  return w && w->defined() && w->dim() == 2 && w->layout() == at::kStrided &&
      !w->is_quantized() && !w->requires_grad();
}

// add(matmul(x, Wt), b, 1) is linear's bias: b a constant [Wt.size(1)] of
// Wt's dtype and device, the matmul output add's self.
bool biasIsConstantFeatureVector(const Chain& c) {
  Node* add = c.nodes[1];
  const auto w = constantTensor(c.nodes[0]->input(1));
  const auto b = constantTensor(c.otherOperand(1));
  return chainIsAddSelf(c, 1) && alphaIsOne(add->input(2)) && w && b && b->defined() &&
      b->dim() == 1 && b->size(0) == w->size(1) && b->scalar_type() == w->scalar_type() &&
      b->device() == w->device() && b->layout() == at::kStrided && !b->requires_grad();
}

const Link kLinear = {[](const Node* n) { return isLinear(n); }, {}};
const Link kMatmul = {[](const Node* n) { return isMatmul(n); }, {}};
const Link kAdd = {[](const Node* n) { return addPromotes(n); }, {0, 1}};
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

// The FrozenLinearTranspose forms, with (`bias`) or without the add.
int64_t fuseMatmul(std::shared_ptr<torch::jit::Graph>& graph, bool bias) {
  std::vector<Link> links = {kMatmul};
  if (bias) {
    links.push_back(kAdd);
  }
  links.push_back(kAct);
  return fuseChains(
      graph, links, kOp,
      [bias](const Chain& c, const AliasDb&) {
        return matmulWeightIsConstantMatrix(c.head()) &&
            (!bias || biasIsConstantFeatureVector(c)) &&
            activationArgumentsAreConstant(c.tail());
      },
      [bias](const Chain& c) {
        Node* matmul = c.head();
        auto& g = *matmul->owningGraph();
        torch::jit::WithInsertPoint guard(c.tail());
        // NB: W = Wtᵀ, contiguous: the layout linear's weight has.
        const auto w = constantTensor(matmul->input(1))->t().contiguous();
        std::vector<Value*> inputs = {
            matmul->input(0), g.insertConstant(w),
            bias ? c.otherOperand(1) : g.insertConstant(c10::IValue())};
        for (Value* v : activationInputs(c, g)) {
          inputs.push_back(v);
        }
        return inputs;
      });
}

} // namespace

int64_t FuseLinearAct(std::shared_ptr<torch::jit::Graph>& graph) {
  int64_t fused = fuseLinear(graph);
  fused += fuseMatmul(graph, /*bias=*/true);
  fused += fuseMatmul(graph, /*bias=*/false);
  GRAPH_DUMP("After FuseLinearAct", graph);
  return fused;
}

} // namespace torchfuse::passes
