#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/relu_mask.h"

namespace torchfuse::ops {
namespace {

at::Tensor reluMeta(const at::Tensor& input) {
  return at::empty_like(input);
}

std::tuple<at::Tensor, at::Tensor> reluForwardMaskMeta(const at::Tensor& input) {
  return {
      at::empty_like(input),
      at::empty_symint(
          {reluMaskBytes(input.sym_numel())}, input.options().dtype(at::kByte))};
}

at::Tensor reluBackwardMeta(const at::Tensor& grad_output, const at::Tensor& mask) {
  return at::empty_like(grad_output);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  using namespace torchfuse::ops;
  m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_relu"), TORCH_FN(reluMeta));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_relu_forward_mask"),
      TORCH_FN(reluForwardMaskMeta));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_relu_backward"),
      TORCH_FN(reluBackwardMeta));
}
