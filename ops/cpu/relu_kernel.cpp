#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/relu_mask.h"
#include "ops/relu.h"

namespace torchfuse::ops {

at::Tensor reluComposite(const at::Tensor& input) {
  return at::relu(input);
}

std::tuple<at::Tensor, at::Tensor> reluForwardMaskComposite(
    const at::Tensor& input) {
  auto out = at::relu(input);
  return {out, packReluMask(reluKeep(out))};
}

at::Tensor reluBackwardComposite(
    const at::Tensor& grad_output,
    const at::Tensor& mask) {
  TORCH_CHECK(
      mask.scalar_type() == at::kByte &&
          mask.numel() == reluMaskBytes(grad_output.numel()),
      "torchfuse::custom_relu_backward: expected mask to be a uint8 tensor of ",
      reluMaskBytes(grad_output.numel()), " bytes, got ", mask.scalar_type(),
      " of ", mask.numel());
  // masked_fill, not a product: a NaN gradient where the output was clamped
  // must give 0, as threshold_backward does.
  return grad_output.masked_fill(
      unpackReluMask(mask, grad_output.sizes()).logical_not(), 0);
}

} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
  using namespace torchfuse::ops;
  m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_relu"), TORCH_FN(reluComposite));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_relu_forward_mask"),
      TORCH_FN(reluForwardMaskComposite));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_relu_backward"),
      TORCH_FN(reluBackwardComposite));
}
