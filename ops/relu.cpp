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

#include <algorithm>
#include <numeric>
#include <optional>
#include <vector>

#include "ops/common/checks.h"
#include "ops/common/relu_mask.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def("custom_relu(Tensor self) -> Tensor");
  m.def("custom_relu_forward_mask(Tensor self) -> (Tensor, Tensor)");
  // dim_order: grad_input's dims from outermost to innermost in memory.  The
  // Autograd kernel passes the forward output's, so that grad_input takes
  // the layout eager's threshold_backward gives (self's); None: the layout
  // empty_like(grad_output) gives.
  m.def("custom_relu_backward(Tensor grad_output, Tensor mask, int[]? dim_order=None) -> Tensor");
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

std::optional<std::vector<int64_t>> reluDimOrder(const at::Tensor& t) {
  if (!t.is_non_overlapping_and_dense()) {
    return std::nullopt;
  }
  std::vector<int64_t> order(t.dim());
  std::iota(order.begin(), order.end(), 0);
  const auto strides = t.strides();
  // NB: stable, so that size-1 dims (ties) keep their logical places.
  std::stable_sort(
      order.begin(), order.end(), [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  return order;
}

at::Tensor reluGradInput(const at::Tensor& grad_output, at::OptionalIntArrayRef dim_order) {
  if (!dim_order) {
    return at::empty_like(grad_output);
  }
  const auto order = *dim_order;
  const auto dims = grad_output.dim();
  std::vector<bool> seen(dims, false);
  bool permutation = static_cast<int64_t>(order.size()) == dims;
  for (const auto d : order) {
    permutation = permutation && d >= 0 && d < dims && !seen[d];
    if (permutation) {
      seen[d] = true;
    }
  }
  TORCH_CHECK(
      permutation, kBackwardOp, ": expected dim_order to be a permutation of the ", dims,
      " dims of grad_output, got ", order);
  const auto sizes = grad_output.sym_sizes();
  std::vector<c10::SymInt> outer_first(dims);
  std::vector<int64_t> inverse(dims);
  for (int64_t i = 0; i < dims; ++i) {
    outer_first[i] = sizes[order[i]];
    inverse[order[i]] = i;
  }
  auto out = at::empty_symint(outer_first, grad_output.options());
  return std::is_sorted(order.begin(), order.end()) ? out : out.permute(inverse);
}

std::tuple<at::Tensor, at::Tensor> reluForwardMask(const at::Tensor& input) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_relu_forward_mask", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)>();
  return op.call(input);
}

at::Tensor reluBackward(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    at::OptionalIntArrayRef dim_order) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_relu_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::OptionalIntArrayRef)>();
  return op.call(grad_output, mask, dim_order);
}

} // namespace ops
} // namespace torchfuse

TORCH_LIBRARY_IMPL(torchfuse, CompositeExplicitAutograd, m) {
  torchfuse::ops::registerRelu<torchfuse::ops::reluReference>(m);
}
