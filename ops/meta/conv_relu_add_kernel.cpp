#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "ops/conv_relu_add.h"

namespace torchfuse::ops {

at::Tensor emptyConvOutput(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation) {
  const bool batched = input.dim() == weight.dim();
  const auto sizes = convOutputSymSizes(input, weight, stride, padding, dilation);
  const auto format =
      batched ? convOutputMemoryFormat(input, weight) : at::MemoryFormat::Contiguous;
  return at::empty_symint(sizes, input.options().memory_format(format));
}

namespace {

at::Tensor convOutputMeta(const ConvReluAddArgs& a) {
  const auto& [input, weight, bias, stride, padding, dilation, groups, other, alpha] = a;
  if (!anySymbolic({input, weight, orUndefined(bias), other})) {
    checkConvReluAddInputs(a);
  }
  return emptyConvOutput(input, weight, stride, padding, dilation);
}

// NB: relu out of place, as the op's: over a conv output with a size-1
// dimension it picks its own strides (withEagerStrides), which the add
// follows.  Symbolic sizes (torch.compile's dynamic shapes) take the Meta
// ops' strides.
at::Tensor resultMeta(const at::Tensor& conv, const ConvReluAddArgs& a) {
  if (anySymbolic({conv, a.other})) {
    return at::add(at::relu(conv), a.other, a.alpha);
  }
  return emptyEagerResult(conv, a.other);
}

at::Tensor convReluAddMeta(const ConvReluAddArgs& a) {
  return resultMeta(convOutputMeta(a), a);
}

std::tuple<at::Tensor, at::Tensor> convReluAddForwardMeta(const ConvReluAddArgs& a) {
  const auto conv = convOutputMeta(a);
  const bool batched = a.input.dim() == a.weight.dim();
  const c10::SymInt images = batched ? conv.sym_size(0) : c10::SymInt(1);
  c10::SymInt positions = 1;
  for (int64_t d = batched ? 2 : 1; d < conv.dim(); ++d) {
    positions = positions * conv.sym_size(d);
  }
  const auto order = convMaskOrder(a.input, a.weight);
  return {
      resultMeta(conv, a),
      at::empty_symint(
          {convMaskBytes(images, a.weight.sym_size(0), positions, order)},
          a.input.options().dtype(at::kByte))};
}

ConvReluAddGrads convReluAddBackwardMeta(const ConvReluAddBackwardArgs& a) {
  // NB: the CPU and CUDA kernels' checks, mask included.
  if (!anySymbolic({a.grad_output, a.mask, a.input, a.weight})) {
    checkConvReluAddBackwardInputs(a);
  } else {
    checkConvReluAddBackwardMaskType(a.mask);
  }
  const auto& mask = a.output_mask;
  const auto channels = a.weight.sym_size(0);
  return {
      mask[0] ? at::empty_like(a.input) : at::Tensor(),
      mask[1] ? at::empty_like(a.weight) : at::Tensor(),
      mask[2] ? at::empty_symint({channels}, a.weight.options()) : at::Tensor(),
      mask[3] ? at::empty_symint({channels}, a.grad_output.options()) : at::Tensor()};
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  using namespace torchfuse::ops;
  registerConvReluAdd<convReluAddMeta, convReluAddForwardMeta, convReluAddBackwardMeta>(m);
}
