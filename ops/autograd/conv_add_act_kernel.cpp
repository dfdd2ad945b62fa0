// custom_conv_add_act under Autograd: where a graph is recorded, the
// original chain as ATen ops, so that gradients and higher-order gradients
// are eager's own; else the device kernels below autograd.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "ops/conv_add_act.h"

namespace torchfuse::ops {
namespace {

at::Tensor convAddActAutograd(const ConvAddActArgs& a) {
  const auto other = otherOf(a);
  if (!convAddActHandles(a) || needsGraph(a.input, a.weight, a.bias, other)) {
    // NB: the op's own errors first, for the sizes that can be read.
    if (convAddActHandles(a) && !anySymbolic({a.input, a.weight, orUndefined(a.bias), other})) {
      checkConvAddActInputs(a);
    }
    return convAddActComposite(a);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return convAddAct(a);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  torchfuse::ops::registerConvAddAct<torchfuse::ops::convAddActAutograd>(m);
}
