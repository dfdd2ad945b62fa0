#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "ops/common/autocast.h"
#include "torchfuse/ops.h"

namespace torchfuse::ops {
namespace {

// The original chain under autocast: batch_norm in the input's dtype (no
// autocast policy), then (TorchScript's autocast pass) add, div and the swish
// in float32.  NB: `silu` is the spelling the pass matched.
at::Tensor addDivSwishInFloat(
    const ChainAutocast& casts,
    const at::Tensor& bn,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu) {
  const auto t = at::div(at::add(casts.full(bn), casts.full(other)), divisor);
  return silu ? at::silu(t) : at::mul(t, at::sigmoid(t));
}

template <c10::DeviceType device>
at::Tensor batchNormAddDivSwishAutocast(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    at::Tensor& running_mean,
    at::Tensor& running_var,
    bool training,
    double momentum,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu) {
  const ChainAutocast casts(device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // NB: when the add takes the batch norm's output in another dtype, the op
  // cannot: the chain runs as ATen ops, autograd included.
  if (casts.fullCasts(input)) {
    const auto bn = at::batch_norm(
        input, weight, bias, running_mean, running_var, training, momentum, eps,
        /*cudnn_enabled=*/true);
    return addDivSwishInFloat(casts, bn, other, divisor, silu);
  }
  return custom_batch_norm_add_div_swish(
      input, weight, bias, running_mean, running_var, training, momentum, eps,
      casts.full(other), divisor, silu);
}

template <c10::DeviceType device>
at::Tensor batchNormAddDivSwishEvalAutocast(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu) {
  const ChainAutocast casts(device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  if (casts.fullCasts(input)) {
    const auto bn = at::batch_norm(
        input, weight, bias, running_mean, running_var, /*training=*/false,
        /*momentum=*/0.0, eps, /*cudnn_enabled=*/true);
    return addDivSwishInFloat(casts, bn, other, divisor, silu);
  }
  return custom_batch_norm_add_div_swish_eval(
      input, weight, bias, running_mean, running_var, eps, casts.full(other),
      divisor, silu);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, AutocastCPU, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish"),
      TORCH_FN(batchNormAddDivSwishAutocast<c10::DeviceType::CPU>));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_eval"),
      TORCH_FN(batchNormAddDivSwishEvalAutocast<c10::DeviceType::CPU>));
}

TORCH_LIBRARY_IMPL(torchfuse, AutocastCUDA, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish"),
      TORCH_FN(batchNormAddDivSwishAutocast<c10::DeviceType::CUDA>));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_eval"),
      TORCH_FN(batchNormAddDivSwishEvalAutocast<c10::DeviceType::CUDA>));
}
