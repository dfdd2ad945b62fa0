#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "ops/common/autocast.h"
#include "ops/conv_act_max_pool.h"

namespace torchfuse::ops {
namespace {

// The original chain under autocast: the conv in the lower-precision dtype;
// the activation and max_pool2d (on no autocast list) in the conv's dtype.
template <c10::DeviceType device>
at::Tensor convActMaxPoolAutocast(const ConvActMaxPoolArgs& a) {
  const ChainAutocast casts(device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto x = casts.reduced(a.input);
  const auto w = casts.reduced(a.weight);
  const auto b = casts.reduced(a.bias);
  return convActMaxPool(ConvActMaxPoolArgs{
      x, w, b, a.stride, a.padding, a.dilation, a.groups, a.activation, a.activation_args,
      a.kernel_size, a.pool_stride, a.pool_padding, a.pool_dilation, a.ceil_mode});
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, AutocastCPU, m) {
  using namespace torchfuse::ops;
  registerConvActMaxPool<convActMaxPoolAutocast<c10::DeviceType::CPU>>(m);
}

TORCH_LIBRARY_IMPL(torchfuse, AutocastCUDA, m) {
  using namespace torchfuse::ops;
  registerConvActMaxPool<convActMaxPoolAutocast<c10::DeviceType::CUDA>>(m);
}
