#pragma once

// torch.jit.freeze's own graph optimizations for our frozen result, where
// they keep the module's meaning.

#include <torch/csrc/jit/ir/ir.h>

#include <memory>

namespace torchfuse::passes {

// True when every aten::batch_norm in `block` (nested blocks included) has
// a `training` input that is the constant False.  NB: torch's
// FoldFrozenConvBatchnorm and FoldFrozenLinearBatchnorm also fold a
// BatchNorm whose training flag is a constant True (a submodule left in
// training mode inside an eval-mode module), dropping its batch statistics
// and running-statistic updates.
bool batchNormsAreInference(const torch::jit::Block* block);

// True when folding each aten::batch_norm that reads an aten::linear into
// that linear keeps the meaning: the linear's output is known to be 2-D
// (BatchNorm normalizes dim 1, the linear's features are the last dim), and
// nothing else reads its values (its dim() or size() may be read).  NB:
// torch's FoldFrozenLinearBatchnorm checks neither.
bool linearBatchNormFoldingKeepsMeaning(const torch::jit::Block* block);

// True when no aten::linear that shares its input with another linear has
// an output that something writes (in place, or through a view) or that
// the graph returns (itself or a view of it).  NB: torch's
// FrozenConcatLinear (CUDA weights only) turns such linears into slices of
// one linear's output: then an in-place op on one output bumps the version
// of the others, and a backward that saved one of them fails; and a
// returned slice is not contiguous where the original's output was.
bool linearConcatenationKeepsMeaning(const std::shared_ptr<torch::jit::Graph>& graph);

// torch::jit::OptimizeFrozenGraph's passes in its order (dropout removed,
// linears of one input concatenated where
// linearConcatenationKeepsMeaning holds, then until nothing changes: BatchNorm
// and constant add/sub/mul/div folded into a conv, BatchNorm folded into a
// linear), where batchNormsAreInference holds, the linear folding only
// where linearBatchNormFoldingKeepsMeaning holds.  Returns whether they ran.
bool optimizeFrozenGraph(std::shared_ptr<torch::jit::Graph>& graph);

} // namespace torchfuse::passes
