#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/core/SymInt.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace torchfuse::ops {

// The shape of the convolution's output (before broadcasting with other).
std::vector<int64_t> convOutputSizes(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation);

// The memory format of a batched convolution's output in eager PyTorch:
// channels-last when the input or the weight is.
at::MemoryFormat convOutputMemoryFormat(const at::Tensor& input, const at::Tensor& weight);

// Checks the arguments and returns the convolution's output shape.
std::vector<int64_t> checkConvReluAddInputs(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other);

// The ReLU mask custom_conv_relu_add_forward returns: one bit per conv output
// element, !(t <= 0) for the pre-activation t, in channels-last order
// (image, spatial position, channel) with each position's channels padded to
// whole 32-bit words, packed as ops/common/relu_mask.h describes.  It is the
// order in which the CUDA kernels (kernels/conv/conv_relu_add.cuh) write one
// word per warp ballot next to cuDNN's channels-last output.  An unbatched
// output counts as one image.
c10::SymInt convMaskBytes(
    const c10::SymInt& images, const c10::SymInt& channels, const c10::SymInt& positions);

// keep: a bool tensor shaped like the conv output.
at::Tensor packConvMask(const at::Tensor& keep, bool batched);

// The bool tensor shaped `conv_sizes` that packConvMask packed.
at::Tensor unpackConvMask(const at::Tensor& mask, at::IntArrayRef conv_sizes, bool batched);

// Checks the backward's arguments and returns the conv output's shape.
std::vector<int64_t> checkConvReluAddBackwardInputs(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups);

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
std::tuple<at::Tensor, at::Tensor, at::Tensor> convolveBackward(
    const at::Tensor& grad,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 3> output_mask);

// Reference kernels: ATen compositions that run on any device.
at::Tensor convReluAddComposite(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha);

// Also returns the ReLU mask of the conv output (convMaskBytes).
std::tuple<at::Tensor, at::Tensor> convReluAddForwardComposite(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha);

// Returns (grad_input, grad_weight, grad_bias), undefined where output_mask is
// false.  The gradient of `other` is grad_output itself, reduced by the caller.
std::tuple<at::Tensor, at::Tensor, at::Tensor> convReluAddBackwardComposite(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 3> output_mask);

std::tuple<at::Tensor, at::Tensor> convReluAddForward(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha);

std::tuple<at::Tensor, at::Tensor, at::Tensor> convReluAddBackward(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 3> output_mask);

} // namespace torchfuse::ops
