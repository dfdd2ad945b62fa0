#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "ops/common/autocast.h"
#include "ops/common/conv_composites.h"
#include "ops/conv_relu_add.h"
#include "torchfuse/ops.h"

namespace torchfuse::ops {
namespace {

// The original chain under autocast: conv and relu in the lower-precision
// dtype, then (TorchScript's autocast pass) the add in float32.
template <c10::DeviceType device>
at::Tensor convReluAddAutocast(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  const ChainAutocast casts(device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto x = casts.reduced(input);
  const auto w = casts.reduced(weight);
  const auto b = casts.reduced(bias);
  // NB: the conv's dtype is x's.  When the add takes relu(conv) in another
  // dtype, the op cannot: the chain runs as ATen ops, autograd included.
  if (casts.fullCasts(x)) {
    const auto conv = convolve(x, w, b, stride, padding, dilation, groups);
    return at::add(casts.full(at::relu(conv)), casts.full(other), alpha);
  }
  return custom_conv_relu_add(
      x, w, b, stride, padding, dilation, groups, casts.full(other), alpha);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, AutocastCPU, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add"),
      TORCH_FN(convReluAddAutocast<c10::DeviceType::CPU>));
}

TORCH_LIBRARY_IMPL(torchfuse, AutocastCUDA, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add"),
      TORCH_FN(convReluAddAutocast<c10::DeviceType::CUDA>));
}
