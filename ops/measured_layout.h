#pragma once

#include <ATen/core/Tensor.h>

namespace torchfuse::ops {

// Whether this call of custom_channels_last_weight(measured=true) converts:
// the measured choice (ops/common/measured_choice.h) of the call site,
// keyed by the converted weight (the module's parameter), the input's
// device, sizes and dtype, grad mode and CUDA autocast.  The original
// (false) where nothing can be timed: not CUDA, a stream capturing a CUDA
// graph (the decision once made), or deterministic algorithms asked for (a
// timed choice differs from run to run).
bool measuredChannelsLast(const at::Tensor& weight, const at::Tensor& input);

} // namespace torchfuse::ops
