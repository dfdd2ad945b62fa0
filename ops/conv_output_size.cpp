// custom_conv_output_size: the sizes of conv{1,2,3}d(input, weight, ...)'s
// output, from the sizes of `input` and `weight` alone.  FuseConvBatchNormAct
// (passes/fuse_conv_batch_norm_act.cpp) points a BatchNorm's reads of its
// input's size here, so that the conv output stays inside the fused op and
// the reads come where they came.
//
// NB: one call in C++.  The same arithmetic written in TorchScript costs
// about 200 interpreted instructions per chain and call once the profiling
// executor unrolls its loops (resnet50's training step: 0.6 ms of host time
// over 53 chains, on a step that the host bounds).  A conv on meta tensors
// would cost about 80 us.
//
// The conv ops' own convOutputSymSizes for the shapes a conv accepts (a
// one-element stride, padding or dilation holds for every spatial
// dimension, as ATen expands it).  Shapes a conv rejects give zeros, no one
// value per channel: the conv then raises its own error in the fused op, as
// it did in the original before the reads.
//
// NB: CompositeImplicitAutograd on symbolic sizes, so that it runs on every
// backend and under fake tensors.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "ops/conv_output_size.h"
#include "ops/conv_relu_add.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_conv_output_size(Tensor input, Tensor weight, int[] stride, int[] padding, "
      "int[] dilation) -> SymInt[]");
}

namespace torchfuse::ops {
namespace {

// Whether conv{1,2,3}d takes these shapes and arguments as far as the
// output size goes: ranks, list lengths, positive strides and dilations,
// paddings of 0 or more and, for concrete sizes, an input no smaller than
// the dilated kernel.
bool sizesHold(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation) {
  const int64_t spatial = weight.dim() - 2;
  if (spatial < 1 || (input.dim() != weight.dim() && input.dim() != weight.dim() - 1)) {
    return false;
  }
  const auto expands = [&](at::IntArrayRef list) {
    return list.size() == 1 || static_cast<int64_t>(list.size()) == spatial;
  };
  if (!expands(stride) || !expands(padding) || !expands(dilation)) {
    return false;
  }
  const int64_t first = input.dim() - spatial;
  for (int64_t d = 0; d < spatial; ++d) {
    if (at1(stride, d) <= 0 || at1(dilation, d) <= 0 || at1(padding, d) < 0) {
      return false;
    }
    const auto x = input.sym_size(first + d).maybe_as_int();
    const auto k = weight.sym_size(2 + d).maybe_as_int();
    if (x && k && *x + 2 * at1(padding, d) - at1(dilation, d) * (*k - 1) - 1 < 0) {
      return false;
    }
  }
  return true;
}

std::vector<c10::SymInt> convOutputSize(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation) {
  if (auto sizes = acceptedConvOutputSizes(input, weight, stride, padding, dilation)) {
    return *std::move(sizes);
  }
  // NB: no one value per channel, and two entries at least, which
  // BatchNorm's check indexes
  return std::vector<c10::SymInt>(std::max<int64_t>(weight.dim(), 2), 0);
}

} // namespace

std::optional<std::vector<c10::SymInt>> acceptedConvOutputSizes(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation) {
  if (!sizesHold(input, weight, stride, padding, dilation)) {
    return std::nullopt;
  }
  return convOutputSymSizes(input, weight, stride, padding, dilation);
}

} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CompositeImplicitAutograd, m) {
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_output_size"),
      TORCH_FN(torchfuse::ops::convOutputSize));
}
