#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace torchfuse::ops {

// True when `converted` is `weight` made channels-last by
// custom_channels_last_weight: weight does not suggest channels-last and
// converted does.
bool convertsToChannelsLast(const at::Tensor& weight, const at::Tensor& converted);

// custom_channels_last_weight: `weight` channels-last where the region may
// run so (the input and every one of `weights` suggest NCHW; CUDA unless
// any_device; with `measured`, where the site's measured choice says so),
// else `weight` itself.
at::Tensor channelsLastWeight(
    const at::Tensor& weight,
    const at::Tensor& input,
    at::TensorList weights,
    bool any_device,
    bool measured);

} // namespace torchfuse::ops
