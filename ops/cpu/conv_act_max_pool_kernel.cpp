// custom_conv_act_max_pool on CPU: the composite, after the conv's checks.

#include <torch/library.h>

#include "ops/conv_act_max_pool.h"

namespace torchfuse::ops {
namespace {

at::Tensor convActMaxPoolCpu(const ConvActMaxPoolArgs& a) {
  const std::optional<at::Tensor> none;
  const auto conv = convActArgs(a, none);
  if (convAddActHandles(conv)) {
    checkConvAddActInputs(conv, kConvActMaxPool);
  }
  return convActMaxPoolComposite(a);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
  torchfuse::ops::registerConvActMaxPool<torchfuse::ops::convActMaxPoolCpu>(m);
}
