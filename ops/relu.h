#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace torchfuse::ops {

// Reference kernels: ATen compositions that run on any device.
at::Tensor reluComposite(const at::Tensor& input);
std::tuple<at::Tensor, at::Tensor> reluForwardMaskComposite(
    const at::Tensor& input);
at::Tensor reluBackwardComposite(
    const at::Tensor& grad_output,
    const at::Tensor& mask);

// Dispatcher calls of the internal ops.
std::tuple<at::Tensor, at::Tensor> reluForwardMask(const at::Tensor& input);
at::Tensor reluBackward(const at::Tensor& grad_output, const at::Tensor& mask);

} // namespace torchfuse::ops
