// custom_linear_act under Autograd: where a graph is recorded, the original
// chain as ATen ops, so that gradients and higher-order gradients are
// eager's own; else the device kernels below autograd.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/linear_act.h"

namespace torchfuse::ops {
namespace {

at::Tensor linearActAutograd(const LinearActArgs& a) {
  if (!linearActHandles(a) || needsGraph(a.input, a.weight, a.bias, a.other)) {
    return linearActComposite(a);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return linearAct(a);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  torchfuse::ops::registerLinearAct<torchfuse::ops::linearActAutograd>(m);
}
