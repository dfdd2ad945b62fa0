#include "ops/common/conv_composites.h"

#include <ATen/ATen.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
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

void addConvBias(
    at::Tensor& conv,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& weight) {
  if (bias && bias->defined()) {
    // [C, 1, ...]: the trailing dimensions of a batched output and all of an
    // unbatched one.
    std::vector<int64_t> bias_sizes(weight.dim() - 1, 1);
    bias_sizes[0] = bias->size(0);
    conv.add_(bias->reshape(bias_sizes));
  }
}

namespace {

std::vector<int64_t> expanded(at::IntArrayRef v, int64_t n) {
  return v.size() == 1 ? std::vector<int64_t>(n, v[0]) : v.vec();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolutionBackward(
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
  // NB: SymInts (weight.sym_size, not size): the differentiable backward
  // calls this while tracing with symbolic shapes.
  const std::vector<c10::SymInt> bias_sizes{weight.sym_size(0)};
  const auto strides = expanded(stride, spatial);
  const auto paddings = expanded(padding, spatial);
  const auto dilations = expanded(dilation, spatial);
  const std::vector<int64_t> output_padding(spatial, 0);
  auto [grad_input, grad_weight, grad_bias] = at::convolution_backward_symint(
      batched ? grad : grad.unsqueeze(0), batched ? input : input.unsqueeze(0), weight,
      output_mask[2] ? at::OptionalSymIntArrayRef(bias_sizes) : std::nullopt,
      c10::fromIntArrayRefSlow(strides), c10::fromIntArrayRefSlow(paddings),
      c10::fromIntArrayRefSlow(dilations), /*transposed=*/false,
      c10::fromIntArrayRefSlow(output_padding), groups, output_mask);
  if (!batched && grad_input.defined()) {
    grad_input = grad_input.squeeze(0);
  }
  return {grad_input, grad_weight, grad_bias};
}

// convolutionBackward as convolutions, whose derivative is convolution_backward.
// NB: for the backward that records a graph (double backward):
// convolution_backward's own derivative, _convolution_double_backward,
// reads concrete sizes, so it cannot be traced with symbolic shapes
// (torch.compile, torch.export, opcheck's test_aot_dispatch_dynamic); these
// convolutions' first derivative can.  The plain backward keeps
// convolution_backward, which is faster.
//   grad_input: the transposed convolution of grad with weight, its
//     output_padding what restores input's size;
//   grad_weight: per group, the convolution of input (input channels as the
//     batch, images as channels) with grad (images as channels), stride and
//     dilation swapped, cut to the kernel's size;
//   grad_bias: grad's sums per channel.
std::tuple<at::Tensor, at::Tensor, at::Tensor> convolutionBackwardAsConvolutions(
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
  const auto x = batched ? input : input.unsqueeze(0);
  const auto gy = batched ? grad : grad.unsqueeze(0);
  const auto strides = expanded(stride, spatial);
  const auto paddings = expanded(padding, spatial);
  const auto dilations = expanded(dilation, spatial);
  const std::vector<int64_t> zeros(spatial, 0);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) {
    std::vector<c10::SymInt> output_padding;
    for (int64_t d = 0; d < spatial; ++d) {
      output_padding.push_back(
          x.sym_size(2 + d) + 2 * paddings[d] -
          ((gy.sym_size(2 + d) - 1) * strides[d] + dilations[d] * (weight.sym_size(2 + d) - 1) +
           1));
    }
    grad_input = at::convolution_symint(
        gy, weight, std::nullopt, c10::fromIntArrayRefSlow(strides),
        c10::fromIntArrayRefSlow(paddings), c10::fromIntArrayRefSlow(dilations),
        /*transposed=*/true, output_padding, groups);
    if (!batched) {
      grad_input = grad_input.squeeze(0);
    }
  }
  if (output_mask[1]) {
    // x[n, g * ci + i] as [i, g * N + n]; gy[n, o] as [o, n].
    const auto images = x.sym_size(0);
    const auto ci = weight.sym_size(1);
    std::vector<c10::SymInt> split{images, groups, ci};
    std::vector<int64_t> order{2, 1, 0};
    std::vector<c10::SymInt> merged{ci, images * groups};
    for (int64_t d = 0; d < spatial; ++d) {
      split.push_back(x.sym_size(2 + d));
      merged.push_back(x.sym_size(2 + d));
      order.push_back(3 + d);
    }
    const auto xs = x.reshape_symint(split).permute(order).reshape_symint(merged);
    auto w = at::convolution_symint(
                 xs, gy.transpose(0, 1), std::nullopt, c10::fromIntArrayRefSlow(dilations),
                 c10::fromIntArrayRefSlow(paddings), c10::fromIntArrayRefSlow(strides),
                 /*transposed=*/false, c10::fromIntArrayRefSlow(zeros), groups)
                 .transpose(0, 1);
    for (int64_t d = 0; d < spatial; ++d) {
      w = w.narrow_symint(2 + d, 0, weight.sym_size(2 + d));
    }
    grad_weight = w;
  }
  if (output_mask[2]) {
    grad_bias = convChannelSums(gy, /*batched=*/true);
  }
  return {grad_input, grad_weight, grad_bias};
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
    std::array<bool, 3> output_mask,
    bool recording) {
  return (recording ? convolutionBackwardAsConvolutions : convolutionBackward)(
      grad, input, weight, stride, padding, dilation, groups, output_mask);
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
  // NB: with symbolic sizes (the differentiable backward traced by
  // torch.compile or torch.export) the checks that need no sizes, and the
  // sizes as SymInts, so that none is specialised.
  if (anySymbolic({grad_output, mask, input, weight})) {
    checkConvReluAddBackwardMaskType(mask);
  } else {
    checkConvReluAddBackwardInputs(a);
  }
  const auto conv_sizes = convOutputSymSizes(input, weight, stride, padding, dilation);
  const bool batched = input.dim() == weight.dim();
  // `other` may broadcast the result beyond the conv output's shape.
  const auto dy = grad_output.sum_to_size_symint(conv_sizes);
  const auto summed = dy.to(input.scalar_type());
  // NB: a select, not a product: a masked NaN or Inf gradient gives 0.
  const auto grad = at::where(
      unpackConvMask(mask, conv_sizes, batched, convMaskOrder(input, weight)), summed,
      at::zeros({}, summed.options()));
  auto [grad_input, grad_weight, grad_bias] = convolveBackward(
      grad, input, weight, stride, padding, dilation, groups,
      {output_mask[0], output_mask[1], output_mask[2]}, needsGraph(grad_output, input, weight));
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
