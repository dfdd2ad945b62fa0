#include "passes/frozen_optimizations.h"

#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/passes/frozen_concat_linear.h>
#include <torch/csrc/jit/passes/frozen_conv_folding.h>
#include <torch/csrc/jit/passes/frozen_linear_folding.h>
#include <torch/csrc/jit/passes/remove_dropout.h>

#include <algorithm>
#include <functional>
#include <unordered_set>

namespace torchfuse::passes {
namespace {

// NB: BatchNorm's forward checks its input's dim(): readers of a tensor's
// metadata see the same before and after a fold.
bool readsOnlyMetadata(const torch::jit::Node* node) {
  static const std::unordered_set<c10::Symbol> kinds = {
      c10::Symbol::fromQualString("aten::dim"),   c10::Symbol::fromQualString("aten::size"),
      c10::Symbol::fromQualString("aten::numel"), c10::Symbol::fromQualString("aten::len"),
      c10::Symbol::fromQualString("prim::dtype"), c10::Symbol::fromQualString("prim::device"),
      c10::Symbol::fromQualString("prim::layout")};
  return kinds.count(node->kind()) > 0;
}

// True when `holds` holds for every aten::batch_norm in `block`, nested
// blocks included.
bool everyBatchNorm(
    const torch::jit::Block* block,
    const std::function<bool(const torch::jit::Node*)>& holds) {
  for (const auto* node : block->nodes()) {
    for (const auto* sub : node->blocks()) {
      if (!everyBatchNorm(sub, holds)) {
        return false;
      }
    }
    if (node->kind() == c10::Symbol::fromQualString("aten::batch_norm") && !holds(node)) {
      return false;
    }
  }
  return true;
}

} // namespace

bool batchNormsAreInference(const torch::jit::Block* block) {
  return everyBatchNorm(block, [](const torch::jit::Node* bn) {
    const auto training = torch::jit::toIValue(bn->namedInput("training"));
    return training && training->isBool() && !training->toBool();
  });
}

bool linearBatchNormFoldingKeepsMeaning(const torch::jit::Block* block) {
  return everyBatchNorm(block, [](const torch::jit::Node* bn) {
    const auto* input = bn->input(0);
    if (input->node()->kind() != c10::Symbol::fromQualString("aten::linear")) {
      return true;
    }
    const auto type = input->type()->cast<c10::TensorType>();
    return type && type->dim() == 2 &&
        std::all_of(input->uses().begin(), input->uses().end(), [&](const auto& use) {
             return use.user == bn || readsOnlyMetadata(use.user);
           });
  });
}

bool linearConcatenationKeepsMeaning(const std::shared_ptr<torch::jit::Graph>& graph) {
  const auto linear = c10::Symbol::fromQualString("aten::linear");
  torch::jit::AliasDb aliasDb(graph);
  std::function<bool(torch::jit::Block*)> keeps = [&](torch::jit::Block* block) {
    for (auto* node : block->nodes()) {
      for (auto* sub : node->blocks()) {
        if (!keeps(sub)) {
          return false;
        }
      }
      if (node->kind() != linear ||
          (!aliasDb.hasWriters(node->output()) &&
           !aliasDb.mayContainAlias(node->output(), graph->outputs()))) {
        continue;
      }
      const auto& uses = node->input(0)->uses();
      const bool shared = std::any_of(uses.begin(), uses.end(), [&](const torch::jit::Use& use) {
        return use.user != node && use.user->kind() == linear && use.offset == 0;
      });
      if (shared) {
        return false;
      }
    }
    return true;
  };
  return keeps(graph->block());
}

bool optimizeFrozenGraph(std::shared_ptr<torch::jit::Graph>& graph) {
  if (!batchNormsAreInference(graph->block())) {
    return false;
  }
  torch::jit::removeDropout(graph);
  if (linearConcatenationKeepsMeaning(graph)) {
    torch::jit::FrozenConcatLinear(graph);
  }
  bool changed = true;
  while (changed) {
    changed = torch::jit::FoldFrozenConvBatchnorm(graph);
    changed |= torch::jit::FoldFrozenConvAddOrSub(graph);
    changed |= torch::jit::FoldFrozenConvMulOrDiv(graph);
    if (linearBatchNormFoldingKeepsMeaning(graph->block())) {
      changed |= torch::jit::FoldFrozenLinearBatchnorm(graph);
    }
  }
  return true;
}

} // namespace torchfuse::passes
