#include "passes/chain_matcher.h"

#include <algorithm>
#include <unordered_set>

namespace torchfuse::passes {
namespace {

// Extends `suffix` (links k+1.. matched, nodes[0] = the node matching link
// k) towards the head; appends every complete match to `out`.
void matchBackwards(
    const std::vector<Link>& links,
    size_t k,
    Chain suffix,
    std::vector<Chain>& out) {
  Node* n = suffix.nodes.front();
  if (!links[k].is(n)) {
    return;
  }
  if (k == 0) {
    const Block* block = n->owningBlock();
    if (std::all_of(suffix.nodes.begin(), suffix.nodes.end(), [&](const Node* m) {
          return m->owningBlock() == block;
        })) {
      out.push_back(std::move(suffix));
    }
    return;
  }
  for (const size_t i : links[k].operands) {
    if (i >= n->inputs().size()) {
      continue;
    }
    Value* v = n->input(i);
    if (!hasSingleUse(v, n) || !notInPlaceOnLiveTensor(n, v)) {
      continue;
    }
    Chain longer = suffix;
    longer.nodes.insert(longer.nodes.begin(), v->node());
    longer.operand.front() = i;
    longer.operand.insert(longer.operand.begin(), 0);
    matchBackwards(links, k - 1, std::move(longer), out);
  }
}

} // namespace

std::vector<Value*> Chain::externalInputs() const {
  std::unordered_set<const Node*> members(nodes.begin(), nodes.end());
  members.insert(extra.begin(), extra.end());
  std::vector<Value*> values;
  const auto collect = [&](Node* n) {
    for (Value* v : n->inputs()) {
      if (members.count(v->node()) == 0 &&
          std::find(values.begin(), values.end(), v) == values.end()) {
        values.push_back(v);
      }
    }
  };
  std::for_each(nodes.begin(), nodes.end(), collect);
  std::for_each(extra.begin(), extra.end(), collect);
  return values;
}

std::vector<Chain> matchChains(Node* tail, const std::vector<Link>& links) {
  std::vector<Chain> out;
  if (!links.empty()) {
    matchBackwards(links, links.size() - 1, Chain{{tail}, {0}, {}}, out);
  }
  return out;
}

bool replaceChain(
    torch::jit::Graph& graph,
    const Chain& chain,
    const char* op,
    const std::vector<Value*>& inputs) {
  if (replaceWithFusedOp(graph, op, inputs, chain.tail()) == nullptr) {
    return false;
  }
  // NB: tail first: each node's output is used only by later chain nodes.
  for (auto it = chain.nodes.rbegin(); it != chain.nodes.rend(); ++it) {
    (*it)->destroy();
    if (it == chain.nodes.rbegin()) {
      for (Node* e : chain.extra) {
        e->destroy();
      }
    }
  }
  return true;
}

int64_t fuseChains(
    std::shared_ptr<torch::jit::Graph>& graph,
    const std::vector<Link>& links,
    const char* op,
    const std::function<bool(const Chain&, const AliasDb&)>& accept,
    const std::function<std::vector<Value*>(const Chain&)>& inputs) {
  return fuseAll(
      graph,
      [&](Node* n, const AliasDb& db) -> std::optional<Chain> {
        for (auto& chain : matchChains(n, links)) {
          if (noInterveningWrites(
                  db, chain.head(), chain.tail(), chain.externalInputs()) &&
              accept(chain, db)) {
            return chain;
          }
        }
        return std::nullopt;
      },
      [&](torch::jit::Graph& g, const Chain& chain) {
        return replaceChain(g, chain, op, inputs(chain));
      });
}

bool chainIsAddSelf(const Chain& chain, size_t k) {
  return chain.operand.at(k) == 0;
}

} // namespace torchfuse::passes
