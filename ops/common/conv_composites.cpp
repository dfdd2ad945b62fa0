#include "ops/common/conv_composites.h"

#include <ATen/ATen.h>

#include "ops/common/relu_mask.h"

namespace torchfuse::ops {

at::Tensor convolve(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  // NB: conv{1,2,3}d, not convolution: they also take unbatched inputs.
  switch (weight.dim()) {
    case 3:
      return at::conv1d(input, weight, bias, stride, padding, dilation, groups);
    case 4:
      return at::conv2d(input, weight, bias, stride, padding, dilation, groups);
    default:
      return at::conv3d(input, weight, bias, stride, padding, dilation, groups);
  }
}

at::Tensor convolve(const ConvReluAddArgs& a) {
  return convolve(a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups);
}

namespace {

std::vector<int64_t> expanded(at::IntArrayRef v, int64_t n) {
  return v.size() == 1 ? std::vector<int64_t>(n, v[0]) : v.vec();
}

} // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolveBackward(
    const at::Tensor& grad,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 3> output_mask) {
  const bool batched = input.dim() == weight.dim();
  const int64_t spatial = weight.dim() - 2;
  const std::vector<int64_t> bias_sizes{weight.size(0)};
  auto [grad_input, grad_weight, grad_bias] = at::convolution_backward(
      batched ? grad : grad.unsqueeze(0), batched ? input : input.unsqueeze(0), weight,
      output_mask[2] ? at::OptionalIntArrayRef(bias_sizes) : std::nullopt,
      expanded(stride, spatial), expanded(padding, spatial), expanded(dilation, spatial),
      /*transposed=*/false, std::vector<int64_t>(spatial, 0), groups, output_mask);
  if (!batched && grad_input.defined()) {
    grad_input = grad_input.squeeze(0);
  }
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> convReluAddEpilogueComposite(
    const at::Tensor& conv,
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& other,
    const at::Scalar& alpha,
    bool with_mask) {
  return {
      at::add(at::relu(conv), other, alpha),
      with_mask
          ? packConvMask(reluKeep(conv), input.dim() == weight.dim(), convMaskOrder(input, weight))
          : at::Tensor()};
}

namespace {

// Checks a, then relu(conv) + alpha * other and, with_mask, the ReLU mask.
std::tuple<at::Tensor, at::Tensor> checkedComposite(const ConvReluAddArgs& a, bool with_mask) {
  checkConvReluAddInputs(a);
  return convReluAddEpilogueComposite(convolve(a), a.input, a.weight, a.other, a.alpha, with_mask);
}

} // namespace

at::Tensor convReluAddComposite(const ConvReluAddArgs& a) {
  if (!convReluAddHandles(a)) {
    return convReluAddReference(a);
  }
  return std::get<0>(checkedComposite(a, /*with_mask=*/false));
}

std::tuple<at::Tensor, at::Tensor> convReluAddForwardComposite(const ConvReluAddArgs& a) {
  return checkedComposite(a, /*with_mask=*/true);
}

ConvReluAddGrads convReluAddBackwardComposite(const ConvReluAddBackwardArgs& a) {
  const auto& [grad_output, mask, input, weight, stride, padding, dilation, groups, output_mask] =
      a;
  const auto conv_sizes = checkConvReluAddBackwardInputs(a);
  const bool batched = input.dim() == weight.dim();
  // `other` may broadcast the result beyond the conv output's shape.
  const auto dy = grad_output.sum_to_size(conv_sizes);
  const auto summed = dy.to(input.scalar_type());
  // NB: a select, not a product: a masked NaN or Inf gradient gives 0.
  const auto grad = at::where(
      unpackConvMask(mask, conv_sizes, batched, convMaskOrder(input, weight)), summed,
      at::zeros({}, summed.options()));
  auto [grad_input, grad_weight, grad_bias] = convolveBackward(
      grad, input, weight, stride, padding, dilation, groups,
      {output_mask[0], output_mask[1], output_mask[2]});
  return {
      grad_input, grad_weight, grad_bias,
      output_mask[3] ? convChannelSums(dy, batched) : at::Tensor()};
}

at::Tensor convChannelSums(const at::Tensor& t, bool batched) {
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d != (batched ? 1 : 0)) {
      dims.push_back(d);
    }
  }
  return t.sum(dims);
}

} // namespace torchfuse::ops
