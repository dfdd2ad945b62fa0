// The one TORCH_LIBRARY block of the torchfuse namespace.  Each op declares
// its schemas with TORCH_LIBRARY_FRAGMENT in ops/<op>.cpp.

#include <torch/library.h>

#include "torchfuse/ops.h"

namespace torchfuse {

const char* version() {
  return TORCHFUSE_VERSION_STRING;
}

} // namespace torchfuse

TORCH_LIBRARY(torchfuse, m) {}
