#pragma once

// torch.jit.freeze's own graph optimizations for our frozen result, where
// they keep the module's meaning.

#include <torch/csrc/jit/ir/ir.h>

#include <memory>

namespace torchfuse::passes {

// True when torch's BatchNorm folding keeps the meaning of every
// aten::batch_norm in `block` (nested blocks included): its `training`
// input is the constant False, and where it reads an aten::linear, nothing
// else reads that linear's values (its dim() or size() may be read).  NB: torch's
// FoldFrozenConvBatchnorm and FoldFrozenLinearBatchnorm also fold a BatchNorm whose training flag
// is a constant True (a submodule left in training mode inside an eval-mode module), dropping its
// batch statistics and running-statistic updates, and FoldFrozenLinearBatchnorm folds into a linear
// whose output has other readers, which then read the folded values (the conv folding checks that).
bool batchNormFoldingKeepsMeaning(const torch::jit::Block* block);

// torch::jit::OptimizeFrozenGraph (dropout removal, concatenated linears,
// conv/linear with BatchNorm and conv with constant add/sub/mul/div folded),
// as torch.jit.freeze runs it, when batchNormFoldingKeepsMeaning holds; else
// nothing.  Returns whether it ran.
bool optimizeFrozenGraph(std::shared_ptr<torch::jit::Graph>& graph);

} // namespace torchfuse::passes
