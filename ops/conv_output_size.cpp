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
// As ATen's conv_output_size for the shapes a conv accepts, with floor
// division; a one-element stride, padding or dilation holds for every
// spatial dimension, as ATen expands it.  Shapes a conv rejects give sizes
// that need not match anything (a 0 where an argument list is too short or
// a stride is 0): the conv then raises its own error in the fused op, as it
// did in the original before the reads.
//
// NB: CompositeImplicitAutograd on symbolic sizes, so that it runs on every
// backend and under fake tensors.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_conv_output_size(Tensor input, Tensor weight, int[] stride, int[] padding, "
      "int[] dilation) -> SymInt[]");
}

namespace torchfuse::ops {
namespace {

// The i-th of a conv argument list, expanded as ATen expands one element;
// nullopt where the list has no such element.
std::optional<int64_t> expanded(at::IntArrayRef list, size_t i) {
  if (list.size() == 1) {
    return list[0];
  }
  if (i < list.size()) {
    return list[i];
  }
  return std::nullopt;
}

c10::SymInt floorDivide(const c10::SymInt& a, int64_t b) {
  if (auto concrete = a.maybe_as_int()) {
    const int64_t q = *concrete / b;
    return (*concrete % b != 0 && ((*concrete < 0) != (b < 0))) ? q - 1 : q;
  }
  return a / b; // NB: symbolic division is floor division
}

std::vector<c10::SymInt> convOutputSize(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation) {
  const auto xs = input.sym_sizes();
  const auto ws = weight.sym_sizes();
  std::vector<c10::SymInt> out;
  if (ws.size() < 2) {
    return out;
  }
  const size_t spatial = ws.size() - 2;
  if (xs.size() == ws.size()) {
    out.push_back(xs[0]);
  }
  out.push_back(ws[0]);
  if (xs.size() < spatial) {
    return out;
  }
  const size_t first = xs.size() - spatial;
  for (size_t i = 0; i < spatial; ++i) {
    const auto s = expanded(stride, i);
    const auto p = expanded(padding, i);
    const auto d = expanded(dilation, i);
    if (!s || !p || !d || *s == 0) {
      out.emplace_back(0);
      continue;
    }
    out.push_back(floorDivide(xs[first + i] + 2 * *p - *d * (ws[2 + i] - 1) - 1, *s) + 1);
  }
  return out;
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CompositeImplicitAutograd, m) {
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_output_size"),
      TORCH_FN(torchfuse::ops::convOutputSize));
}
