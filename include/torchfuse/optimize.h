#pragma once

// The module-level entry point: clone (or freeze), inline, propagate
// constants, canonicalize, run the fusions and ReplaceRelu, eliminate dead
// code.  The caller's module, and other instances sharing its compiled type,
// are never modified.

#include <torch/csrc/jit/api/module.h>

#include <cstdint>
#include <string>
#include <vector>

#include "torchfuse/export.h"

namespace torchfuse {

struct OptimizeOptions {
  // Freeze for inference first (the module must be in eval mode); BatchNorm
  // is kept for our fusion rather than folded into the preceding layer.
  bool freeze = false;
  // Names from kPassNames to run, in the pipeline's own order; empty = all.
  std::vector<std::string> passes;
  // With freeze: attributes and methods (e.g. @torch.jit.export ones) that
  // freezing keeps, as torch.jit.freeze's preserved_attrs.
  std::vector<std::string> preserved_attrs;
};

// "linear_add_relu", "conv_relu_add", "batch_norm_add_div_swish", "relu".
TORCHFUSE_API const std::vector<std::string>& passNames();

struct FusionReport {
  int64_t linear_add_relu = 0;
  int64_t conv_relu_add = 0;
  int64_t batch_norm_add_div_swish = 0;
  int64_t relu = 0;
  // Nodes of forward, blocks included: after inlining (before the fusions)
  // and at the end.  report() sets both to the current count.
  int64_t nodes_before = 0;
  int64_t nodes_after = 0;
};

// Returns a new module.  Throws c10::Error for an unknown pass name or (with
// freeze) a module in training mode.
TORCHFUSE_API torch::jit::Module optimize(
    const torch::jit::Module& module,
    const OptimizeOptions& options = {},
    FusionReport* report = nullptr);

// Counts the torchfuse ops in a module's forward graph (blocks included).
TORCHFUSE_API FusionReport report(const torch::jit::Module& module);

} // namespace torchfuse
