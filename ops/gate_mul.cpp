// custom_gate_mul: the gate of a squeeze-and-excitation block applied to
// its input, act(gate) * input with gate [N, C, 1, 1] broadcast over H and
// W, act sigmoid (efficientnet) or hardsigmoid (mobilenet_v3).  Eager runs
// the activation and then ATen's broadcast multiply, which does not
// vectorize; the CUDA kernel is one vectorized pass that reads the input
// once.  passes/fuse_gate_mul.cpp inserts it.
//
// Every other input, every other device, and every call that records a
// graph run the reference, the original ops, so that results, strides,
// errors and derivatives (of any order) are ATen's.

#include "ops/gate_mul.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops/common/checks.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_gate_mul(Tensor input, Tensor gate, str activation, bool gate_first=False) -> "
      "Tensor",
      {at::Tag::flexible_layout});
}

namespace torchfuse {

at::Tensor custom_gate_mul(
    const at::Tensor& input,
    const at::Tensor& gate,
    c10::string_view activation,
    bool gate_first) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_gate_mul", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, bool)>();
  return op.call(input, gate, activation, gate_first);
}

namespace ops {

kernels::Activation parseGateActivation(c10::string_view activation) {
  if (activation == "sigmoid") {
    return {kernels::ActivationKind::kSigmoid};
  }
  if (activation == "hardsigmoid") {
    return {kernels::ActivationKind::kHardsigmoid};
  }
  TORCH_CHECK_VALUE(
      false, "torchfuse::custom_gate_mul: activation must be 'sigmoid' or 'hardsigmoid', got '",
      activation, "'");
}

at::Tensor gateMulReference(
    const at::Tensor& input,
    const at::Tensor& gate,
    c10::string_view activation,
    bool gate_first) {
  checkDefined("torchfuse::custom_gate_mul", "input", input);
  checkDefined("torchfuse::custom_gate_mul", "gate", gate);
  const auto act = parseGateActivation(activation);
  const auto g =
      act.kind == kernels::ActivationKind::kSigmoid ? at::sigmoid(gate) : at::hardsigmoid(gate);
  return gate_first ? at::mul(g, input) : at::mul(input, g);
}

bool gateMulHandles(const at::Tensor& input, const at::Tensor& gate) {
  if (!input.defined() || !gate.defined() || !input.is_cuda() || !gate.is_cuda() ||
      input.device() != gate.device() || input.scalar_type() != gate.scalar_type() ||
      input.dim() != 4 || gate.dim() != 4 || !isPlainDenseTensor(input) ||
      !isPlainDenseTensor(gate)) {
    return false;
  }
  const auto s = input.scalar_type();
  if (s != at::kFloat && s != at::kHalf && s != at::kBFloat16) {
    return false;
  }
  const int64_t n = input.size(0), c = input.size(1), h = input.size(2), w = input.size(3);
  if (c < 2 || h < 2 || w < 2 || n == 0) {
    return false;
  }
  if ((gate.size(0) != n && gate.size(0) != 1) || gate.size(1) != c || gate.size(2) != 1 ||
      gate.size(3) != 1) {
    return false;
  }
  // NB: a gate whose images are inner to its channels would decide that
  // order of TensorIterator's output (it reads the gate first where
  // gate_first) against input's layout.
  if (gate.size(0) > 1 && gate.stride(1) > gate.stride(0)) {
    return false;
  }
  // NB: dense strides exactly, not is_contiguous(memory_format), which also
  // holds for layouts the kernel's indexing does not read.
  const bool nchw = input.stride(3) == 1 && input.stride(2) == w && input.stride(1) == h * w &&
      input.stride(0) == c * h * w;
  const bool nhwc = input.stride(1) == 1 && input.stride(3) == c && input.stride(2) == w * c &&
      input.stride(0) == h * w * c;
  return nchw || nhwc;
}

} // namespace ops
} // namespace torchfuse

TORCH_LIBRARY_IMPL(torchfuse, CompositeExplicitAutograd, m) {
  // NB: backends without a torchfuse kernel reach the original ops here.
  torchfuse::ops::registerGateMul<torchfuse::ops::gateMulReference>(m);
}
