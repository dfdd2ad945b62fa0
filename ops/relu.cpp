// custom_relu: relu(input).
//   custom_relu_forward_mask also returns the 1-bit mask the backward reads
//   (ops/common/relu_mask.h); the Autograd kernel calls it only when a graph
//   is recorded.
//
// Inputs the kernels do not take (reluHandles: quantized, sparse, integer,
// ...) run reluReference, the original aten::relu, from every entry point:
// the Autograd, CPU and CUDA kernels call it first, and it is the
// CompositeExplicitAutograd kernel, which backends without a torchfuse kernel
// (QuantizedCPU, SparseCPU, ...) reach.

#include "ops/relu.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/common/relu_mask.h"
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

namespace {
constexpr const char* kOp = "torchfuse::custom_relu";
constexpr const char* kBackwardOp = "torchfuse::custom_relu_backward";
} // namespace

bool reluHandles(const at::Tensor& input) {
  if (!input.defined() || input.layout() != at::kStrided || input.is_quantized() ||
      input.is_nested()) {
    return false;
  }
  const auto s = input.scalar_type();
  return s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16;
}

// NB: `self` can be undefined only through a call with None (Python's
// torch.ops, C++): with no tensor argument the dispatcher picks this
// CompositeExplicitAutograd kernel, which names the argument instead of the
// dispatcher's "There were no tensor arguments".
at::Tensor reluReference(const at::Tensor& input) {
  checkDefined(kOp, "self", input);
  return at::relu(input);
}

void checkReluBackwardMask(const at::Tensor& grad_output, const at::Tensor& mask) {
  checkDefined(kBackwardOp, "grad_output", grad_output);
  checkDefined(kBackwardOp, "mask", mask);
  const int64_t bytes = reluMaskBytes(grad_output.numel());
  TORCH_CHECK(
      mask.scalar_type() == at::kByte && mask.dim() == 1 && mask.numel() == bytes,
      kBackwardOp, ": expected mask to be a 1-D uint8 tensor of ", bytes, " bytes, got ",
      mask.dim(), "-D ", mask.scalar_type(), " of ", mask.numel());
  TORCH_CHECK(
      mask.device() == grad_output.device(), kBackwardOp,
      ": expected mask to be on grad_output's device (", grad_output.device(), "), got ",
      mask.device());
}

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

TORCH_LIBRARY_IMPL(torchfuse, CompositeExplicitAutograd, m) {
  torchfuse::ops::registerRelu<torchfuse::ops::reluReference>(m);
}
