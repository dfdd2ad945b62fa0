// The backward everywhere the channels-last route's does not run: one pass
// masking dy and summing the conv bias's and `other`'s gradients, then
// eager's convolution_backward.  g goes to convolution_backward in the conv
// output's layout, as eager's relu backward gives it; that layout is the
// mask's order.  The caller holds the device guard.

#include <ATen/cuda/CUDAContext.h>

#include "kernels/conv/conv_relu_add.cuh"
#include "ops/common/conv_composites.h"
#include "ops/cuda/conv/strategies.h"

namespace torchfuse::ops::conv_cuda {

ConvReluAddGrads backwardMaskedGradThenCudnn(
    at::Tensor dy,
    const uint32_t* mask,
    const ConvProblem& p,
    std::array<bool, 4> output_mask) {
  const auto& input = p.input;
  const auto& weight = p.weight;
  const auto& sizes = p.sizes;
  const bool batched = input.dim() == weight.dim();
  const auto e = convExtents(sizes, batched);
  const auto order = convMaskOrder(input, weight);
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor g;
  int64_t parts = 0;
  std::optional<GradSums> sums;
  if (order == ConvMaskOrder::PositionsInner) {
    // NB: a dy in another layout costs one ATen copy here: the streaming
    // pass reads dy in the mask's (nchw) order.
    dy = dy.contiguous();
    g = at::empty(sizes, dy.options());
    parts = kernels::convReluAddGradPartsPositionsInner(e.images, e.channels, e.positions);
    sums.emplace(parts, e.channels, dy, output_mask);
    TORCHFUSE_DISPATCH_KERNEL_TYPES(dy.scalar_type(), "custom_conv_relu_add_backward", [&] {
      kernels::convReluAddGradProloguePositionsInner<CudaType<scalar_t>::type>(
          {cudaPtr<scalar_t>(dy), mask, cudaPtr<scalar_t>(g), sums->gPtr(), sums->dyPtr(), e.images,
           e.channels, e.positions},
          stream);
    });
  } else {
    const auto format = convOutputMemoryFormat(input, weight); // channels-last
    if (!dy.is_contiguous() && !isChannelsLast(dy)) {
      dy = dy.contiguous(format);
    }
    g = at::empty(sizes, dy.options().memory_format(format));
    parts = kernels::convReluAddGradPartsChannelsInner(e.images, e.channels, e.positions);
    sums.emplace(parts, e.channels, dy, output_mask);
    TORCHFUSE_DISPATCH_KERNEL_TYPES(dy.scalar_type(), "custom_conv_relu_add_backward", [&] {
      kernels::convReluAddGradPrologueChannelsInner<CudaType<scalar_t>::type>(
          {cudaPtr<scalar_t>(dy), mask, cudaPtr<scalar_t>(g), sums->gPtr(), sums->dyPtr(), e.images,
           e.channels, e.positions},
          /*dy_nchw=*/!isChannelsLast(dy), /*g_nchw=*/false, stream);
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor grad_input, grad_weight;
  if (output_mask[0] || output_mask[1]) {
    std::tie(grad_input, grad_weight, std::ignore) = convolveBackward(
        g, input, weight, p.stride, p.padding, p.dilation, p.groups,
        {output_mask[0], output_mask[1], false});
  }
  const auto [grad_bias, grad_channels] = sums->reduce(parts, input.scalar_type());
  return {grad_input, grad_weight, grad_bias, grad_channels};
}

} // namespace torchfuse::ops::conv_cuda
