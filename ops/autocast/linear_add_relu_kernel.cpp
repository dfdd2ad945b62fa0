#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "ops/common/autocast.h"
#include "torchfuse/ops.h"

namespace torchfuse::ops {
namespace {

// The original chain under autocast: linear in the lower-precision dtype,
// then (TorchScript's autocast pass) add and relu in float32.
template <c10::DeviceType device>
at::Tensor linearAddReluAutocast(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  const ChainAutocast casts(device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto x = casts.reduced(input);
  const auto w = casts.reduced(weight);
  const auto b = casts.reduced(bias);
  // NB: the linear's dtype is x's.  When the add takes it in another dtype,
  // the op cannot: the chain runs as ATen ops, autograd included.
  if (casts.fullCasts(x)) {
    return at::relu(at::add(casts.full(at::linear(x, w, b)), casts.full(other), alpha));
  }
  return custom_linear_add_relu(x, w, b, casts.full(other), alpha);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, AutocastCPU, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_linear_add_relu"),
      TORCH_FN(linearAddReluAutocast<c10::DeviceType::CPU>));
}

TORCH_LIBRARY_IMPL(torchfuse, AutocastCUDA, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_linear_add_relu"),
      TORCH_FN(linearAddReluAutocast<c10::DeviceType::CUDA>));
}
