// custom_batch_norm_add_div_swish:
//   t = (batch_norm(input, weight, bias, running_mean, running_var, training,
//                   momentum, eps) + other) / divisor;  out = t * sigmoid(t).
//   `silu` picks how the swish is differentiated: as aten::silu does,
//   g·s·(1 + t(1 − s)), or as autograd through `t * sigmoid(t)` does,
//   g·s + ((g·t)(1 − s))·s.  The two agree up to rounding except where g is
//   infinite: there the sum is inf − inf = NaN where the product is ±inf, so
//   the pass passes the spelling it matched.
//   In training mode the running statistics are updated in place as
//   aten::batch_norm does (unbiased variance), hence the (a!)/(b!)
//   annotations; they are not optional because TorchScript's alias analysis
//   does not support `Tensor(a!)?`.
// custom_batch_norm_add_div_swish_eval is the non-mutating eval-mode form:
//   frozen graphs pool identical constants, and a write through one would
//   change another.  It is a separate name rather than an overload because
//   torch.library.opcheck tests only operators without overloads.

#include "ops/batch_norm_add_div_swish.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include "ops/common/checks.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_batch_norm_add_div_swish(Tensor input, Tensor? weight, "
      "Tensor? bias, Tensor(a!) running_mean, Tensor(b!) running_var, "
      "bool training, float momentum, float eps, Tensor other, "
      "Scalar divisor, bool silu=True) -> Tensor");
  m.def(
      "custom_batch_norm_add_div_swish_eval(Tensor input, Tensor? weight, "
      "Tensor? bias, Tensor running_mean, Tensor running_var, float eps, "
      "Tensor other, Scalar divisor, bool silu=True) -> Tensor");
  m.def(
      "custom_batch_norm_add_div_swish_forward(Tensor input, Tensor? weight, "
      "Tensor? bias, Tensor(a!) running_mean, Tensor(b!) running_var, "
      "bool training, float momentum, float eps, Tensor other, "
      "Scalar divisor, bool silu=True) -> (Tensor, Tensor, Tensor)");
  m.def(
      "custom_batch_norm_add_div_swish_backward(Tensor grad_output, "
      "Tensor input, Tensor? weight, Tensor? bias, Tensor mean, "
      "Tensor invstd, bool training, Tensor other, Scalar divisor, "
      "bool[4] output_mask, bool silu=True) -> (Tensor, Tensor, Tensor, Tensor)");
}

namespace torchfuse {

namespace {
using OptTensor = std::optional<at::Tensor>;
using TrainSignature = at::Tensor(
    const at::Tensor&, const OptTensor&, const OptTensor&, at::Tensor&,
    at::Tensor&, bool, double, double, const at::Tensor&, const at::Scalar&, bool);
using EvalSignature = at::Tensor(
    const at::Tensor&, const OptTensor&, const OptTensor&, const at::Tensor&,
    const at::Tensor&, double, const at::Tensor&, const at::Scalar&, bool);
using ForwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const OptTensor&, const OptTensor&, at::Tensor&,
    at::Tensor&, bool, double, double, const at::Tensor&, const at::Scalar&, bool);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
    const at::Tensor&, const at::Tensor&, bool, const at::Tensor&,
    const at::Scalar&, std::array<bool, 4>, bool);
} // namespace

at::Tensor custom_batch_norm_add_div_swish(
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
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_batch_norm_add_div_swish", "")
          .typed<TrainSignature>();
  return op.call(
      input, weight, bias, running_mean, running_var, training, momentum, eps,
      other, divisor, silu);
}

at::Tensor custom_batch_norm_add_div_swish_eval(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu) {
  return ops::batchNormAddDivSwishEval(
      input, weight, bias, running_mean, running_var, eps, other, divisor, silu);
}

namespace ops {

namespace {
constexpr const char* kOp = "torchfuse::custom_batch_norm_add_div_swish";

void checkChannelVector(
    const char* name,
    const at::Tensor& t,
    const at::Tensor& input,
    int64_t channels) {
  checkDim(kOp, name, t, 1);
  TORCH_CHECK(
      t.size(0) == channels, kOp, ": expected ", name,
      " to have input.size(1) = ", channels, " elements, got ", t.size(0));
  checkSameDevice(kOp, name, t, input);
}
} // namespace

void checkBatchNormAddDivSwishInputs(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    const at::Tensor& other,
    const at::Scalar& divisor) {
  checkDefined(kOp, "input", input);
  checkDefined(kOp, "running_mean", running_mean);
  checkDefined(kOp, "running_var", running_var);
  checkDefined(kOp, "other", other);
  TORCH_CHECK(
      input.dim() >= 2, kOp, ": expected input to be at least 2-D (N, C, *), got ",
      input.dim(), "-D");
  checkFloating(kOp, "input", input);
  const int64_t channels = input.size(1);
  if (weight.has_value() && weight->defined()) {
    checkChannelVector("weight", *weight, input, channels);
  }
  if (bias.has_value() && bias->defined()) {
    checkChannelVector("bias", *bias, input, channels);
  }
  checkChannelVector("running_mean", running_mean, input, channels);
  checkChannelVector("running_var", running_var, input, channels);
  checkSameDevice(kOp, "other", other, input);
  checkBroadcastable(kOp, other, input.sizes());
  TORCH_CHECK(
      divisor.toComplexDouble() != c10::complex<double>(0.0, 0.0), kOp,
      ": expected divisor to be non-zero, got ", divisor.toDouble());
}

at::ScalarType batchNormOpmathType(at::ScalarType input) {
  return input == at::kHalf || input == at::kBFloat16 ? at::kFloat : input;
}

// NB: float32 inputs get float64 backward sums (the composite computes in
// float64 throughout; the CUDA kernels accumulate in float64).  The
// per-channel sums and the gradient of `other` (a sum over every element)
// cancel heavily; computed in float32 in another order than eager's, they
// missed the bound of 2x eager's error against float64 for some seeds on an
// H200.
at::ScalarType batchNormBackwardType(at::ScalarType input, at::ScalarType grad_output) {
  const auto base = input == at::kHalf || input == at::kBFloat16 ? at::kFloat : at::kDouble;
  return c10::promoteTypes(base, grad_output);
}

at::Tensor batchNormAddDivSwishEval(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_batch_norm_add_div_swish_eval", "")
          .typed<EvalSignature>();
  return op.call(input, weight, bias, running_mean, running_var, eps, other, divisor, silu);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batchNormAddDivSwishForward(
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
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_batch_norm_add_div_swish_forward", "")
          .typed<ForwardSignature>();
  return op.call(
      input, weight, bias, running_mean, running_var, training, momentum, eps,
      other, divisor, silu);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
batchNormAddDivSwishBackward(
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
    bool silu) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_batch_norm_add_div_swish_backward", "")
          .typed<BackwardSignature>();
  return op.call(
      grad_output, input, weight, bias, mean, invstd, training, other, divisor,
      output_mask, silu);
}

} // namespace ops
} // namespace torchfuse
