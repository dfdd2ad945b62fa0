#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstddef>
#include <tuple>
#include <type_traits>

namespace torchfuse::ops {

// Registers one dispatch key's kernels: Op for custom_relu, and ForwardMask
// and Backward for custom_relu_forward_mask and custom_relu_backward where
// not nullptr.
template <auto Op, auto ForwardMask = nullptr, auto Backward = nullptr>
void registerRelu(torch::Library& m) {
  m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_relu"), TORCH_FN(Op));
  if constexpr (!std::is_same_v<decltype(ForwardMask), std::nullptr_t>) {
    m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_relu_forward_mask"), TORCH_FN(ForwardMask));
  }
  if constexpr (!std::is_same_v<decltype(Backward), std::nullptr_t>) {
    m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_relu_backward"), TORCH_FN(Backward));
  }
}

// True when custom_relu's own kernels take `input`: a defined, strided, not
// quantized tensor of float32, float64, float16 or bfloat16.  Never throws.
bool reluHandles(const at::Tensor& input);

// The original chain, aten::relu: what every entry point runs for inputs
// that reluHandles refuses (ATen's own errors, results and autograd).
at::Tensor reluReference(const at::Tensor& input);

// The mask checks of custom_relu_backward, shared by its CPU, CUDA and Meta
// kernels: a 1-D uint8 mask of reluMaskBytes(grad_output.numel()) bytes on
// grad_output's device.
void checkReluBackwardMask(const at::Tensor& grad_output, const at::Tensor& mask);

// Reference kernels: ATen compositions that run on any device.
std::tuple<at::Tensor, at::Tensor> reluForwardMaskComposite(
    const at::Tensor& input);
at::Tensor reluBackwardComposite(
    const at::Tensor& grad_output,
    const at::Tensor& mask);

// Dispatcher calls of the internal ops.
std::tuple<at::Tensor, at::Tensor> reluForwardMask(const at::Tensor& input);
at::Tensor reluBackward(const at::Tensor& grad_output, const at::Tensor& mask);

} // namespace torchfuse::ops
