#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "ops/common/autocast.h"
#include "ops/linear_add_relu.h"

namespace torchfuse::ops {
namespace {

// The original chain under autocast: linear in the lower-precision dtype,
// then (TorchScript's autocast pass) add and relu in float32.
template <c10::DeviceType device>
at::Tensor linearAddReluAutocast(const LinearAddReluArgs& a) {
  const ChainAutocast casts(device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto x = casts.reduced(a.input);
  const auto w = casts.reduced(a.weight);
  const auto b = casts.reduced(a.bias);
  // NB: the linear's dtype is x's.  When the add takes it in another dtype,
  // the op cannot: the chain runs as ATen ops, autograd included.
  if (casts.fullCasts(x)) {
    return at::relu(at::add(casts.full(at::linear(x, w, b)), casts.full(a.other), a.alpha));
  }
  const auto other = casts.full(a.other);
  return linearAddRelu({x, w, b, other, a.alpha});
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, AutocastCPU, m) {
  using namespace torchfuse::ops;
  registerLinearAddRelu<linearAddReluAutocast<c10::DeviceType::CPU>>(m);
}

TORCH_LIBRARY_IMPL(torchfuse, AutocastCUDA, m) {
  using namespace torchfuse::ops;
  registerLinearAddRelu<linearAddReluAutocast<c10::DeviceType::CUDA>>(m);
}
