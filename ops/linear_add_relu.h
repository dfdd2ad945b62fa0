#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

#include <array>
#include <optional>
#include <tuple>

namespace torchfuse::ops {

void checkLinearAddReluInputs(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other);

// Reference kernels: ATen compositions that run on any device.
at::Tensor linearAddReluComposite(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha);

// Returns (grad_input, grad_weight, grad_bias, grad_sum): grad_sum is the
// gradient of the sum `linear + alpha * other` (the masked grad_output); the
// Autograd kernel reduces it to other's shape.  The first three are undefined
// where output_mask is false.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linearAddReluBackwardComposite(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& result,
    std::array<bool, 3> output_mask);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linearAddReluBackward(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& result,
    std::array<bool, 3> output_mask);

} // namespace torchfuse::ops
