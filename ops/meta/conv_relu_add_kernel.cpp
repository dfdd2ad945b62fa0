#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "ops/conv_relu_add.h"

namespace torchfuse::ops {
namespace {

int64_t at1(at::IntArrayRef v, int64_t i) {
  return v.size() == 1 ? v[0] : v[i];
}

// The conv output, in symbolic sizes where the input has them, in the memory
// format eager's convolution gives.
at::Tensor convOutputMeta(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other) {
  if (!anySymbolic({input, weight, orUndefined(bias), other})) {
    checkConvReluAddInputs(input, weight, bias, stride, padding, dilation, groups, other);
  }
  const bool batched = input.dim() == weight.dim();
  std::vector<c10::SymInt> sizes;
  if (batched) {
    sizes.push_back(input.sym_size(0));
  }
  sizes.push_back(weight.sym_size(0));
  const int64_t first = batched ? 2 : 1;
  for (int64_t d = 0; d < weight.dim() - 2; ++d) {
    const auto extent = input.sym_size(first + d) + 2 * at1(padding, d) -
        at1(dilation, d) * (weight.sym_size(2 + d) - 1) - 1;
    sizes.push_back(extent / at1(stride, d) + 1);
  }
  const auto format = batched ? convOutputMemoryFormat(input, weight)
                               : at::MemoryFormat::Contiguous;
  return at::empty_symint(sizes, input.options().memory_format(format));
}

at::Tensor convReluAddMeta(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  const auto conv = convOutputMeta(
      input, weight, bias, stride, padding, dilation, groups, other);
  return at::add(conv, other, alpha);
}

std::tuple<at::Tensor, at::Tensor> convReluAddForwardMeta(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  const auto conv = convOutputMeta(
      input, weight, bias, stride, padding, dilation, groups, other);
  const bool batched = input.dim() == weight.dim();
  const c10::SymInt images = batched ? conv.sym_size(0) : c10::SymInt(1);
  c10::SymInt positions = 1;
  for (int64_t d = batched ? 2 : 1; d < conv.dim(); ++d) {
    positions = positions * conv.sym_size(d);
  }
  return {
      at::add(conv, other, alpha),
      at::empty_symint(
          {convMaskBytes(images, weight.sym_size(0), positions, convMaskOrder(input, weight))},
          input.options().dtype(at::kByte))};
}

ConvReluAddGrads convReluAddBackwardMeta(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 4> output_mask) {
  // NB: the CPU and CUDA kernels' checks, mask included.
  if (!anySymbolic({grad_output, mask, input, weight})) {
    checkConvReluAddBackwardInputs(
        grad_output, mask, input, weight, stride, padding, dilation, groups);
  } else {
    checkConvReluAddBackwardMaskType(mask);
  }
  return {
      output_mask[0] ? at::empty_like(input) : at::Tensor(),
      output_mask[1] ? at::empty_like(weight) : at::Tensor(),
      output_mask[2] ? at::empty_symint({weight.sym_size(0)}, weight.options()) : at::Tensor(),
      output_mask[3] ? at::empty_symint({weight.sym_size(0)}, grad_output.options())
                     : at::Tensor()};
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add"),
      TORCH_FN(convReluAddMeta));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_forward"),
      TORCH_FN(convReluAddForwardMeta));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_backward"),
      TORCH_FN(convReluAddBackwardMeta));
}
