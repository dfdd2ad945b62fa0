#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/linear_add_relu.h"
#include "ops/common/autograd_utils.h"

namespace torchfuse::ops {
namespace {

// NB: the shape rules of linear, add and relu are ATen's own meta functions,
// so the composition itself runs on meta tensors.
at::Tensor linearAddReluMeta(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  if (!anySymbolic({input, weight, orUndefined(bias), other})) {
    checkLinearAddReluInputs(input, weight, bias, other);
  }
  return at::relu(at::add(at::linear(input, weight, bias), other, alpha));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linearAddReluBackwardMeta(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& result,
    std::array<bool, 3> output_mask) {
  return {
      output_mask[0] ? at::empty_like(input, at::MemoryFormat::Contiguous) : at::Tensor(),
      output_mask[1] ? at::empty_like(weight, at::MemoryFormat::Contiguous) : at::Tensor(),
      output_mask[2] ? at::empty_symint({weight.sym_size(0)}, grad_output.options()) : at::Tensor(),
      at::empty_like(grad_output)};
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_linear_add_relu"),
      TORCH_FN(linearAddReluMeta));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_linear_add_relu_backward"),
      TORCH_FN(linearAddReluBackwardMeta));
}
