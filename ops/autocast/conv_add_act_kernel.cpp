#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "ops/common/autocast.h"
#include "ops/common/autograd_utils.h"
#include "ops/common/conv_composites.h"
#include "ops/conv_add_act.h"

namespace torchfuse::ops {
namespace {

// The original chain under autocast: the conv in the lower-precision dtype,
// then (TorchScript's autocast pass) the add in float32 and the activation
// on its result.
template <c10::DeviceType device>
at::Tensor convAddActAutocast(const ConvAddActArgs& a) {
  const ChainAutocast casts(device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto x = casts.reduced(a.input);
  const auto w = casts.reduced(a.weight);
  const auto b = casts.reduced(a.bias);
  const auto other =
      toOptional(a.other && a.other->defined() ? casts.full(*a.other) : at::Tensor());
  const ConvAddActArgs cast{x,        w,     b,       a.stride,  a.padding,    a.dilation,
                            a.groups, other, a.alpha, a.promote, a.activation, a.activation_args};
  // NB: the conv's dtype is x's.  When the add takes the conv output in
  // another dtype, the op cannot: the chain runs as ATen ops, autograd
  // included.
  if (other && casts.fullCasts(x)) {
    const auto conv = convolve(x, w, b, a.stride, a.padding, a.dilation, a.groups);
    return convAddActEpilogueComposite(casts.full(conv), cast);
  }
  return convAddAct(cast);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, AutocastCPU, m) {
  using namespace torchfuse::ops;
  registerConvAddAct<convAddActAutocast<c10::DeviceType::CPU>>(m);
}

TORCH_LIBRARY_IMPL(torchfuse, AutocastCUDA, m) {
  using namespace torchfuse::ops;
  registerConvAddAct<convAddActAutocast<c10::DeviceType::CUDA>>(m);
}
