#pragma once

// --check: run the original and the optimized model on the same random
// inputs and compare their outputs within a dtype-keyed tolerance; where
// they differ beyond it, judge them against a float64 run of the original.

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/jit/api/module.h>

#include <functional>
#include <string>
#include <vector>

#include "tools/optimize_model/args.h"

namespace torchfuse::tools {

struct Tolerance {
  double rtol;
  double atol;
};

// The one tolerance table: float64 tight, float32 tight, half types looser.
Tolerance defaultTolerance(c10::ScalarType dtype);

c10::ScalarType parseDtype(const std::string& name);  // a name from dtypeNames()

struct CheckSpec {
  std::vector<Shape> shapes;
  std::string shape_spec;  // as given, for messages
  c10::ScalarType dtype = c10::kFloat;
  std::string dtype_name = "float32";
  c10::Device device = c10::Device(c10::kCPU);
  Tolerance tolerance{};
  uint64_t seed = 0;
};

struct CheckResult {
  double max_abs_error = 0;
  double max_rel_error = 0;  // over elements whose reference is non-zero
  int64_t elements = 0;      // compared tensor elements
  int64_t mismatched = 0;    // elements outside the tolerance
  double original_ms = 0;    // median time of one forward
  double optimized_ms = 0;
  int runs = 0;              // timed runs of each model
  // Where outputs differ beyond the tolerance (and the dtype is not
  // float64): the largest error of each model against a float64 run of the
  // original, over the tensor outputs; the check passes when the optimized
  // model's is at most 2x the original's plus atol, per output.
  bool float64_judged = false;
  double original_error_vs_float64 = 0;
  double optimized_error_vs_float64 = 0;
  bool passed = false;
  std::string failure;       // why it failed, one line; empty when passed
};

// Bytes of the random inputs: each drawn in float32, then converted to
// spec.dtype; the larger of the two per element.  Saturates at INT64_MAX.
int64_t inputBytes(const CheckSpec& spec);

// Throws ToolError(kUsage) when the inputs need more bytes than the memory
// and swap of this machine, which no allocation can give (and which Linux
// may grant with overcommit, then end in the OOM killer).
void checkInputsFitInMemory(const CheckSpec& spec);

// Reports progress of a long check; called with e.g. "optimized model, run
// 3/10".  Throttling and printing are the caller's.
using ProgressFn = std::function<void(const std::string&)>;

// `original` and `optimized` are already on spec.device.  Throws
// ToolError(kUsage) when the inputs cannot be created (out of memory) or the
// original model fails on them (out of memory included), and
// ToolError(kCheckFailed) when only the optimized one fails.
CheckResult checkAccuracy(
    torch::jit::Module& original,
    torch::jit::Module& optimized,
    const CheckSpec& spec,
    const ProgressFn& progress);

} // namespace torchfuse::tools
