// custom_conv_add_act on CPU: the composite, after the op's own checks.

#include <torch/library.h>

#include "ops/conv_add_act.h"

namespace torchfuse::ops {
namespace {

at::Tensor convAddActCpu(const ConvAddActArgs& a) {
  if (convAddActHandles(a)) {
    checkConvAddActInputs(a);
  }
  return convAddActComposite(a);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
  torchfuse::ops::registerConvAddAct<torchfuse::ops::convAddActCpu>(m);
}
