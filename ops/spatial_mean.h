#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

namespace torchfuse::ops {

// Registers one dispatch key's kernel of custom_spatial_mean.
template <auto Op>
void registerSpatialMean(torch::Library& m) {
  m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_spatial_mean"), TORCH_FN(Op));
}

// The original, aten::adaptive_avg_pool2d(input, [1, 1]): what every entry
// point runs for inputs the CUDA kernel does not take, and, with a graph
// recorded, what autograd differentiates.
at::Tensor spatialMeanReference(const at::Tensor& input);

// True when the CUDA kernel takes `input`: a 4-D channels-last CUDA tensor
// (dense NHWC strides) of float32, float16 or bfloat16 with at least one
// element, fewer than 2^31 of them and at most 65535
// images.  Never throws.
bool spatialMeanHandles(const at::Tensor& input);

} // namespace torchfuse::ops
