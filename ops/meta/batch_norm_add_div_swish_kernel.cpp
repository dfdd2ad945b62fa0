#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/batch_norm_add_div_swish.h"
#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"

namespace torchfuse::ops {
namespace {

// NB: batch_norm keeps the input's shape and memory format; add, div, mul and
// sigmoid are ATen's own meta functions.
at::Tensor outputMeta(const at::Tensor& input, const at::Tensor& other, const at::Scalar& divisor) {
  const auto bn = at::empty_like(input, input.suggest_memory_format());
  const auto t = at::div(at::add(bn, other), divisor);
  return at::mul(t, at::sigmoid(t));
}

at::Tensor batchNormAddDivSwishMeta(
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
    bool /*silu*/) {
  if (!anySymbolic({input, orUndefined(weight), orUndefined(bias), running_mean, running_var, other})) {
    checkBatchNormAddDivSwishInputs(input, weight, bias, running_mean, running_var, other);
  }
  return outputMeta(input, other, divisor);
}

at::Tensor batchNormAddDivSwishEvalMeta(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool /*silu*/) {
  if (!anySymbolic({input, orUndefined(weight), orUndefined(bias), running_mean, running_var, other})) {
    checkBatchNormAddDivSwishInputs(input, weight, bias, running_mean, running_var, other);
  }
  return outputMeta(input, other, divisor);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batchNormAddDivSwishForwardMeta(
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
    bool /*silu*/) {
  if (!anySymbolic({input, orUndefined(weight), orUndefined(bias), running_mean, running_var, other})) {
    checkBatchNormAddDivSwishInputs(input, weight, bias, running_mean, running_var, other);
  }
  const auto stats = input.options().dtype(batchNormOpmathType(input.scalar_type()));
  const c10::SymInt n = training ? input.sym_size(1) : c10::SymInt(0);
  return {
      outputMeta(input, other, divisor), at::empty_symint({n}, stats),
      at::empty_symint({n}, stats)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
batchNormAddDivSwishBackwardMeta(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& mean,
    const at::Tensor& invstd,
    bool training,
    const at::Tensor& other,
    const at::Scalar& divisor,
    std::array<bool, 4> output_mask,
    bool /*silu*/) {
  const auto ct =
      batchNormBackwardType(input.scalar_type(), grad_output.scalar_type());
  const auto channel = at::empty_symint({input.sym_size(1)}, input.options().dtype(ct));
  return {
      output_mask[0] ? at::empty_like(input) : at::Tensor(),
      output_mask[1] ? channel : at::Tensor(),
      output_mask[2] ? at::empty_like(channel) : at::Tensor(),
      output_mask[3] ? at::empty_symint(other.sym_sizes(), input.options().dtype(ct))
                     : at::Tensor()};
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish"),
      TORCH_FN(batchNormAddDivSwishMeta));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_eval"),
      TORCH_FN(batchNormAddDivSwishEvalMeta));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_forward"),
      TORCH_FN(batchNormAddDivSwishForwardMeta));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_backward"),
      TORCH_FN(batchNormAddDivSwishBackwardMeta));
}
