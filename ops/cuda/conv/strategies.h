#pragma once

// The CUDA strategies of custom_conv_relu_add, one file each; plan.h picks
// one per call.  Each takes a problem its plan admitted.

#include <array>
#include <optional>
#include <tuple>

#include "kernels/conv/direct_conv.cuh"
#include "kernels/conv/implicit_gemm_sm90.cuh"
#include "ops/conv_relu_add.h"
#include "ops/cuda/conv/operands.h"

namespace torchfuse::ops::conv_cuda {

// direct.cpp: one kernel for the convolution and the epilogue (inference).
at::Tensor forwardDirect(
    const ConvProblem& p,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha,
    const kernels::DirectConv& g);

// implicit_gemm.cpp: the sm_90 implicit-GEMM kernel, NCHW in and out, the
// epilogue (and, with_mask, the relu mask) fused; returns (out, mask).
std::tuple<at::Tensor, at::Tensor> forwardImplicitGemm(
    const ConvProblem& p,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha,
    const kernels::ImplicitGemmConv& g,
    int x_conversion,
    bool with_mask);

// channels_last_cudnn.cpp: x to NHWC, cuDNN's channels-last convolution,
// one pass back to NCHW with the epilogue (inference).
at::Tensor forwardChannelsLastCudnn(
    const ConvProblem& p,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha);

// cudnn_then_epilogue.cpp: eager's convolution, then one pass for the
// epilogue (and, with_mask, the relu mask); returns (out, mask).
std::tuple<at::Tensor, at::Tensor> forwardCudnnThenEpilogue(
    const ConvProblem& p,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha,
    bool with_mask);

// channels_last_backward.cpp: the channels-last route's backward of an NCHW
// float32 convolution; the input gradient by the implicit-GEMM kernel where
// data_gradient holds its problem.
ConvReluAddGrads backwardChannelsLast(
    const at::Tensor& dy,
    const uint32_t* mask,
    const ConvProblem& p,
    std::array<bool, 4> output_mask,
    const std::optional<kernels::ImplicitGemmConv>& data_gradient);

// masked_grad_then_cudnn.cpp: one pass masking dy in the mask's order and
// summing the bias's and other's gradients, then eager's
// convolution_backward.
ConvReluAddGrads backwardMaskedGradThenCudnn(
    at::Tensor dy,
    const uint32_t* mask,
    const ConvProblem& p,
    std::array<bool, 4> output_mask);

} // namespace torchfuse::ops::conv_cuda
