#pragma once

// custom_conv_relu_add on CUDA: which strategy runs a problem, chosen once
// per call by planForward / planBackward from the problem (shapes, strides,
// dtype, layout, device, cuDNN's flags) and torchfuse::backends::conv().
// docs/kernels/conv_relu_add.md describes each strategy and why it runs
// where it does.

#include <array>
#include <optional>

#include "kernels/conv/direct_conv.cuh"
#include "kernels/conv/implicit_gemm_sm90.cuh"
#include "ops/cuda/conv/operands.h"

namespace torchfuse::ops::conv_cuda {

enum class ForwardStrategy {
  kComposite,         // inputs the kernels do not take: the composites
  kDirect,            // direct.cpp
  kImplicitGemm,      // implicit_gemm.cpp
  kChannelsLastCudnn, // channels_last_cudnn.cpp
  kCudnnThenEpilogue, // cudnn_then_epilogue.cpp
};

struct ForwardPlan {
  ForwardStrategy strategy = ForwardStrategy::kCudnnThenEpilogue;
  std::optional<kernels::DirectConv> direct;              // kDirect's problem
  std::optional<kernels::ImplicitGemmConv> implicit_gemm; // kImplicitGemm's problem
  // kImplicitGemm: -1 when a pass of its own converts x to NHWC before the
  // kernel, else the kernel converts it, at most this many images ahead of
  // the convolution (0: the kernel's own choice).
  int x_conversion = -1;
};

// with_mask: the training forward, which also writes the relu mask.
ForwardPlan planForward(
    const ConvProblem& p,
    const std::optional<at::Tensor>& bias,
    bool with_mask);

enum class BackwardStrategy {
  kComposite,           // inputs the kernels do not take: the composite
  kChannelsLast,        // channels_last_backward.cpp
  kMaskedGradThenCudnn, // masked_grad_then_cudnn.cpp
};

struct BackwardPlan {
  BackwardStrategy strategy = BackwardStrategy::kMaskedGradThenCudnn;
  // kChannelsLast: the input gradient's problem for the implicit-GEMM
  // kernel, where it takes it; else cuDNN's.
  std::optional<kernels::ImplicitGemmConv> data_gradient;
};

// dy: grad_output summed to the conv output's sizes.
BackwardPlan planBackward(
    const ConvProblem& p,
    const at::Tensor& dy,
    const at::Tensor& mask,
    std::array<bool, 4> output_mask);

} // namespace torchfuse::ops::conv_cuda
