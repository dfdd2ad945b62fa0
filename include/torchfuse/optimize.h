#pragma once

// The module-level entry point: clone (or freeze), inline, propagate
// constants, canonicalize, run the fusions and ReplaceRelu, eliminate dead
// code.  The caller's module's methods, and other instances sharing its
// compiled type, are never modified.  The result shares the caller's
// parameters and buffers (the same tensors, as torch.compile does): tied
// weights stay tied, an optimizer built on the caller's parameters trains
// the result, and training the result updates the caller's tensors.

#include <torch/csrc/jit/api/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "torchfuse/export.h"

namespace torchfuse {

// The memory format ConvertToChannelsLast gives a frozen graph's 2-d
// convolutions: Auto decides by its cost model (CUDA weights only),
// ChannelsLast converts on any device, Keep leaves the weights as they are.
enum class Layout { Auto, ChannelsLast, Keep };

struct OptimizeOptions {
  // Freeze for inference first (the module must be in eval mode, or frozen
  // already); BatchNorm is kept for our fusion rather than folded into the
  // preceding layer.
  bool freeze = false;
  // Names from passNames() to run, in the pipeline's own order; empty = the
  // fusions that are on by default (Fusion::by_default).
  std::vector<std::string> passes;
  // With freeze: attributes and methods (e.g. @torch.jit.export ones) that
  // freezing keeps, as torch.jit.freeze's preserved_attrs; "sub.name" names
  // a submodule's.  Without freeze everything is kept.  Each name must
  // exist, with or without freeze.
  std::vector<std::string> preserved_attrs;
  // The convolutions' layout (docs/passes.md): with freeze the weights are
  // stored channels-last (Auto: where the cost model says so); without, the
  // first convolution's weight is converted on each call
  // (ConvertToChannelsLastUnfrozen): ChannelsLast always, Auto where the
  // cost model says so and then as each CUDA call site's measured choice
  // decides (torchfuse::measuredLayouts()).
  Layout layout = Layout::Auto;
};

// The names of fusions(), in pipeline order.
TORCHFUSE_API const std::vector<std::string>& passNames();

struct FusionReport {
  // Chains fused, per pass name; every name of fusions() is present.
  std::map<std::string, int64_t> fused;
  // Nodes of forward, blocks included: after inlining (before the fusions)
  // and at the end.
  int64_t nodes_before = 0;
  int64_t nodes_after = 0;
  // With freeze: the 2-d convolutions' weights stored channels-last
  // (ConvertToChannelsLast); without: the convolutions of the region that
  // runs channels-last (ConvertToChannelsLastUnfrozen).  0 where the graph
  // keeps its layout.
  int64_t channels_last_weights = 0;
  // Attention masks proven true everywhere and dropped
  // (DropAllTrueAttentionMasks).
  int64_t attention_masks_dropped = 0;
  // Dropouts of constant probability 0 replaced by their input
  // (RemoveZeroDropouts).
  int64_t zero_dropouts_removed = 0;
};

// Runs RemoveZeroDropouts, Canonicalize, DropAllTrueAttentionMasks, then the
// fusions named in `passes` (empty: those on by default) in the registry's
// order, then RestoreInPlace, on `graph`, in place.  The graph should be
// inlined and constant-propagated.  Throws c10::Error for an unknown pass name.
TORCHFUSE_API FusionReport fuseGraph(
    std::shared_ptr<torch::jit::Graph>& graph,
    const std::vector<std::string>& passes = {});

// Returns a new module.  Throws c10::Error for an unknown pass name, a
// preserved_attrs name the module lacks, or (with freeze) a module in
// training mode.
TORCHFUSE_API torch::jit::Module optimize(
    const torch::jit::Module& module,
    const OptimizeOptions& options = {},
    FusionReport* report = nullptr);

// Counts, per pass name, the ops each fusion inserted that a module's
// forward graph holds (blocks included).
TORCHFUSE_API std::map<std::string, int64_t> report(
    const torch::jit::Module& module);

} // namespace torchfuse
