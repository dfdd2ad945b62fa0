#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "ops/batch_norm_add_div_swish.h"
#include "ops/common/autocast.h"

namespace torchfuse::ops {
namespace {

// The original chain under autocast: batch_norm in the input's dtype (no
// autocast policy), then (TorchScript's autocast pass) add, div and the swish
// in float32; otherwise `op` (the train or _eval op) with other cast.
// NB: `silu` is the spelling the pass matched.
template <c10::DeviceType device>
at::Tensor chainAutocast(
    const BatchNormAddDivSwishArgs& a,
    at::Tensor (*op)(const BatchNormAddDivSwishArgs&)) {
  const ChainAutocast casts(device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // NB: when the add takes the batch norm's output in another dtype, the op
  // cannot: the chain runs as ATen ops, autograd included.
  if (casts.fullCasts(a.input)) {
    const auto bn = batchNormOf(a);
    const auto t = at::div(at::add(casts.full(bn), casts.full(a.other)), a.divisor);
    return a.silu ? at::silu(t) : at::mul(t, at::sigmoid(t));
  }
  const auto other = casts.full(a.other);
  return op(
      {a.input, a.weight, a.bias, a.running_mean, a.running_var, a.training, a.momentum, a.eps,
       other, a.divisor, a.silu});
}

template <c10::DeviceType device>
at::Tensor trainAutocast(const BatchNormAddDivSwishArgs& a) {
  return chainAutocast<device>(a, batchNormAddDivSwishTrain);
}

template <c10::DeviceType device>
at::Tensor evalAutocast(const BatchNormAddDivSwishArgs& a) {
  return chainAutocast<device>(a, batchNormAddDivSwishEval);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, AutocastCPU, m) {
  using namespace torchfuse::ops;
  registerBatchNormAddDivSwish<
      trainAutocast<c10::DeviceType::CPU>, evalAutocast<c10::DeviceType::CPU>>(m);
}

TORCH_LIBRARY_IMPL(torchfuse, AutocastCUDA, m) {
  using namespace torchfuse::ops;
  registerBatchNormAddDivSwish<
      trainAutocast<c10::DeviceType::CUDA>, evalAutocast<c10::DeviceType::CUDA>>(m);
}
