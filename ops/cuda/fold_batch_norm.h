#pragma once

// Eval BatchNorm folded into the conv weight and bias before it, in one CUDA
// launch (kernels/batch_norm/fold_into_conv.cuh); custom_conv_batch_norm_act
// calls it where autograd records nothing.

#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>

namespace torchfuse::ops {

// (weight * s, (bias - mean) * s + beta), s = gamma / sqrt(var + eps), in
// weight's dtype and strides; nullopt where the kernel does not apply (a
// dtype other than float, half or bfloat16, tensors of other dtypes or
// devices, a weight whose out-channel is not its outermost dense dimension,
// strided per-channel tensors): the caller folds with ATen ops then.
std::optional<std::pair<at::Tensor, at::Tensor>> foldBatchNormCuda(
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight,
    const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps);

} // namespace torchfuse::ops
