// FuseLinearAddRelu: out = relu(linear(x, W, b) + alpha * other)
//   => torchfuse::custom_linear_add_relu(x, W, b, other, alpha)
//
// Matched forms (after Inline + ConstantPropagation, any block):
//   relu(add(lin, other, alpha))      any int/float alpha (it scales other)
//   relu_                             only on the chain's fresh intermediate
//   bias None, a Tensor or a Tensor?
// Excluded: `other + lin` (chainIsAddSelf: the output would take other's
// strides), `lin + 1.0` (add.Scalar), add_ in either form (it keeps
// self's dtype where the op promotes: addPromotes), and any chain whose intermediate has another
// use (returned intermediates included), and chains whose input may be written after them
// (notWrittenAfter).

#include <torch/csrc/jit/jit_log.h>

#include "passes/chain_matcher.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {

int64_t FuseLinearAddRelu(std::shared_ptr<torch::jit::Graph>& graph) {
  // linear -> add (either operand) -> relu
  const std::vector<Link> links = {
      {[](const Node* n) { return isLinear(n); }, {}},
      {[](const Node* n) { return addPromotes(n); }, {0, 1}},
      {[](const Node* n) { return isRelu(n); }, {0}},
  };
  const int64_t fused = fuseChains(
      graph, links, "torchfuse::custom_linear_add_relu",
      [](const Chain& c, const AliasDb& db) {
        // NB: the op saves its input for the backward;
        // aten::linear saves a copy of a non-contiguous input of more than
        // two dimensions (matmul's reshape), so a write to the input after
        // the chain leaves the unfused chain's backward alone.
        return chainIsAddSelf(c, 1) && notWrittenAfter(db, c.nodes[0], {c.nodes[0]->input(0)});
      },
      [](const Chain& c) -> std::vector<Value*> {
        Node* linear = c.nodes[0];
        return {linear->input(0), linear->input(1), linear->input(2),
                c.otherOperand(1), c.nodes[1]->input(2)};
      });
  GRAPH_DUMP("After FuseLinearAddRelu", graph);
  return fused;
}

} // namespace torchfuse::passes
