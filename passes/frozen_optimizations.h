#pragma once

// torch.jit.freeze's own graph optimizations for our frozen result, where
// they keep the module's meaning.

#include <torch/csrc/jit/ir/ir.h>

#include <memory>

namespace torchfuse::passes {

// True when every aten::batch_norm in `block` (nested blocks included) has
// a `training` input that is the constant False.  NB: torch's
// FoldFrozenConvBatchnorm and FoldFrozenLinearBatchnorm fold a BatchNorm
// whose training flag is a constant True as well (a submodule left in
// training mode inside an eval-mode module), which drops its batch
// statistics and running-statistic updates.
bool batchNormsAreInference(const torch::jit::Block* block);

// torch::jit::OptimizeFrozenGraph (dropout removal, concatenated linears,
// conv/linear with BatchNorm and conv with constant add/sub/mul/div folded),
// as torch.jit.freeze runs it, when batchNormsAreInference holds; else
// nothing.  Returns whether it ran.
bool optimizeFrozenGraph(std::shared_ptr<torch::jit::Graph>& graph);

} // namespace torchfuse::passes
