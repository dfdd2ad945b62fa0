#pragma once

// The conv op's composites: ATen compositions that run on any device.  The
// CPU kernels are these; the CUDA kernels call them where their own kernels
// do not take a problem, and the Autograd and Autocast kernels call
// convolve and convReluAddBackwardComposite.

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

#include <array>
#include <optional>
#include <tuple>

#include "ops/conv_relu_add.h"

namespace torchfuse::ops {

// Eager's convolution (conv1d/2d/3d: every backend, unbatched inputs too) and
// its backward, on any device.
at::Tensor convolve(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups);
// a's convolution (bias included).
at::Tensor convolve(const ConvReluAddArgs& a);
// The gradients of a convolution (without bias: grad_bias is grad's sums)
// for output_mask's (input, weight, bias).  `recording`: for a backward that
// records a graph, as convolutions, whose first derivative reads only
// symbolic sizes (convolution_backward's does not); else
// convolution_backward, which is faster.
std::tuple<at::Tensor, at::Tensor, at::Tensor> convolveBackward(
    const at::Tensor& grad,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 3> output_mask,
    bool recording = false);

// conv += bias, broadcast over the channel dimension of conv, the output
// (batched or not) of a convolution by `weight`: what eager's cuDNN
// convolution does after a convolution without bias.
void addConvBias(at::Tensor& conv, const std::optional<at::Tensor>& bias, const at::Tensor& weight);

// The composites' pointwise part, on `conv`, the convolution of input and
// weight (bias included) already computed: relu(conv) + alpha * other and,
// with_mask, the ReLU mask in the order convMaskOrder(input, weight) defines
// (else an undefined tensor).  input and weight serve only that order.
// NB: one definition, which the composites and the CUDA kernel's fallback
// both call, so a fallback need not compute the convolution again.
std::tuple<at::Tensor, at::Tensor> convReluAddEpilogueComposite(
    const at::Tensor& conv,
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& other,
    const at::Scalar& alpha,
    bool with_mask);

at::Tensor convReluAddComposite(const ConvReluAddArgs& a);

// Also returns the ReLU mask of the conv output (convMaskBytes).
std::tuple<at::Tensor, at::Tensor> convReluAddForwardComposite(const ConvReluAddArgs& a);

// grad_channels of a conv-output-shaped tensor: its sums over every
// dimension but the channel one (1 when batched, else 0).
at::Tensor convChannelSums(const at::Tensor& t, bool batched);

ConvReluAddGrads convReluAddBackwardComposite(const ConvReluAddBackwardArgs& a);

} // namespace torchfuse::ops
