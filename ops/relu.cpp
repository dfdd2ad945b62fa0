// custom_relu: relu(input).
//   custom_relu_forward_mask also returns the 1-bit mask the backward reads
//   (ops/common/relu_mask.h); the Autograd kernel calls it only when a graph
//   is recorded.

#include "ops/relu.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def("custom_relu(Tensor self) -> Tensor");
  m.def("custom_relu_forward_mask(Tensor self) -> (Tensor, Tensor)");
  m.def("custom_relu_backward(Tensor grad_output, Tensor mask) -> Tensor");
}

namespace torchfuse {

at::Tensor custom_relu(const at::Tensor& input) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_relu", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(input);
}

namespace ops {

std::tuple<at::Tensor, at::Tensor> reluForwardMask(const at::Tensor& input) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_relu_forward_mask", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)>();
  return op.call(input);
}

at::Tensor reluBackward(const at::Tensor& grad_output, const at::Tensor& mask) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_relu_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(grad_output, mask);
}

} // namespace ops
} // namespace torchfuse
