#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/linear_add_relu.h"
#include "ops/common/autograd_utils.h"

namespace torchfuse::ops {
namespace {

// NB: the shape rules of linear, add and relu are ATen's own meta functions,
// so the composition itself runs on meta tensors.
at::Tensor linearAddReluMeta(const LinearAddReluArgs& a) {
  if (!anySymbolic({a.input, a.weight, orUndefined(a.bias), a.other})) {
    checkLinearAddReluInputs(a);
  }
  return at::relu(at::add(at::linear(a.input, a.weight, a.bias), a.other, a.alpha));
}

LinearAddReluGrads linearAddReluBackwardMeta(const LinearAddReluBackwardArgs& a) {
  const auto& mask = a.output_mask;
  constexpr auto contiguous = at::MemoryFormat::Contiguous;
  return {
      mask[0] ? at::empty_like(a.input, contiguous) : at::Tensor(),
      mask[1] ? at::empty_like(a.weight, contiguous) : at::Tensor(),
      mask[2] ? at::empty_symint({a.weight.sym_size(0)}, a.grad_output.options()) : at::Tensor(),
      at::empty_like(a.grad_output)};
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  using namespace torchfuse::ops;
  registerLinearAddRelu<linearAddReluMeta, linearAddReluBackwardMeta>(m);
}
