#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace torchfuse::ops {

// conv{1,2,3}d(input, weight, ...)'s output sizes (convOutputSymSizes)
// where the conv takes these shapes and arguments as far as the sizes go
// (ranks, list lengths, positive strides and dilations, paddings of 0 or
// more, an input no smaller than the dilated kernel); nullopt elsewhere.
// custom_conv_output_size's kernel gives these, or zeros.
std::optional<std::vector<c10::SymInt>> acceptedConvOutputSizes(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation);

} // namespace torchfuse::ops
