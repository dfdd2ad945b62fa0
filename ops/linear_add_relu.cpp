// custom_linear_add_relu: relu(linear(input, weight, bias) + alpha * other).
//   input (*, in_features); weight (out_features, in_features); bias
//   (out_features,) or None; other broadcasts with the linear output: a
//   per-feature bias (out_features,), a scalar-like (1,), or a full tensor.
//
// Inputs the kernels do not take (linearAddReluHandles: a bias of shape
// (1, n) or (), a 1-D weight, quantized or sparse tensors, integer dtypes,
// ...) run linearAddReluReference, the original ATen chain, from every
// entry point: the Autograd and CUDA kernels call it first, it is the CPU
// kernel, and it is the CompositeExplicitAutograd kernel, which backends
// without a torchfuse kernel (QuantizedCPU, SparseCPU, ...) reach.

#include "ops/linear_add_relu.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_linear_add_relu(Tensor input, Tensor weight, Tensor? bias, "
      "Tensor other, Scalar alpha=1) -> Tensor");
  m.def(
      "custom_linear_add_relu_backward(Tensor grad_output, Tensor input, "
      "Tensor weight, Tensor result, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

namespace torchfuse {

at::Tensor custom_linear_add_relu(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  // NB: the schema's C++ signature is this function's type.
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_linear_add_relu", "")
                       .typed<decltype(custom_linear_add_relu)>();
  return op.call(input, weight, bias, other, alpha);
}

namespace ops {

namespace {
constexpr const char* kOp = "torchfuse::custom_linear_add_relu";

bool hasBias(const std::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined();
}

// The shape of linear(input, weight) for a 1-D or 2-D weight; a bias that
// is absent or 1-D does not change it.
std::vector<int64_t> linearSizes(const at::Tensor& input, const at::Tensor& weight) {
  auto sizes = input.sizes().vec();
  sizes.pop_back();
  if (weight.dim() == 2) {
    sizes.push_back(weight.size(0));
  }
  return sizes;
}

bool broadcastable(at::IntArrayRef a, at::IntArrayRef b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 1; i <= n; ++i) {
    const int64_t x = a[a.size() - i];
    const int64_t y = b[b.size() - i];
    if (x != y && x != 1 && y != 1) {
      return false;
    }
  }
  return true;
}

bool kernelDtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16;
}

bool plainStrided(const at::Tensor& t) {
  return t.layout() == at::kStrided && !t.is_quantized() && !t.is_nested();
}
} // namespace

void checkLinearAddReluInputs(const LinearAddReluArgs& a) {
  const auto& [input, weight, bias, other, alpha] = a;
  checkDefined(kOp, "input", input);
  checkDefined(kOp, "weight", weight);
  checkDefined(kOp, "other", other);
  // NB: aten::linear takes a 1-D weight (a matrix-vector product).
  TORCH_CHECK(
      weight.dim() == 1 || weight.dim() == 2, kOp,
      ": expected weight to be 1-D or 2-D, got ", weight.dim(), "-D");
  TORCH_CHECK(input.dim() >= 1, kOp, ": expected input to be at least 1-D, got 0-D");
  TORCH_CHECK(
      input.size(-1) == weight.size(-1), kOp,
      ": expected input.size(-1) to equal weight.size(-1) (in_features = ",
      weight.size(-1), "), got ", input.size(-1));
  checkSameDtype(kOp, "weight", weight, input);
  checkSameDevice(kOp, "weight", weight, input);
  // NB: add takes a 0-D CPU tensor with a tensor of any device.
  if (!(other.dim() == 0 && other.is_cpu())) {
    checkSameDevice(kOp, "other", other, input);
  }
  // NB: a bias of another dtype or shape may reach ATen's in-place add,
  // which takes it: those run the reference.  A 1-D bias broadcasts to
  // out_features only from 1 or out_features elements.
  const bool vector_bias = hasBias(bias) && bias->dim() == 1;
  if (vector_bias && weight.dim() == 2) {
    TORCH_CHECK(
        bias->size(0) == weight.size(0) || bias->size(0) == 1, kOp,
        ": expected bias to have weight.size(0) = ", weight.size(0),
        " elements, got ", bias->size(0));
  }
  if (!hasBias(bias) || vector_bias) {
    checkBroadcastable(kOp, other, linearSizes(input, weight));
  }
}

bool linearAddReluHandles(const LinearAddReluArgs& a) {
  const auto& [input, weight, bias, other, alpha] = a;
  const bool has_bias = hasBias(bias);
  if (!input.defined() || !weight.defined() || !other.defined() ||
      !plainStrided(input) || !plainStrided(weight) || !plainStrided(other) ||
      (has_bias && !plainStrided(*bias))) {
    return false;
  }
  const auto dtype = input.scalar_type();
  if (!kernelDtype(dtype) || weight.scalar_type() != dtype ||
      (has_bias && bias->scalar_type() != dtype) ||
      !kernelDtype(c10::promoteTypes(dtype, other.scalar_type())) ||
      alpha.isComplex() || alpha.isBoolean()) {
    return false;
  }
  const auto device = input.device();
  if (weight.device() != device || other.device() != device ||
      (has_bias && bias->device() != device)) {
    return false;
  }
  // NB: symbolic sizes (tracing) cannot be compared without guards; the Meta
  // kernel checks them.
  if (anySymbolic({input, weight, orUndefined(bias), other})) {
    return true;
  }
  if (weight.dim() != 2 || input.dim() < 1 || input.size(-1) != weight.size(1) ||
      (has_bias && (bias->dim() != 1 || bias->size(0) != weight.size(0)))) {
    return false;
  }
  return broadcastable(other.sizes(), linearSizes(input, weight));
}

at::Tensor linearAddReluReference(const LinearAddReluArgs& a) {
  checkLinearAddReluInputs(a);
  return at::relu(at::add(at::linear(a.input, a.weight, a.bias), a.other, a.alpha));
}

at::Tensor linearAddRelu(const LinearAddReluArgs& a) {
  return custom_linear_add_relu(a.input, a.weight, a.bias, a.other, a.alpha);
}

LinearAddReluGrads linearAddReluBackward(const LinearAddReluBackwardArgs& a) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_linear_add_relu_backward", "")
                       .typed<LinearAddReluGrads(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, std::array<bool, 3>)>();
  return op.call(a.grad_output, a.input, a.weight, a.result, a.output_mask);
}

} // namespace ops
} // namespace torchfuse

// NB: also what a call with no tensor argument (all None) reaches, whose
// checks then name the missing argument.
TORCH_LIBRARY_IMPL(torchfuse, CompositeExplicitAutograd, m) {
  using namespace torchfuse::ops;
  registerLinearAddRelu<linearAddReluReference>(m);
}
