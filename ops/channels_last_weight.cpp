// custom_channels_last_weight: the entry of a channels-last region in an
// unfrozen graph (passes/convert_to_channels_last.cpp).  The weights are
// module attributes there, read at run time, so the pass cannot store them
// channels-last; instead the first convolution's weight is converted on
// each call, and ATen's convolution, which goes channels-last when its input
// or its weight is, runs it and the region after it in NHWC.
//
// NB: it converts only where the original's region is all contiguous: the
// input suggests NCHW and so does every region weight (a channels-last
// weight makes the original's convolution channels-last from there on).
// custom_restore_layout(v, weight, result) reads the same decision back
// from the pair: it restores contiguous strides exactly when this op
// converted.  any_device false: CUDA inputs only.  measured (the pass's
// layout="auto"): where it could convert, the call site's measured choice
// decides whether it does (ops/measured_layout.h), since the FLOP cost
// model does not see the host work of the per-call conversions.
//
// NB: CompositeImplicitAutograd, as aten::contiguous (whose alias schema
// this shares): the gradient reaches the weight through the copy, and
// AccumulateGrad gives it the parameter's own strides.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/channels_last_weight.h"
#include "ops/common/checks.h"
#include "ops/measured_layout.h"
#include "ops/restore_layout.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_channels_last_weight(Tensor(a) weight, Tensor input, Tensor[] weights, "
      "bool any_device, bool measured=False) -> Tensor(a)");
}

namespace torchfuse::ops {

namespace {
constexpr const char* kOp = "torchfuse::custom_channels_last_weight";

bool suggestsChannelsLast(const at::Tensor& t) {
  return t.dim() == 4 && t.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
}
} // namespace

bool convertsToChannelsLast(const at::Tensor& weight, const at::Tensor& converted) {
  return !suggestsChannelsLast(weight) && suggestsChannelsLast(converted);
}

at::Tensor channelsLastWeight(
    const at::Tensor& weight,
    const at::Tensor& input,
    at::TensorList weights,
    bool any_device,
    bool measured) {
  checkDefined(kOp, "weight", weight);
  checkDefined(kOp, "input", input);
  if ((!any_device && !input.is_cuda()) || weight.dim() != 4 || entryIsChannelsLast(input)) {
    return weight;
  }
  for (const auto& w : weights) {
    if (!w.defined() || w.dim() != 4 || w.suggest_memory_format() != at::MemoryFormat::Contiguous) {
      return weight;
    }
  }
  if (measured && !measuredChannelsLast(weight, input)) {
    return weight;
  }
  auto converted = weight.contiguous(at::MemoryFormat::ChannelsLast);
  // NB: a weight whose channels-last strides do not suggest channels-last
  // (they coincide with its contiguous ones) would not steer the convolution.
  return convertsToChannelsLast(weight, converted) ? converted : weight;
}

} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CompositeImplicitAutograd, m) {
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_channels_last_weight"),
      TORCH_FN(torchfuse::ops::channelsLastWeight));
}
