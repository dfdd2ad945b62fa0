#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "ops/common/autocast.h"
#include "ops/common/conv_composites.h"
#include "ops/conv_relu_add.h"

namespace torchfuse::ops {
namespace {

// The original chain under autocast: conv and relu in the lower-precision
// dtype, then (TorchScript's autocast pass) the add in float32.
template <c10::DeviceType device>
at::Tensor convReluAddAutocast(const ConvReluAddArgs& a) {
  const ChainAutocast casts(device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto x = casts.reduced(a.input);
  const auto w = casts.reduced(a.weight);
  const auto b = casts.reduced(a.bias);
  // NB: the conv's dtype is x's.  When the add takes relu(conv) in another
  // dtype, the op cannot: the chain runs as ATen ops, autograd included.
  if (casts.fullCasts(x)) {
    const auto conv = convolve(x, w, b, a.stride, a.padding, a.dilation, a.groups);
    return at::add(casts.full(at::relu(conv)), casts.full(a.other), a.alpha);
  }
  const auto other = casts.full(a.other);
  return convReluAdd({x, w, b, a.stride, a.padding, a.dilation, a.groups, other, a.alpha});
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, AutocastCPU, m) {
  using namespace torchfuse::ops;
  registerConvReluAdd<convReluAddAutocast<c10::DeviceType::CPU>>(m);
}

TORCH_LIBRARY_IMPL(torchfuse, AutocastCUDA, m) {
  using namespace torchfuse::ops;
  registerConvReluAdd<convReluAddAutocast<c10::DeviceType::CUDA>>(m);
}
