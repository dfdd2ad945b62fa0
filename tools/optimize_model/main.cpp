// optimize-model: fuses operator chains of a TorchScript model into torchfuse
// ops.  The work is in run.cpp; this file maps errors to exit codes.

#include <torch/headeronly/version.h>

#include <iostream>
#include <string>
#include <vector>

#include "tools/optimize_model/args.h"
#include "tools/optimize_model/output.h"
#include "tools/optimize_model/run.h"
#include "torchfuse/ops.h"

int main(int argc, char** argv) {
  using namespace torchfuse::tools;
  try {
    const auto opts = parseArgs(std::vector<std::string>(argv + 1, argv + argc));
    if (opts.help) {
      std::cout << helpText();
      return kOk;
    }
    if (opts.version) {
      std::cout << "optimize-model (torchfuse " << torchfuse::version() << ", torch "
                << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << "."
                << TORCH_VERSION_PATCH << ")\n";
      return kOk;
    }
    return run(opts);
  } catch (const ToolError& e) {
    std::cerr << "optimize-model: " << e.what() << std::endl;
    return e.code();
  } catch (const std::exception& e) {
    std::cerr << "optimize-model: internal error: " << errorLine(e) << std::endl;
    return kInternal;
  }
}
