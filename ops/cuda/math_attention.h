#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace torchfuse::ops {

// scaled_dot_product_attention(query, key, value) by ATen's math path with a
// mask true everywhere, as one kernel (kernels/attention/math_attention.cuh),
// where the kernel takes the call: float32 CUDA tensors of rank 3 or 4 with
// one batch shape (no broadcast), whose scores, K and V fit the device's
// shared memory; nullopt otherwise.  The caller decides that the math path
// is what the call would run, and that autograd records nothing.
std::optional<at::Tensor> mathAttentionCuda(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    std::optional<double> scale);

} // namespace torchfuse::ops
