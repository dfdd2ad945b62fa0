// custom_conv_relu_add: relu(convolution(input, weight, bias, ...)) + alpha * other.
//   1-d, 2-d and 3-d convolutions (weight 3-, 4- or 5-D), batched or not,
//   integer padding only; other broadcasts with the conv output: a
//   per-channel (C, 1, 1), a scalar-like (1,), or a full tensor.

#include "ops/conv_relu_add.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops/common/checks.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_conv_relu_add(Tensor input, Tensor weight, Tensor? bias, "
      "int[] stride, int[] padding, int[] dilation, int groups, Tensor other, "
      "Scalar alpha=1) -> Tensor");
  m.def(
      "custom_conv_relu_add_forward(Tensor input, Tensor weight, Tensor? bias, "
      "int[] stride, int[] padding, int[] dilation, int groups, Tensor other, "
      "Scalar alpha=1) -> (Tensor, Tensor)");
  m.def(
      "custom_conv_relu_add_backward(Tensor grad_output, Tensor mask, "
      "Tensor input, Tensor weight, int[] stride, int[] padding, "
      "int[] dilation, int groups, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor)");
}

namespace torchfuse {

namespace {
using ConvSignature = at::Tensor(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t,
    const at::Tensor&, const at::Scalar&);
using ConvForwardSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t,
    const at::Tensor&, const at::Scalar&);
using ConvBackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t,
    std::array<bool, 3>);
} // namespace

at::Tensor custom_conv_relu_add(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_conv_relu_add", "")
                       .typed<ConvSignature>();
  return op.call(input, weight, bias, stride, padding, dilation, groups, other, alpha);
}

namespace ops {

namespace {
constexpr const char* kOp = "torchfuse::custom_conv_relu_add";

// conv{1,2,3}d accept a single value for every spatial dimension.
int64_t at1(at::IntArrayRef v, int64_t i) {
  return v.size() == 1 ? v[0] : v[i];
}

void checkParam(const char* name, at::IntArrayRef v, int64_t spatial, int64_t min) {
  TORCH_CHECK(
      v.size() == 1 || static_cast<int64_t>(v.size()) == spatial, kOp,
      ": expected ", name, " to have 1 or ", spatial, " elements, got ", v.size());
  for (const auto x : v) {
    TORCH_CHECK(x >= min, kOp, ": expected ", name, " values >= ", min, ", got ", v);
  }
}
} // namespace

std::vector<int64_t> convOutputSizes(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation) {
  const bool batched = input.dim() == weight.dim();
  std::vector<int64_t> out;
  if (batched) {
    out.push_back(input.size(0));
  }
  out.push_back(weight.size(0));
  const int64_t first = batched ? 2 : 1;
  for (int64_t d = 0; d < weight.dim() - 2; ++d) {
    const int64_t extent = input.size(first + d) + 2 * at1(padding, d) -
        at1(dilation, d) * (weight.size(2 + d) - 1) - 1;
    out.push_back(extent / at1(stride, d) + 1);
  }
  return out;
}

std::vector<int64_t> checkConvReluAddInputs(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other) {
  checkDefined(kOp, "input", input);
  checkDefined(kOp, "weight", weight);
  checkDefined(kOp, "other", other);
  TORCH_CHECK(
      weight.dim() >= 3 && weight.dim() <= 5, kOp,
      ": expected weight to be 3-D, 4-D or 5-D (a 1-d, 2-d or 3-d convolution), got ",
      weight.dim(), "-D");
  const int64_t spatial = weight.dim() - 2;
  TORCH_CHECK(
      input.dim() == weight.dim() || input.dim() == weight.dim() - 1, kOp,
      ": expected input to be ", weight.dim(), "-D (batched) or ",
      weight.dim() - 1, "-D (unbatched) for a ", weight.dim(),
      "-D weight, got ", input.dim(), "-D");
  checkFloating(kOp, "input", input);
  checkSameDtype(kOp, "weight", weight, input);
  checkSameDevice(kOp, "weight", weight, input);
  checkSameDevice(kOp, "other", other, input);
  TORCH_CHECK(groups >= 1, kOp, ": expected groups >= 1, got ", groups);
  checkParam("stride", stride, spatial, 1);
  checkParam("padding", padding, spatial, 0);
  checkParam("dilation", dilation, spatial, 1);
  const bool batched = input.dim() == weight.dim();
  const int64_t channels = input.size(batched ? 1 : 0);
  TORCH_CHECK(
      channels == weight.size(1) * groups, kOp, ": expected input to have ",
      weight.size(1) * groups, " channels (weight.size(1) * groups), got ",
      channels);
  TORCH_CHECK(
      weight.size(0) % groups == 0, kOp,
      ": expected weight.size(0) to be divisible by groups (", groups,
      "), got ", weight.size(0));
  if (bias.has_value() && bias->defined()) {
    checkDim(kOp, "bias", *bias, 1);
    TORCH_CHECK(
        bias->size(0) == weight.size(0), kOp,
        ": expected bias to have weight.size(0) = ", weight.size(0),
        " elements, got ", bias->size(0));
    checkSameDtype(kOp, "bias", *bias, input);
    checkSameDevice(kOp, "bias", *bias, input);
  }
  const int64_t first = batched ? 2 : 1;
  for (int64_t d = 0; d < spatial; ++d) {
    TORCH_CHECK(
        input.size(first + d) + 2 * at1(padding, d) >=
            at1(dilation, d) * (weight.size(2 + d) - 1) + 1,
        kOp, ": expected the padded input (", input.sizes(), " with padding ",
        padding, ") to be at least the dilated kernel size (", weight.sizes(),
        " with dilation ", dilation, ")");
  }
  const auto out = convOutputSizes(input, weight, stride, padding, dilation);
  checkBroadcastable(kOp, other, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> convReluAddForward(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_conv_relu_add_forward", "")
          .typed<ConvForwardSignature>();
  return op.call(input, weight, bias, stride, padding, dilation, groups, other, alpha);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convReluAddBackward(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 3> output_mask) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_conv_relu_add_backward", "")
          .typed<ConvBackwardSignature>();
  return op.call(
      grad_output, mask, input, weight, stride, padding, dilation, groups, output_mask);
}

} // namespace ops
} // namespace torchfuse
