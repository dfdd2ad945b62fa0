#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>
#include <torch/library.h>

#include <cstddef>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

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

// The order of t's dims from outermost to innermost in memory, for a
// non-overlapping and dense t; nullopt for any other.
std::optional<std::vector<int64_t>> reluDimOrder(const at::Tensor& t);

// The uninitialised grad_input of custom_relu_backward: dim_order's layout
// (checked to be a permutation of grad_output's dims) where given, else
// empty_like(grad_output).  Shared by every kernel, Meta included, so that
// all give the same strides.
at::Tensor reluGradInput(const at::Tensor& grad_output, at::OptionalIntArrayRef dim_order);

// Reference kernels: ATen compositions that run on any device.
std::tuple<at::Tensor, at::Tensor> reluForwardMaskComposite(
    const at::Tensor& input);
at::Tensor reluBackwardComposite(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    at::OptionalIntArrayRef dim_order);

// Dispatcher calls of the internal ops.
std::tuple<at::Tensor, at::Tensor> reluForwardMask(const at::Tensor& input);
at::Tensor reluBackward(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    at::OptionalIntArrayRef dim_order = std::nullopt);

} // namespace torchfuse::ops
