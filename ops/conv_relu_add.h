#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

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

// Also returns the ReLU mask (ops/common/relu_mask.h) of the conv output.
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
