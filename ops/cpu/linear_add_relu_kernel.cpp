#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/linear_add_relu.h"

namespace torchfuse::ops {

LinearAddReluGrads linearAddReluBackwardComposite(const LinearAddReluBackwardArgs& a) {
  const auto& [grad_output, input, weight, result, output_mask] = a;
  const int64_t in_features = weight.size(1);
  const int64_t out_features = weight.size(0);
  // Eager relu's own backward: the gradient passes where !(result <= 0).
  // NB: in a double backward its derivative gives `result` an explicit zero
  // gradient, which flows back through the op into linear and other, as
  // eager's flows through relu (0 times an infinite derivative is NaN).
  const auto grad_sum =
      at::threshold_backward(grad_output, result, 0).to(grad_output.scalar_type());
  // `other` may broadcast the result beyond the linear output's shape.
  auto linear_sizes = input.sizes().vec();
  linear_sizes.back() = out_features;
  const auto grad_linear = grad_sum.sum_to_size(linear_sizes);
  const auto g2d = grad_linear.reshape({-1, out_features});

  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) {
    grad_input = at::matmul(grad_linear, weight.to(grad_linear.scalar_type()))
                     .to(input.scalar_type());
  }
  if (output_mask[1]) {
    grad_weight = g2d.t().mm(input.reshape({-1, in_features}).to(g2d.scalar_type()))
                      .to(weight.scalar_type());
  }
  if (output_mask[2]) {
    grad_bias = g2d.sum(0);
  }
  return {grad_input, grad_weight, grad_bias, grad_sum};
}

} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
  using namespace torchfuse::ops;
  // NB: on the CPU the kernel is the original chain itself, for every input.
  registerLinearAddRelu<linearAddReluReference, linearAddReluBackwardComposite>(m);
}
