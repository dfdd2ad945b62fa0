#pragma once

// The shared chain matcher: a fusion pass names the links of its chain and
// its own predicates; the matcher checks what every chain needs and does the
// rewrite bookkeeping.
//
// A chain is a sequence of nodes, head first, each reading the previous
// node's output.  Every chain the matcher returns satisfies:
//   - each intermediate has exactly one use, the next link (hasSingleUse);
//   - every node sits in one block (inSameBlock);
//   - an in-place link writes only the fresh intermediate it reads
//     (notInPlaceOnLiveTensor);
// and fuseChains adds:
//   - no node between head and tail writes to anything that may alias the
//     chain's inputs from outside it (noInterveningWrites): the fused op
//     reads them at the tail's position.

#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/ir/ir.h>

#include <functional>
#include <memory>
#include <vector>

#include "passes/match_filters.h"

namespace torchfuse::passes {

// One link of a chain: the node's kind and overload, and which of its
// inputs may carry the previous link's output (empty for the head).
struct Link {
  std::function<bool(const Node*)> is;
  std::vector<size_t> operands;
};

// A matched chain.  nodes[k] reads nodes[k - 1]'s output as its input
// operand[k] (operand[0] is unused).  `extra` nodes belong to the chain
// without being links (the sigmoid of t * sigmoid(t)); they are destroyed
// with it.
struct Chain {
  std::vector<Node*> nodes;
  std::vector<size_t> operand;
  std::vector<Node*> extra;

  Node* head() const {
    return nodes.front();
  }
  Node* tail() const {
    return nodes.back();
  }
  // For a binary link: its input that is not the chain's.
  Value* otherOperand(size_t k) const {
    return nodes.at(k)->input(1 - operand.at(k));
  }
  // Inputs of the chain's nodes (extras included) that no chain node
  // produces.  NB: AliasDb ignores those that hold no tensor.
  std::vector<Value*> externalInputs() const;
};

// The chain reaches link k as its first operand (add's `self`).
// NB: the fused ops compute `chain + alpha * other` and return the chain's
// layout; eager's `other + chain` takes its strides from `other` where the
// two differ (a channels-last `other`, a permuted view), so only this order
// keeps the output's strides, whatever alpha.
bool chainIsAddSelf(const Chain& chain, size_t k);

// Every way `links` (head first) match ending at `tail`: a binary link may
// carry the chain on either listed operand, in the listed order.
std::vector<Chain> matchChains(Node* tail, const std::vector<Link>& links);

// Inserts `op(inputs)` at the tail's position and destroys the chain's
// nodes, tail first.  Returns false, leaving the graph unchanged, when the
// inputs resolve to no schema of `op`.
bool replaceChain(
    torch::jit::Graph& graph,
    const Chain& chain,
    const char* op,
    const std::vector<Value*>& inputs);

// Runs a fusion over the chain matcher.  `accept(chain, db)` holds the
// pass's own predicates; `inputs(chain)` maps a chain to the op's arguments.
// NB: the arguments are read at rewrite time: an earlier rewrite may have
// replaced an input (another chain's tail) by its fused output.
int64_t fuseChains(
    std::shared_ptr<torch::jit::Graph>& graph,
    const std::vector<Link>& links,
    const char* op,
    const std::function<bool(const Chain&, const AliasDb&)>& accept,
    const std::function<std::vector<Value*>(const Chain&)>& inputs);

} // namespace torchfuse::passes
