// The one TORCH_LIBRARY block of the torchfuse namespace.  Each op declares
// its schemas with TORCH_LIBRARY_FRAGMENT in ops/<op>.cpp.
//
// NB: the ops an FX rewrite hands to Inductor over image activations (the
// convolution chains' and the SE gate's) take any input strides, their Meta
// kernels giving the output's strides from the inputs', and are tagged
// flexible_layout.  Without the tag, Inductor's default for a
// custom op (needs_fixed_stride_order) copies each channels-last activation
// of a layout-optimized graph to the traced NCHW strides before the op, and
// back after it.

#include <torch/library.h>

#include "torchfuse/ops.h"

namespace torchfuse {

const char* version() {
  return TORCHFUSE_VERSION_STRING;
}

} // namespace torchfuse

TORCH_LIBRARY(torchfuse, m) {}
