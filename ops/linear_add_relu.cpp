// custom_linear_add_relu: relu(linear(input, weight, bias) + alpha * other).
//   input (*, in_features); weight (out_features, in_features); bias
//   (out_features,) or None; other broadcasts with the linear output: a
//   per-feature bias (out_features,), a scalar-like (1,), or a full tensor.

#include "ops/linear_add_relu.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops/common/checks.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_linear_add_relu(Tensor input, Tensor weight, Tensor? bias, "
      "Tensor other, Scalar alpha=1) -> Tensor");
  m.def(
      "custom_linear_add_relu_backward(Tensor grad_output, Tensor input, "
      "Tensor weight, Tensor result, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

namespace torchfuse {

at::Tensor custom_linear_add_relu(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_linear_add_relu", "")
          .typed<at::Tensor(
              const at::Tensor&, const at::Tensor&,
              const std::optional<at::Tensor>&, const at::Tensor&,
              const at::Scalar&)>();
  return op.call(input, weight, bias, other, alpha);
}

namespace ops {

namespace {
constexpr const char* kOp = "torchfuse::custom_linear_add_relu";
}

void checkLinearAddReluInputs(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other) {
  checkDefined(kOp, "input", input);
  checkDefined(kOp, "weight", weight);
  checkDefined(kOp, "other", other);
  checkDim(kOp, "weight", weight, 2);
  TORCH_CHECK(input.dim() >= 1, kOp, ": expected input to be at least 1-D, got 0-D");
  TORCH_CHECK(
      input.size(-1) == weight.size(1), kOp,
      ": expected input.size(-1) to equal weight.size(1) (in_features = ",
      weight.size(1), "), got ", input.size(-1));
  checkFloating(kOp, "input", input);
  checkSameDtype(kOp, "weight", weight, input);
  checkSameDevice(kOp, "weight", weight, input);
  checkSameDevice(kOp, "other", other, input);
  if (bias.has_value() && bias->defined()) {
    checkDim(kOp, "bias", *bias, 1);
    TORCH_CHECK(
        bias->size(0) == weight.size(0), kOp,
        ": expected bias to have weight.size(0) = ", weight.size(0),
        " elements, got ", bias->size(0));
    checkSameDtype(kOp, "bias", *bias, input);
    checkSameDevice(kOp, "bias", *bias, input);
  }
  auto result_sizes = input.sizes().vec();
  result_sizes.back() = weight.size(0);
  checkBroadcastable(kOp, other, result_sizes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linearAddReluBackward(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& result,
    std::array<bool, 3> output_mask) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_linear_add_relu_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, std::array<bool, 3>)>();
  return op.call(grad_output, input, weight, result, output_mask);
}

} // namespace ops
} // namespace torchfuse
