// custom_spatial_mean: adaptive_avg_pool2d(input, [1, 1]), the squeeze of a
// squeeze-and-excitation block.  ATen computes it as a mean over H and W;
// on a channels-last input that reduction splits each (image, channel)
// across blocks through a global staging buffer (135 MiB for efficientnet_b0's
// first squeeze in float16 at batch 64), which the CUDA kernel here does not
// need.  passes/convert_to_channels_last.cpp puts it where the region's
// values are channels-last.
//
// Every other input, every other device, and every call that records a
// graph run the reference, the original op, so that results, strides,
// errors and derivatives (of any order) are ATen's.

#include "ops/spatial_mean.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops/common/checks.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def("custom_spatial_mean(Tensor self) -> Tensor");
}

namespace torchfuse {

at::Tensor custom_spatial_mean(const at::Tensor& input) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_spatial_mean", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(input);
}

namespace ops {

at::Tensor spatialMeanReference(const at::Tensor& input) {
  checkDefined("torchfuse::custom_spatial_mean", "self", input);
  return at::adaptive_avg_pool2d(input, {1, 1});
}

bool spatialMeanHandles(const at::Tensor& input) {
  if (!input.defined() || !input.is_cuda() || input.dim() != 4 || !isPlainDenseTensor(input)) {
    return false;
  }
  const auto s = input.scalar_type();
  if (s != at::kFloat && s != at::kHalf && s != at::kBFloat16) {
    return false;
  }
  const int64_t n = input.size(0), c = input.size(1), h = input.size(2), w = input.size(3);
  // NB: dense NHWC strides exactly, not is_contiguous(channels_last), which
  // also holds for layouts the kernel's indexing does not read (size-1 dims
  // with any stride).
  // NB: one image per grid y index.
  return input.numel() > 0 && input.numel() < (int64_t(1) << 31) && n <= 65535 &&
      input.stride(1) == 1 && input.stride(3) == c && input.stride(2) == w * c &&
      input.stride(0) == h * w * c;
}

} // namespace ops
} // namespace torchfuse

TORCH_LIBRARY_IMPL(torchfuse, CompositeExplicitAutograd, m) {
  // NB: backends without a torchfuse kernel (and calls with None) reach the
  // original op here.
  torchfuse::ops::registerSpatialMean<torchfuse::ops::spatialMeanReference>(m);
}
