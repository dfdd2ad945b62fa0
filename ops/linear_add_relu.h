#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <torch/library.h>

#include <array>
#include <cstddef>
#include <optional>
#include <tuple>
#include <type_traits>

namespace torchfuse::ops {

// The arguments of custom_linear_add_relu, as its kernels and helpers take
// them.
// NB: references to the dispatcher's arguments, so a value lives no longer
// than the call that packed it.
struct LinearAddReluArgs {
  const at::Tensor& input;
  const at::Tensor& weight;
  const std::optional<at::Tensor>& bias;
  const at::Tensor& other;
  const at::Scalar& alpha;
};

// The arguments of custom_linear_add_relu_backward: result is the forward's
// output, whose ReLU mask the backward reads.
struct LinearAddReluBackwardArgs {
  const at::Tensor& grad_output;
  const at::Tensor& input;
  const at::Tensor& weight;
  const at::Tensor& result;
  std::array<bool, 3> output_mask;
};

// (grad_input, grad_weight, grad_bias, grad_sum): grad_sum is the gradient
// of the sum `linear + alpha * other` (the masked grad_output), which the
// Autograd kernel reduces to other's shape.  The first three are undefined
// where output_mask is false.
using LinearAddReluGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The kernels registered for the ops, one template a schema: they unpack the
// dispatcher's arguments into the structs above and call F.
template <auto F>
at::Tensor linearAddReluKernel(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  return F(LinearAddReluArgs{input, weight, bias, other, alpha});
}

template <auto F>
LinearAddReluGrads linearAddReluBackwardKernel(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& result,
    std::array<bool, 3> output_mask) {
  return F(LinearAddReluBackwardArgs{grad_output, input, weight, result, output_mask});
}

// Registers one dispatch key's kernels: Op for custom_linear_add_relu, and
// Backward for _backward where not nullptr.
template <auto Op, auto Backward = nullptr>
void registerLinearAddRelu(torch::Library& m) {
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_linear_add_relu"), TORCH_FN(linearAddReluKernel<Op>));
  if constexpr (!std::is_same_v<decltype(Backward), std::nullptr_t>) {
    m.impl(
        TORCH_SELECTIVE_NAME("torchfuse::custom_linear_add_relu_backward"),
        TORCH_FN(linearAddReluBackwardKernel<Backward>));
  }
}

// The checks every entry point runs, with torchfuse's messages: only for
// inputs that the original chain rejects too (missing tensors, a weight of
// rank 0 or > 2, in_features or weight dtype mismatches, a 1-D bias of the
// wrong length, an `other` that does not broadcast, a weight or a non-scalar
// `other` on another device).
void checkLinearAddReluInputs(const LinearAddReluArgs& a);

// True when the op's own kernels take these inputs: dense strided, not
// quantized; input float32, float64, float16 or bfloat16, with weight and
// bias of its dtype and `other` promoting to one of those; one device; a 2-D
// weight, a 1-D bias of out_features, `other` broadcastable with the linear
// output; a real, non-bool alpha.  Never throws.
bool linearAddReluHandles(const LinearAddReluArgs& a);

// The original chain, relu(add(linear(input, weight, bias), other, alpha)),
// after checkLinearAddReluInputs: the CPU kernel, and what every entry point
// runs for inputs linearAddReluHandles refuses (ATen's results, errors and
// autograd).
at::Tensor linearAddReluReference(const LinearAddReluArgs& a);

// Made of differentiable ATen ops: the Autograd kernel of the backward op
// calls it directly when a graph is recorded (double backward).
LinearAddReluGrads linearAddReluBackwardComposite(const LinearAddReluBackwardArgs& a);

// The ops through the dispatcher: custom_linear_add_relu and _backward.
at::Tensor linearAddRelu(const LinearAddReluArgs& a);
LinearAddReluGrads linearAddReluBackward(const LinearAddReluBackwardArgs& a);

} // namespace torchfuse::ops
