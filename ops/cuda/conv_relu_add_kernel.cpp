// custom_conv_relu_add on CUDA: each call checks its arguments, picks one
// strategy for its problem (ops/cuda/conv/plan.h) and runs it
// (ops/cuda/conv/strategies.h, one file each):
//   forward:  the direct convolution (small float32 inference problems);
//             the channels-last route for large float32 NCHW problems that
//             eager runs in TF32, by the sm_90 implicit-GEMM kernel or by
//             cuDNN's channels-last convolution; else eager's own
//             convolution and one pass for the epilogue and the relu mask;
//   backward: one pass masking grad_output and summing the conv bias's and
//             `other`'s gradients, then eager's convolution_backward, or
//             the channels-last route's gradient convolutions where the
//             route took the forward.
// Inputs the kernels do not take run the composites
// (ops/common/conv_composites.h).  docs/kernels/conv_relu_add.md gives the
// design and its measurements.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "ops/common/conv_composites.h"
#include "ops/conv_relu_add.h"
#include "ops/cuda/conv/plan.h"
#include "ops/cuda/conv/strategies.h"

namespace torchfuse::ops {
namespace {

using namespace conv_cuda;

std::tuple<at::Tensor, at::Tensor> forwardCuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha,
    bool with_mask) {
  const auto sizes =
      checkConvReluAddInputs(input, weight, bias, stride, padding, dilation, groups, other);
  const ConvProblem p{input, weight, stride, padding, dilation, groups, sizes};
  const auto plan = planForward(p, bias, with_mask);
  switch (plan.strategy) {
    case ForwardStrategy::kComposite:
      return with_mask
          ? convReluAddForwardComposite(
                input, weight, bias, stride, padding, dilation, groups, other, alpha)
          : std::make_tuple(
                convReluAddComposite(
                    input, weight, bias, stride, padding, dilation, groups, other, alpha),
                at::Tensor());
    case ForwardStrategy::kDirect:
      return {forwardDirect(p, bias, other, alpha, *plan.direct), at::Tensor()};
    case ForwardStrategy::kImplicitGemm:
      return forwardImplicitGemm(
          p, bias, other, alpha, *plan.implicit_gemm, plan.x_conversion, with_mask);
    case ForwardStrategy::kChannelsLastCudnn:
      return {forwardChannelsLastCudnn(p, bias, other, alpha), at::Tensor()};
    case ForwardStrategy::kCudnnThenEpilogue:
      break;
  }
  return forwardCudnnThenEpilogue(p, bias, other, alpha, with_mask);
}

at::Tensor convReluAddCuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  if (!convReluAddHandles(input, weight, bias, stride, padding, dilation, groups, other, alpha)) {
    return convReluAddReference(input, weight, bias, stride, padding, dilation, groups, other, alpha);
  }
  return std::get<0>(forwardCuda(
      input, weight, bias, stride, padding, dilation, groups, other, alpha, /*with_mask=*/false));
}

std::tuple<at::Tensor, at::Tensor> convReluAddForwardCuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  return forwardCuda(
      input, weight, bias, stride, padding, dilation, groups, other, alpha, /*with_mask=*/true);
}

ConvReluAddGrads convReluAddBackwardCuda(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 4> output_mask) {
  const auto sizes = checkConvReluAddBackwardInputs(
      grad_output, mask, input, weight, stride, padding, dilation, groups);
  // `other` may broadcast the result beyond the conv output's shape.
  auto dy = grad_output.sizes() == at::IntArrayRef(sizes) ? grad_output
                                                           : grad_output.sum_to_size(sizes);
  const ConvProblem p{input, weight, stride, padding, dilation, groups, sizes};
  const auto plan = planBackward(p, dy, mask, output_mask);
  if (plan.strategy == BackwardStrategy::kComposite) {
    return convReluAddBackwardComposite(
        grad_output, mask, input, weight, stride, padding, dilation, groups, output_mask);
  }
  c10::cuda::CUDAGuard guard(input.device());
  const auto* mask_ptr = reinterpret_cast<const uint32_t*>(mask.data_ptr<uint8_t>());
  if (plan.strategy == BackwardStrategy::kChannelsLast) {
    return backwardChannelsLast(dy, mask_ptr, p, output_mask, plan.data_gradient);
  }
  return backwardMaskedGradThenCudnn(std::move(dy), mask_ptr, p, output_mask);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  using namespace torchfuse::ops;
  m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add"), TORCH_FN(convReluAddCuda));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_forward"),
      TORCH_FN(convReluAddForwardCuda));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_backward"),
      TORCH_FN(convReluAddBackwardCuda));
}
