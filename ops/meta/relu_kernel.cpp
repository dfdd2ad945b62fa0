#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "ops/common/relu_mask.h"
#include "ops/relu.h"

namespace torchfuse::ops {
namespace {

// NB: aten::relu's own meta function: the dtypes and strides the CPU and
// CUDA kernels give, and ATen's errors for inputs relu rejects.
at::Tensor reluMeta(const at::Tensor& input) {
  return reluReference(input);
}

std::tuple<at::Tensor, at::Tensor> reluForwardMaskMeta(const at::Tensor& input) {
  return {
      reluReference(input),
      at::empty_symint(
          {reluMaskBytes(input.sym_numel())}, input.options().dtype(at::kByte))};
}

// The CPU kernel's mask checks (skipped for symbolic sizes).
at::Tensor reluBackwardMeta(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    at::OptionalIntArrayRef dim_order) {
  if (!anySymbolic({grad_output, mask})) {
    checkReluBackwardMask(grad_output, mask);
  }
  return reluGradInput(grad_output, dim_order);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  using namespace torchfuse::ops;
  registerRelu<reluMeta, reluForwardMaskMeta, reluBackwardMeta>(m);
}
