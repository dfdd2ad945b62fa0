#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace torchfuse::ops {

// True when a convolution of `entry` (4-D, or unbatched 3-D) with a
// contiguous weight returns channels-last in eager PyTorch.
bool entryIsChannelsLast(const at::Tensor& entry);

// custom_restore_layout: `self` when entryIsChannelsLast(entry) (with
// `converted`: unless custom_channels_last_weight converted `entry` into
// it), else `self` with canonical contiguous strides (a copy where it has
// others).
at::Tensor restoreLayout(
    const at::Tensor& self,
    const at::Tensor& entry,
    const std::optional<at::Tensor>& converted);

} // namespace torchfuse::ops
