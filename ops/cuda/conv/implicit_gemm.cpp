// The channels-last route's convolution by the sm_90 implicit-GEMM kernel:
// x to NHWC and the weight to [k][r][s][c], both rounded to TF32, then one
// kernel for the convolution and the epilogue, written NCHW (and the relu
// mask, in training).  x is converted by the kernel itself, on its idle
// warps, where TMA can read it as NCHW; else by a pass of its own before.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/conv/conv_relu_add.cuh"
#include "ops/cuda/conv/strategies.h"

namespace torchfuse::ops::conv_cuda {

std::tuple<at::Tensor, at::Tensor> forwardImplicitGemm(
    const ConvProblem& p,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha,
    const kernels::ImplicitGemmConv& g,
    int x_conversion,
    bool with_mask) {
  const auto& input = p.input;
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor mask;
  if (with_mask) {
    const auto e = convExtents(p.sizes, /*batched=*/true);
    // zeroed: the kernel ORs in the words two tiles share
    mask = at::zeros(
        {convMaskBytes(e, ConvMaskOrder::PositionsInner)}, input.options().dtype(at::kByte));
  }
  uint32_t* mask_ptr = with_mask ? reinterpret_cast<uint32_t*>(mask.data_ptr<uint8_t>()) : nullptr;
  const EpilogueOperands operands(bias, other, p.sizes, 1, at::kFloat);
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto x = at::empty_like(input, at::MemoryFormat::ChannelsLast);
  auto w = at::empty({g.k, g.r, g.s, g.c}, p.weight.options());
  kernels::transposeBatchedTf32(
      {cudaPtr<float>(p.weight), cudaPtr<float>(w), g.k, g.c, g.r * g.s}, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto out = at::empty(p.sizes, input.options());
  bool launched = false;
  if (x_conversion >= 0) {
    auto workspace =
        at::empty({kernels::implicitGemmConvWorkspaceWords(g)}, input.options().dtype(at::kInt));
    launched = kernels::implicitGemmConvReluAddFromNchw(
        {cudaPtr<float>(input), reinterpret_cast<uint32_t*>(workspace.data_ptr<int32_t>()),
         x_conversion},
        {cudaPtr<float>(x), cudaPtr<float>(w), operands.biasPtr<float>(),
         operands.otherPtr<float>(), alpha.toFloat(), cudaPtr<float>(out), mask_ptr},
        g, stream);
  } else {
    kernels::transposeBatchedTf32(
        {cudaPtr<float>(input), cudaPtr<float>(x), g.n, g.c, g.h * g.w}, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launched = kernels::implicitGemmConvReluAdd(
        {cudaPtr<float>(x), cudaPtr<float>(w), operands.biasPtr<float>(),
         operands.otherPtr<float>(), alpha.toFloat(), cudaPtr<float>(out), mask_ptr},
        g, stream);
  }
  TORCH_CHECK(
      launched,
      "torchfuse::custom_conv_relu_add: the CUDA driver refused the tensor maps of the "
      "implicit-GEMM convolution");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {operands.addUnfused(out, other, alpha), mask};
}

} // namespace torchfuse::ops::conv_cuda
