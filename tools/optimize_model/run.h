#pragma once

#include "tools/optimize_model/args.h"

namespace torchfuse::tools {

// Load, optimize, check, save.  Returns kOk or throws ToolError; on any
// error nothing has been written.
int run(const Options& opts);

} // namespace torchfuse::tools
