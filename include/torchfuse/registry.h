#pragma once

// The fusion registry: one entry per fusion, in pipeline order.  The
// pipeline (optimize, fuseGraph), the report, the pass names accepted by
// the Python API and the CLI, the fuzzer's vocabulary and the docs tables
// all come from it (docs/passes.md, "Adding a fusion").

#include <torch/csrc/jit/ir/ir.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "torchfuse/export.h"

namespace torchfuse {

struct Fusion {
  // The pass name: optimize(passes=...), --passes, the report's keys.
  std::string name;
  // The chain it matches, as the docs tables and --help write it.
  std::string chain;
  // The qualified names of the ops it inserts (report() counts these).
  std::vector<std::string> ops;
  // Rewrites every match in a graph and its sub-blocks; returns the count.
  int64_t (*run)(std::shared_ptr<torch::jit::Graph>&);
  // Whether it runs when no passes are named.  Only a fusion that removes
  // memory traffic the executor would not remove anyway (NNC's fusion
  // groups, cuDNN's own epilogues) is on by default: docs/passes.md, "Do no
  // harm".
  bool by_default;
};

// Every fusion, in the order the pipeline runs them.
TORCHFUSE_API const std::vector<Fusion>& fusions();

} // namespace torchfuse
