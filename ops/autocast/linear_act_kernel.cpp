#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "ops/common/autocast.h"
#include "ops/linear_act.h"

namespace torchfuse::ops {
namespace {

// The original chain under autocast: linear in the lower-precision dtype
// (input, weight and bias cast, by TorchScript's autocast pass where it runs
// and by eager autocast), then the residual add and the activation, which
// neither casts: the op with `other` as it is (add promotes with it, add_
// keeps the linear output's dtype).
template <c10::DeviceType device>
at::Tensor linearActAutocast(const LinearActArgs& a) {
  const ChainAutocast casts(device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto x = casts.reduced(a.input);
  const auto w = casts.reduced(a.weight);
  const auto b = casts.reduced(a.bias);
  return linearAct(
      {x, w, b, a.activation, a.activation_args, a.other, a.alpha, a.promote, a.other_first});
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, AutocastCPU, m) {
  using namespace torchfuse::ops;
  registerLinearAct<linearActAutocast<c10::DeviceType::CPU>>(m);
}

TORCH_LIBRARY_IMPL(torchfuse, AutocastCUDA, m) {
  using namespace torchfuse::ops;
  registerLinearAct<linearActAutocast<c10::DeviceType::CUDA>>(m);
}
