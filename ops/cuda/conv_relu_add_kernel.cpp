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

#include <utility>

#include "ops/common/conv_composites.h"
#include "ops/conv_relu_add.h"
#include "ops/cuda/conv/plan.h"
#include "ops/cuda/conv/strategies.h"

namespace torchfuse::ops {
namespace {

using namespace conv_cuda;

std::tuple<at::Tensor, at::Tensor> forwardCuda(const ConvReluAddArgs& a, bool with_mask) {
  const auto& [input, weight, bias, stride, padding, dilation, groups, other, alpha] = a;
  const auto sizes = checkConvReluAddInputs(a);
  const ConvProblem p{input, weight, stride, padding, dilation, groups, sizes};
  const auto plan = planForward(p, bias, with_mask);
  switch (plan.strategy) {
    case ForwardStrategy::kComposite:
      return with_mask ? convReluAddForwardComposite(a)
                       : std::make_tuple(convReluAddComposite(a), at::Tensor());
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

at::Tensor convReluAddCuda(const ConvReluAddArgs& a) {
  if (!convReluAddHandles(a)) {
    return convReluAddReference(a);
  }
  return withEagerStrides(std::get<0>(forwardCuda(a, /*with_mask=*/false)), a);
}

std::tuple<at::Tensor, at::Tensor> convReluAddForwardCuda(const ConvReluAddArgs& a) {
  auto [out, mask] = forwardCuda(a, /*with_mask=*/true);
  return {withEagerStrides(std::move(out), a), std::move(mask)};
}

ConvReluAddGrads convReluAddBackwardCuda(const ConvReluAddBackwardArgs& a) {
  const auto& [grad_output, mask, input, weight, stride, padding, dilation, groups, output_mask] =
      a;
  const auto sizes = checkConvReluAddBackwardInputs(a);
  // `other` may broadcast the result beyond the conv output's shape.
  auto dy = grad_output.sizes() == at::IntArrayRef(sizes) ? grad_output
                                                           : grad_output.sum_to_size(sizes);
  const ConvProblem p{input, weight, stride, padding, dilation, groups, sizes};
  const auto plan = planBackward(p, dy, mask, output_mask);
  if (plan.strategy == BackwardStrategy::kComposite) {
    return convReluAddBackwardComposite(a);
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
  registerConvReluAdd<convReluAddCuda, convReluAddForwardCuda, convReluAddBackwardCuda>(m);
}
