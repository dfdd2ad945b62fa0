// The direct convolution for few channels: one kernel for the convolution
// and the epilogue, where cuDNN's launches and host overhead cost more than
// the arithmetic (small float32 inference problems, plan.cpp).

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops/cuda/conv/strategies.h"

namespace torchfuse::ops::conv_cuda {

at::Tensor forwardDirect(
    const ConvProblem& p,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha,
    const kernels::DirectConv& g) {
  c10::cuda::CUDAGuard guard(p.input.device());
  const EpilogueOperands operands(bias, other, p.sizes, 1, at::kFloat);
  auto out = at::empty(p.sizes, p.input.options());
  kernels::directConvReluAdd(
      {cudaPtr<float>(p.input), cudaPtr<float>(p.weight), operands.biasPtr<float>(),
       operands.otherPtr<float>(), alpha.toFloat(), cudaPtr<float>(out), /*mask=*/nullptr},
      g, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return operands.addUnfused(out, other, alpha);
}

} // namespace torchfuse::ops::conv_cuda
