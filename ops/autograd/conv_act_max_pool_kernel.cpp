// custom_conv_act_max_pool under Autograd: where a graph is recorded, the
// original chain as ATen ops, so that gradients and higher-order gradients
// are eager's own; else the device kernels below autograd.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "ops/conv_act_max_pool.h"

namespace torchfuse::ops {
namespace {

at::Tensor convActMaxPoolAutograd(const ConvActMaxPoolArgs& a) {
  const std::optional<at::Tensor> none;
  const auto conv = convActArgs(a, none);
  if (!convAddActHandles(conv) || needsGraph(a.input, a.weight, a.bias)) {
    // NB: the op's own errors first, for the sizes that can be read.
    if (convAddActHandles(conv) && !anySymbolic({a.input, a.weight, orUndefined(a.bias)})) {
      checkConvAddActInputs(conv, kConvActMaxPool);
    }
    return convActMaxPoolComposite(a);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return convActMaxPool(a);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  torchfuse::ops::registerConvActMaxPool<torchfuse::ops::convActMaxPoolAutograd>(m);
}
