#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

#include <array>
#include <optional>
#include <tuple>

namespace torchfuse::ops {

// The checks every entry point runs, with torchfuse's messages: only for
// inputs that the original chain rejects too (missing tensors, a weight of
// rank 0 or > 2, in_features or weight dtype mismatches, a 1-D bias of the
// wrong length, an `other` that does not broadcast, a weight or a non-scalar
// `other` on another device).
void checkLinearAddReluInputs(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other);

// True when the op's own kernels take these inputs: dense strided, not
// quantized; input float32, float64, float16 or bfloat16, with weight and
// bias of its dtype and `other` promoting to one of those; one device; a 2-D
// weight, a 1-D bias of out_features, `other` broadcastable with the linear
// output; a real, non-bool alpha.  Never throws.
bool linearAddReluHandles(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha);

// The original chain, relu(add(linear(input, weight, bias), other, alpha)),
// after checkLinearAddReluInputs: the CPU kernel, and what every entry point
// runs for inputs linearAddReluHandles refuses (ATen's results, errors and
// autograd).
at::Tensor linearAddReluReference(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha);

// Made of differentiable ATen ops: the Autograd kernel of the backward op
// calls it directly when a graph is recorded (double backward).
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
