// The channels-last route by cuDNN, for a large float32 NCHW convolution
// that eager runs in TF32 where the implicit-GEMM kernel does not take it:
// x converted to NHWC, cuDNN's channels-last convolution (faster than its
// NCHW one), and one pass back to NCHW with the epilogue fused in.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "kernels/conv/conv_relu_add.cuh"
#include "ops/common/conv_composites.h"
#include "ops/cuda/conv/strategies.h"

namespace torchfuse::ops::conv_cuda {

at::Tensor forwardChannelsLastCudnn(
    const ConvProblem& p,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  const auto& input = p.input;
  c10::cuda::CUDAGuard guard(input.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto dtype = input.scalar_type();
  const int64_t images = input.size(0), in_channels = input.size(1);
  const EpilogueOperands operands(bias, other, p.sizes, 1, dtype);
  auto x = at::empty_like(input, at::MemoryFormat::ChannelsLast);
  TORCHFUSE_DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add", [&] {
    kernels::transposeBatched<CudaType<scalar_t>::type>(
        {cudaPtr<scalar_t>(input), cudaPtr<scalar_t>(x), images, in_channels,
         input.numel() / std::max<int64_t>(1, images * in_channels)},
        stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto conv = convolve(
      x, p.weight.contiguous(at::MemoryFormat::ChannelsLast), std::nullopt, p.stride, p.padding,
      p.dilation, p.groups);
  x.reset();
  if (!conv.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    conv = conv.contiguous(at::MemoryFormat::ChannelsLast); // not seen: the epilogue reads NHWC
  }
  const auto e = convExtents(p.sizes, /*batched=*/true);
  auto out = at::empty(p.sizes, input.options());
  TORCHFUSE_DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add", [&] {
    kernels::convReluAddEpilogueNhwcToNchw<CudaType<scalar_t>::type>(
        {cudaPtr<scalar_t>(conv), operands.biasPtr<scalar_t>(), operands.otherPtr<scalar_t>(),
         alpha.toFloat(), cudaPtr<scalar_t>(out), /*mask=*/nullptr, e.images, e.channels,
         e.positions},
        stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return operands.addUnfused(out, other, alpha);
}

} // namespace torchfuse::ops::conv_cuda
