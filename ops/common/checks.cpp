#include "ops/common/checks.h"

#include <ATen/ExpandUtils.h>

namespace torchfuse::ops {

void checkDefined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(
      t.defined(), op, ": expected ", name, " to be a tensor, got None");
}

void checkDim(
    const char* op,
    const char* name,
    const at::Tensor& t,
    int64_t dim) {
  TORCH_CHECK(
      t.dim() == dim,
      op, ": expected ", name, " to be ", dim, "-D, got ", t.dim(), "-D");
}

void checkSameDevice(
    const char* op,
    const char* name,
    const at::Tensor& t,
    const at::Tensor& ref) {
  TORCH_CHECK(
      t.device() == ref.device(),
      op, ": expected ", name, " to be on the same device as input (",
      ref.device(), "), got ", t.device());
}

void checkSameDtype(
    const char* op,
    const char* name,
    const at::Tensor& t,
    const at::Tensor& ref) {
  TORCH_CHECK(
      t.scalar_type() == ref.scalar_type(),
      op, ": expected ", name, " to have the same dtype as input (",
      ref.scalar_type(), "), got ", t.scalar_type());
}

void checkFloating(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(
      at::isFloatingType(t.scalar_type()),
      op, ": expected ", name, " to have a floating-point dtype, got ",
      t.scalar_type());
}

void checkBroadcastable(
    const char* op,
    const at::Tensor& other,
    at::IntArrayRef result_sizes) {
  const auto other_sizes = other.sizes();
  bool ok = true;
  const int64_t n = std::min<int64_t>(other_sizes.size(), result_sizes.size());
  for (int64_t i = 1; i <= n; ++i) {
    const int64_t a = other_sizes[other_sizes.size() - i];
    const int64_t b = result_sizes[result_sizes.size() - i];
    ok = ok && (a == b || a == 1 || b == 1);
  }
  TORCH_CHECK(
      ok, op, ": expected other to be broadcastable to ", result_sizes,
      ", got ", other_sizes);
}

bool anySymbolic(std::initializer_list<at::Tensor> tensors) {
  for (const auto& t : tensors) {
    if (t.defined() && t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
      return true;
    }
  }
  return false;
}

bool isPlainDenseTensor(const at::Tensor& t) {
  return !t.defined() ||
      (t.layout() == at::kStrided && !t.is_quantized() && !t.is_nested() &&
       (t.is_cpu() || t.is_cuda() || t.is_meta()));
}

} // namespace torchfuse::ops
