#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/relu_mask.h"
#include "ops/relu.h"

namespace torchfuse::ops {

std::tuple<at::Tensor, at::Tensor> reluForwardMaskComposite(
    const at::Tensor& input) {
  auto out = reluReference(input);
  // NB: packed straight from the output: no bool or wider temporaries.
  return {out, packReluMask(out)};
}

at::Tensor reluBackwardComposite(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    at::OptionalIntArrayRef dim_order) {
  checkReluBackwardMask(grad_output, mask);
  return applyReluMask(grad_output, mask, reluGradInput(grad_output, dim_order));
}

} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
  using namespace torchfuse::ops;
  // NB: on the CPU the kernel is aten::relu itself, for every input.
  registerRelu<reluReference, reluForwardMaskComposite, reluBackwardComposite>(m);
}
