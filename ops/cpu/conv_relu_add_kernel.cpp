#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/conv_relu_add.h"
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

namespace {

std::vector<int64_t> expanded(at::IntArrayRef v, int64_t n) {
  return v.size() == 1 ? std::vector<int64_t>(n, v[0]) : v.vec();
}

// [N, C, S...] (or [C, S...]) viewed as [N, C, positions].
at::Tensor asImagesChannelsPositions(const at::Tensor& t, bool batched) {
  const auto b = batched ? t : t.unsqueeze(0);
  // NB: explicit, not -1: an empty batch leaves -1 ambiguous.
  const int64_t positions = c10::multiply_integers(b.sizes().slice(2));
  return b.reshape({b.size(0), b.size(1), positions});
}

int64_t paddedChannels(int64_t channels) {
  return (channels + 31) / 32 * 32;
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

at::Tensor packConvMask(const at::Tensor& keep, bool batched) {
  const auto k = asImagesChannelsPositions(keep, batched);
  auto padded = at::zeros(
      {k.size(0), k.size(2), paddedChannels(k.size(1))}, k.options().dtype(at::kBool));
  padded.narrow(2, 0, k.size(1)).copy_(k.transpose(1, 2));
  return packReluMask(padded);
}

at::Tensor unpackConvMask(const at::Tensor& mask, at::IntArrayRef conv_sizes, bool batched) {
  const int64_t images = batched ? conv_sizes[0] : 1;
  const int64_t channels = conv_sizes[batched ? 1 : 0];
  const int64_t positions =
      c10::multiply_integers(conv_sizes) / std::max<int64_t>(1, images * channels);
  const auto keep = unpackReluMask(mask, {images, positions, paddedChannels(channels)});
  return keep.narrow(2, 0, channels).transpose(1, 2).reshape(conv_sizes);
}

at::Tensor convReluAddComposite(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  checkConvReluAddInputs(input, weight, bias, stride, padding, dilation, groups, other);
  const auto conv = convolve(input, weight, bias, stride, padding, dilation, groups);
  return at::add(at::relu(conv), other, alpha);
}

std::tuple<at::Tensor, at::Tensor> convReluAddForwardComposite(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  checkConvReluAddInputs(input, weight, bias, stride, padding, dilation, groups, other);
  const auto conv = convolve(input, weight, bias, stride, padding, dilation, groups);
  return {
      at::add(at::relu(conv), other, alpha),
      packConvMask(reluKeep(conv), input.dim() == weight.dim())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convReluAddBackwardComposite(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 3> output_mask) {
  const auto conv_sizes = checkConvReluAddBackwardInputs(
      grad_output, mask, input, weight, stride, padding, dilation, groups);
  const bool batched = input.dim() == weight.dim();
  // `other` may broadcast the result beyond the conv output's shape.
  const auto summed = grad_output.sum_to_size(conv_sizes).to(input.scalar_type());
  // NB: a select, not a product: a masked NaN or Inf gradient gives 0.
  const auto grad = at::where(
      unpackConvMask(mask, conv_sizes, batched), summed, at::zeros({}, summed.options()));
  return convolveBackward(grad, input, weight, stride, padding, dilation, groups, output_mask);
}

} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add"),
      TORCH_FN(convReluAddComposite));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_forward"),
      TORCH_FN(convReluAddForwardComposite));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_backward"),
      TORCH_FN(convReluAddBackwardComposite));
}
