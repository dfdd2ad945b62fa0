// The channels-last route's backward for an NCHW float32 convolution:
// cuDNN's channels-last data- and weight-gradient convolutions are faster
// than its NCHW ones (docs/kernels/conv_relu_add.md).  g is made NHWC in the
// masking pass itself, which also sums the bias's and other's gradients.
// The input gradient: on sm_90, where the problem fits, the implicit-GEMM
// kernel writes it NCHW from g rounded to TF32 in that pass; else cuDNN's,
// converted back to eager's NCHW.  The weight gradient: cuDNN's, with x
// converted to NHWC.  The caller holds the device guard.

#include <ATen/cuda/CUDAContext.h>

#include "kernels/conv/conv_relu_add.cuh"
#include "ops/common/conv_composites.h"
#include "ops/cuda/conv/strategies.h"

namespace torchfuse::ops::conv_cuda {

ConvReluAddGrads backwardChannelsLast(
    const at::Tensor& dy,
    const uint32_t* mask,
    const ConvProblem& p,
    std::array<bool, 4> output_mask,
    const std::optional<kernels::ImplicitGemmConv>& dgrad) {
  const auto& input = p.input;
  const auto& weight = p.weight;
  const auto& sizes = p.sizes;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto dtype = input.scalar_type();
  const int64_t images = sizes[0], channels = sizes[1], positions = sizes[2] * sizes[3];
  const auto src = dy.contiguous();
  auto g = at::empty(sizes, src.options().memory_format(at::MemoryFormat::ChannelsLast));
  const GradSums sums(
      kernels::convReluAddGradNchwToNhwcParts(images, channels, positions), channels, src,
      output_mask);
  int64_t parts = 0;
  TORCHFUSE_DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add_backward", [&] {
    parts = kernels::convReluAddGradNchwToNhwc<CudaType<scalar_t>::type>(
        {cudaPtr<scalar_t>(src), mask, cudaPtr<scalar_t>(g), sums.gPtr(), sums.dyPtr(), images,
         channels, positions},
        /*tf32=*/dgrad.has_value(), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor grad_input, grad_weight;
  if (dgrad) {
    const auto flipped = weight.flip({2, 3});
    auto w = at::empty({dgrad->k, dgrad->r, dgrad->s, dgrad->c}, weight.options());
    kernels::transposeBatchedTf32(
        {cudaPtr<float>(flipped), cudaPtr<float>(w), 1, dgrad->c, dgrad->k * dgrad->r * dgrad->s},
        stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    grad_input = at::empty(input.sizes(), input.options());
    TORCH_CHECK(
        kernels::implicitGemmConv(
            cudaPtr<float>(g), cudaPtr<float>(w), cudaPtr<float>(grad_input), *dgrad, stream),
        "torchfuse::custom_conv_relu_add_backward: the CUDA driver refused the tensor maps of "
        "the implicit-GEMM convolution");
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const bool cudnn_dgrad = output_mask[0] && !dgrad;
  if (cudnn_dgrad || output_mask[1]) {
    auto x = at::empty_like(input, at::MemoryFormat::ChannelsLast);
    TORCHFUSE_DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add_backward", [&] {
      kernels::transposeBatched<CudaType<scalar_t>::type>(
          {cudaPtr<scalar_t>(input), cudaPtr<scalar_t>(x), input.size(0), input.size(1),
           input.size(2) * input.size(3)},
          stream);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    at::Tensor grad_x;
    std::tie(grad_x, grad_weight, std::ignore) = convolveBackward(
        g, x, weight.contiguous(at::MemoryFormat::ChannelsLast), p.stride, p.padding, p.dilation,
        p.groups, {cudnn_dgrad, output_mask[1], false});
    x.reset();
    if (grad_x.defined()) {
      grad_x = grad_x.contiguous(at::MemoryFormat::ChannelsLast); // cuDNN's is already
      grad_input = at::empty(input.sizes(), input.options());
      TORCHFUSE_DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add_backward", [&] {
        kernels::transposeBatched<CudaType<scalar_t>::type>(
            {cudaPtr<scalar_t>(grad_x), cudaPtr<scalar_t>(grad_input), input.size(0),
             input.size(2) * input.size(3), input.size(1)},
            stream);
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  if (grad_weight.defined()) {
    grad_weight = grad_weight.contiguous();
  }
  const auto [grad_bias, grad_channels] = sums.reduce(parts, dtype);
  return {grad_input, grad_weight, grad_bias, grad_channels};
}

} // namespace torchfuse::ops::conv_cuda
